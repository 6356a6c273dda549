"""Fixtures of the bmv2 suite: one switch with six endpoint namespaces for the whole session.

Every test installs the jobs it needs with ``apply`` (the desired state as a whole), so tests
do not depend on each other; counters are compared as differences.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# The controller's bmv2 tests share the job service harness with the controller's tests.
sys.path.insert(1, str(Path(__file__).parents[1] / "tests"))

from switchagg_lab.testbed.tools import missing_for_switch  # noqa: E402

ENDPOINTS = 6


def _skip_reason() -> str | None:
    reason = missing_for_switch()
    if reason:
        return reason
    try:
        import switchagg_controller.switch_session  # noqa: F401
    except ImportError as e:
        return f"the controller's P4Runtime side (finsy) is not importable: {e}"
    try:
        import scapy  # noqa: F401
    except ImportError:
        return "bmv2 tests need scapy (pip install scapy)"
    from switchagg_controller import p4_program

    if not p4_program.BMV2_JSON.exists() or not p4_program.P4INFO.exists():
        return f"compiled P4 program missing ({p4_program.BMV2_JSON}); run `make -C p4`"
    return None


@pytest.fixture(scope="session")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from switchagg_lab.testbed import Testbed

    with Testbed(ENDPOINTS, tmp_path_factory.mktemp("bmv2")) as tb:
        yield tb


@pytest.fixture(scope="session")
def switch(bed: Any) -> Iterator[Any]:
    from switchagg_controller import p4_program
    from switchagg_controller.switch_session import SwitchSession

    session = SwitchSession(
        bed.grpc_address, bed.device_id, p4_program.P4INFO, p4_program.BMV2_JSON, force_pipeline=True
    )
    with session:
        yield session


@pytest.fixture
def wire(bed: Any, switch: Any) -> Iterator[Any]:
    from bmv2_frames import Wire

    w = Wire(bed.endpoints)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(autouse=True)
def _no_loss(request: pytest.FixtureRequest) -> Iterator[None]:
    """Loss injected by a test never leaks into the next one."""
    yield
    if "bed" in request.fixturenames:
        for e in request.getfixturevalue("bed").endpoints:
            e.set_loss(0)
