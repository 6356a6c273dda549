"""A real bmv2 simple_switch_grpc in a network namespace of its own, for the controller's bmv2 tests
(restarts under a running controller; bmv2_testbed.Testbed is the switch with endpoint namespaces).

The switch's gRPC server listens on the namespace side of a veth pair (10.213.<n>.2), the test
talks to it from the root side (10.213.<n>.1); its Thrift server (all addresses) stays inside
the namespace. Nothing is sent anywhere else.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from bmv2_tools import find_tool, missing_for_switch

SIMPLE_SWITCH_GRPC = Path(find_tool("simple_switch_grpc") or "/opt/p4/bin/simple_switch_grpc")
_counter = itertools.count(1)


def skip_reason() -> str | None:
    from switchagg_controller import p4_program

    reason = missing_for_switch()
    if reason:
        return reason
    for path in (p4_program.BMV2_JSON, p4_program.P4INFO):
        if not Path(path).is_file():
            return f"the P4 program is not built ({path} is missing)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Bmv2:
    """One switch; start() and kill() may be repeated (restart tests)."""

    def __init__(self, log_dir: Path) -> None:
        pid, n = os.getpid(), next(_counter)
        self.ns = f"sagg-ctl-{pid}-{n}"
        self.veth = f"sgc{pid % 100000}x{n}"[:15]
        self.subnet = (pid * 8 + n) % 250 + 1
        self.grpc_address = f"10.213.{self.subnet}.2:9559"
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        _ip("netns", "add", self.ns)
        try:
            _ip("-n", self.ns, "link", "set", "lo", "up")
            _ip("link", "add", self.veth, "type", "veth", "peer", "name", "ctl0", "netns", self.ns)
            _ip("addr", "add", f"10.213.{self.subnet}.1/30", "dev", self.veth)
            _ip("link", "set", self.veth, "up")
            _ip("-n", self.ns, "addr", "add", f"10.213.{self.subnet}.2/30", "dev", "ctl0")
            _ip("-n", self.ns, "link", "set", "ctl0", "up")
        except BaseException:
            self.destroy()
            raise

    def start(self) -> Bmv2:
        assert self.proc is None
        self.starts += 1
        log = open(self.log_dir / f"bmv2-{self.starts}.log", "wb")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, str(SIMPLE_SWITCH_GRPC), "--no-p4", "--device-id", "0",
             "--thrift-port", "9090", "--", "--grpc-server-addr", self.grpc_address],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        channel = grpc.insecure_channel(self.grpc_address)
        try:
            grpc.channel_ready_future(channel).result(timeout=60)
        except grpc.FutureTimeoutError:
            self.kill()
            raise RuntimeError(f"bmv2 did not open {self.grpc_address}; see {self.log_dir}") from None
        finally:
            channel.close()
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(30)
            self.proc = None

    def destroy(self) -> None:
        self.kill()
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True, timeout=30)


@pytest.fixture
def bmv2(tmp_path: Path):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    switch = Bmv2(tmp_path)
    try:
        yield switch.start()
    finally:
        switch.destroy()


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
