"""The controller's bmv2 tests: a switch of the shared testbed (switchagg_lab.testbed) whose restarts
the tests drive, a topology file naming it, and a bounded wait."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from switchagg_lab.testbed import Testbed
from switchagg_lab.testbed.bmv2 import Bmv2Switch
from switchagg_lab.testbed.tools import missing_for_switch


def skip_reason() -> str | None:
    from switchagg_controller import p4_program

    reason = missing_for_switch()
    if reason:
        return reason
    for path in (p4_program.BMV2_JSON, p4_program.P4INFO):
        if not Path(path).is_file():
            return f"the P4 program is not built ({path} is missing)"
    return None


@pytest.fixture
def bmv2(tmp_path: Path) -> Iterator[Bmv2Switch]:
    """A running switch with three ports cabled to endpoint namespaces; kill()/start() restart it."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with Testbed(3, tmp_path / "bed") as bed:
        assert bed.switch is not None
        yield bed.switch


def topology_yaml(address: str, hosts: int = 3) -> str:
    lines = [
        "switch:",
        f"  address: {address}",
        "  device_id: 0",
        "aggregator:",
        "  ip: 10.0.0.254",
        "  mac: 02:00:00:00:00:fe",
        "hosts:",
    ]
    for i in range(1, hosts + 1):
        lines.append(f"  - {{name: h{i}, port: {i}, mac: '02:00:00:00:00:{i:02x}', ip: 10.0.0.{i}}}")
    return "\n".join(lines) + "\n"


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Polls ``predicate`` (bounded); the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
