"""Workers in their own network namespaces join through the controller's job service (a Unix
socket, reachable from every namespace) and allreduce through a real bmv2 the controller
programmed; then the switch is killed and restarted under running workers: the supervisor
reprograms it, and every allreduce either gives the exact sum or fails with a clear error.

Uses the bmv2 testbed of bmv2_tests/ (one namespace per endpoint, veth-cabled to the switch);
skipped, with the reason, where bmv2 or the compiled P4 program is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from controller_support import SECRET, Controller

WORKER = str(Path(__file__).parent / "controller_dp_worker.py")


def _skip_reason() -> str | None:
    from switchagg_controller import p4_program
    from switchagg_lab.testbed.tools import missing_for_switch

    reason = missing_for_switch()
    if reason:
        return reason
    if not p4_program.BMV2_JSON.exists() or not p4_program.P4INFO.exists():
        return f"compiled P4 program missing ({p4_program.BMV2_JSON}); run `make -C p4`"
    return None


@pytest.fixture
def own_bed(tmp_path: Path) -> Iterator[Any]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from switchagg_lab.testbed import Testbed

    with Testbed(3, tmp_path / "own_bed") as tb:
        yield tb


def _topology_file(own_bed: Any, path: Path) -> Path:
    from switchagg_controller.topology import dump_topology

    path.write_text(dump_topology(own_bed.topology()))
    return path


def _start(
    own_bed: Any,
    service: str,
    tmp: Path,
    name: str,
    iterations: int,
    timeout: float,
    stop: Path | None = None,
) -> list[Any]:
    procs = []
    for e in own_bed.endpoints:
        cfg = {
            "service": service, "secret": SECRET, "name": name, "n": len(own_bed.endpoints), "ip": e.ip,
            "length": 1000, "iterations": iterations, "timeout": timeout,
            "progress": str(tmp / f"{name}-{e.index}"), "stop": str(stop) if stop else None,
        }  # fmt: skip
        procs.append(
            e.popen([sys.executable, WORKER, json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    return procs


def progress(tmp: Path, name: str, endpoints: Any) -> list[int]:
    """The allreduces each worker finished so far (0 for a file not there or read mid-write)."""
    done = []
    for e in endpoints:
        try:
            done.append(int((tmp / f"{name}-{e.index}").read_text() or 0))
        except (OSError, ValueError):
            done.append(0)
    return done


def stop_together(stop: Path, tmp: Path, name: str, endpoints: Any) -> None:
    """Ends the workers' run at one iteration none of them began yet. (An empty stop file ends
    each at its next check: one that finished an allreduce first may begin the next one while
    its peers stop, and then waits for its session timeout.) Peers are at most one allreduce
    apart, and a progress file read mid-write counts 0: two past the most seen is safe."""
    part = stop.with_name(stop.name + ".part")
    part.write_text(str(max(progress(tmp, name, endpoints)) + 2))
    os.replace(part, stop)  # whole: a worker never reads half of it


def _reports(procs: list[Any], timeout: float = 300) -> list[dict[str, Any]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a worker hung") from None
        assert p.returncode == 0, stderr[-2000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.fixture
def controller(own_bed: Any, tmp_path: Path) -> Iterator[Controller]:
    topo = _topology_file(own_bed, tmp_path / "topology.yaml")
    c = Controller(tmp_path, ["--topology", str(topo), "--reap-timeout", "600"])
    c.start(listen=f"unix:{tmp_path}/jobs.sock")
    yield c
    c.stop()


def test_workers_allreduce_through_the_programmed_switch(
    own_bed: Any, controller: Controller, tmp_path: Path
) -> None:
    reports = _reports(_start(own_bed, controller.address, tmp_path, "dp", iterations=3, timeout=30))
    assert sorted(r["rank"] for r in reports) == [0, 1, 2]
    assert {r["data_plane"] for r in reports} == {"p4"} and {r["k"] for r in reports} == {64}
    assert all(r["ok"] == 3 and r["wrong"] == 0 and r["error"] is None for r in reports), reports
    counters = controller.ctl("counters", *controller.client_args()).stdout
    assert "[p4]" in counters


@pytest.mark.reliability(
    "bmv2 restarted",
    "bmv2 killed under 3 workers running 400 allreduces, back without state; the controller reprograms it",
    outcome="exact or failed cleanly (session timeout)",
    state="the switch reprogrammed; every worker left the job",
)
def test_switch_restart_under_running_workers_never_gives_a_wrong_sum(
    own_bed: Any, controller: Controller, tmp_path: Path
) -> None:
    procs = _start(own_bed, controller.address, tmp_path, "restart", iterations=400, timeout=20)

    def done(index: int) -> int:
        try:
            return int((tmp_path / f"restart-{index}").read_text() or 0)
        except (OSError, ValueError):
            return 0

    deadline = time.monotonic() + 120
    while min(done(e.index) for e in own_bed.endpoints) < 3:  # let every worker get going
        assert time.monotonic() < deadline, "the workers never made progress"
        assert all(p.poll() is None for p in procs), "a worker ended early"
        time.sleep(0.1)
    assert max(done(e.index) for e in own_bed.endpoints) < 400 and all(p.poll() is None for p in procs)
    own_bed.switch.restart()  # the switch dies mid-training and comes back without any state

    reports = _reports(procs)
    print("after the restart:", [(r["rank"], r["ok"], r["error"]) for r in reports])  # shown with -s
    assert all(r["wrong"] == 0 for r in reports), reports
    for r in reports:
        assert r["ok"] >= 3
        assert r["error"] is None or "timeout" in r["error"].lower() or "progress" in r["error"].lower(), r
    listing = controller.ctl("jobs", *controller.client_args()).stdout
    assert "restart" not in listing  # every worker left (or the job was removed) at the end
