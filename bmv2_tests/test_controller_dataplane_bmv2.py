"""Workers in their own network namespaces join through the controller's job service (a Unix
socket, reachable from every namespace) and allreduce through a real bmv2 the controller
programmed; then the switch is killed and restarted under running workers: the supervisor
reprograms it, and every allreduce either gives the exact sum or fails with a clear error.

Uses the bmv2 testbed of bmv2_tests/ (one namespace per endpoint, veth-cabled to the switch);
skipped, with the reason, where bmv2 or the compiled P4 program is missing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from switchagg_lab.bmv2.controller_jobs import start_workers, topology_file, worker_reports
from switchagg_lab.testing.controller import Controller
from switchagg_lab.testing.kit import wait_until


@pytest.fixture
def controller(own_bed: Any, tmp_path: Path) -> Iterator[Controller]:
    topo = topology_file(own_bed, tmp_path / "topology.yaml")
    c = Controller(tmp_path, ["--topology", str(topo), "--reap-timeout", "600"])
    c.start(listen=f"unix:{tmp_path}/jobs.sock")
    yield c
    c.stop()


def test_workers_allreduce_through_the_programmed_switch(
    own_bed: Any, controller: Controller, tmp_path: Path
) -> None:
    reports = worker_reports(
        start_workers(own_bed, controller.address, tmp_path, "dp", iterations=3, timeout=30)
    )
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
    procs = start_workers(own_bed, controller.address, tmp_path, "restart", iterations=400, timeout=20)

    def done(index: int) -> int:
        try:
            return int((tmp_path / f"restart-{index}").read_text() or 0)
        except (OSError, ValueError):
            return 0

    wait_until(  # let every worker get going
        lambda: min(done(e.index) for e in own_bed.endpoints) >= 3,
        120,
        "3 allreduces on every worker",
        alive=procs,
    )
    assert max(done(e.index) for e in own_bed.endpoints) < 400 and all(p.poll() is None for p in procs)
    own_bed.switch.restart()  # the switch dies mid-training and comes back without any state

    reports = worker_reports(procs)
    print("after the restart:", [(r["rank"], r["ok"], r["error"]) for r in reports])  # shown with -s
    assert all(r["wrong"] == 0 for r in reports), reports
    for r in reports:
        assert r["ok"] >= 3
        assert r["error"] is None or "timeout" in r["error"].lower() or "progress" in r["error"].lower(), r
    listing = controller.ctl("jobs", *controller.client_args()).stdout
    assert "restart" not in listing  # every worker left (or the job was removed) at the end
