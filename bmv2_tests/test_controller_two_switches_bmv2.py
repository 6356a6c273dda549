"""One controller, two bmv2 switches (each its own rack of namespaces and subnet): a job runs on
switch b while switch a is killed and restarted. The controller re-pushes and reprograms a on its
own, b's job keeps going with exact sums and is never reprogrammed, and a job on the restarted a
then gets exact sums too. While a is away, `counters` and `top` answer for b and mark a unavailable.
Skipped, with the reason, where bmv2 or the compiled P4 program is missing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from switchagg_lab.bmv2.controller_jobs import (
    start_workers,
    stop_together,
    worker_reports,
)
from switchagg_lab.bmv2.skip import skip_reason
from switchagg_lab.testing.controller import Controller
from switchagg_lab.testing.kit import wait_until


@pytest.fixture
def two_beds(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    from switchagg_lab.testbed import Testbed

    with (
        Testbed(2, tmp_path / "bed_a", subnet="10.203.0.") as a,
        Testbed(2, tmp_path / "bed_b", subnet="10.204.0.") as b,
    ):
        yield a, b


def _programmed(address: str) -> bool:
    """The switch at ``address`` holds the controller's L2 entries (so: our pipeline too)."""
    from switchagg_controller import p4_program
    from switchagg_controller.p4rt import P4RuntimeError
    from switchagg_controller.switch_session import SwitchSession

    try:
        with SwitchSession(address, 0, p4_program.P4INFO, primary=False, timeout=10) as s:
            return bool(s.read_table_entries())
    except (P4RuntimeError, TimeoutError):
        return False


def _generation(address: str, job_id: int) -> int | None:
    """The generation of job ``job_id`` as the switch's job table holds it."""
    from switchagg_controller import p4_program
    from switchagg_controller.switch_session import SwitchSession

    with SwitchSession(address, 0, p4_program.P4INFO, primary=False, timeout=10) as s:
        table = s.p4info.tables[p4_program.JOB_TABLE]
        action = s.p4info.actions["MyIngress.set_job"]
        gen_id = next(p.id for p in action.params if p.name == "generation")
        for e in s.read_table_entries():
            if e.table_id == table.id and int.from_bytes(e.match[0].exact.value, "big") == job_id:
                return next(
                    int.from_bytes(p.value, "big") for p in e.action.action.params if p.param_id == gen_id
                )
    return None


def test_one_switch_restarts_while_a_job_runs_on_the_other(two_beds: tuple[Any, Any], tmp_path: Path) -> None:
    from switchagg_controller.topology import dump_topologies

    a, b = two_beds
    topo = tmp_path / "network.yaml"
    topo.write_text(dump_topologies([replace(a.topology(), name="a"), replace(b.topology(), name="b")]))
    c = Controller(tmp_path, ["--topology", str(topo), "--reap-timeout", "600"])
    c.start(listen=f"unix:{tmp_path}/jobs.sock")
    stop = tmp_path / "stop-b"
    try:
        assert _programmed(a.grpc_address) and _programmed(b.grpc_address)
        procs = start_workers(b, c.address, tmp_path, "onb", iterations=20000, timeout=30, stop=stop)

        def done() -> int:
            values = []
            for e in b.endpoints:
                try:
                    values.append(int((tmp_path / f"onb-{e.index}").read_text() or 0))
                except (OSError, ValueError):
                    values.append(0)
            return min(values)

        def running_past(count: int, what: str) -> None:
            wait_until(lambda: done() >= count, 120, f"the workers on b to go on {what}", alive=procs)

        running_past(3, "at the start")
        job_id = 1  # the first job of a fresh controller
        generation = _generation(b.grpc_address, job_id)
        assert generation is not None

        a.switch.kill()
        assert not _programmed(a.grpc_address)
        # With a away, the counters answer for b (its job's counters move) and name a as unavailable.
        ctl_counters = json.loads(c.ctl("counters", *c.client_args(), "--json").stdout)
        planes = {p["data_plane"]: p for p in ctl_counters["data_planes"]}
        assert set(planes) == {"p4:b"} and [u["data_plane"] for u in ctl_counters["unavailable"]] == ["p4:a"]
        (job_b,) = planes["p4:b"]["jobs"]
        assert job_b["job_id"] == job_id and job_b["aggregated"] > 0
        text = c.ctl("counters", *c.client_args()).stdout
        assert "[p4:b]" in text and "[p4:a]\n  unavailable: " in text
        top = json.loads(c.ctl("top", *c.client_args(), "--once", "--json", "--interval", "0.2").stdout)
        assert top["unavailable"] == ["p4:a"] and [p["data_plane"] for p in top["data_planes"]] == ["p4:b"]
        (top_job,) = top["jobs"]
        assert top_job["job_id"] == job_id and top_job["contributions_per_s"] is not None
        a.switch.start()  # comes back empty: no pipeline, no entries
        wait_until(
            lambda: _programmed(a.grpc_address),
            120,
            "the controller to reprogram the restarted switch a",
            0.2,
        )
        # b was left alone: the job runs on with the generation it was installed with.
        assert _generation(b.grpc_address, job_id) == generation
        running_past(done() + 3, "after switch a came back")
        stop_together(stop, tmp_path, "onb", b.endpoints)

        reports = worker_reports(procs)
        assert {r["data_plane"] for r in reports} == {"p4"}
        assert all(r["wrong"] == 0 and r["error"] is None and r["ok"] >= 6 for r in reports), reports

        # A job on the restarted switch a: exact sums.
        after = worker_reports(start_workers(a, c.address, tmp_path, "ona", iterations=3, timeout=30))
        assert all(r["ok"] == 3 and r["wrong"] == 0 and r["error"] is None for r in after), after
        assert {r["data_plane"] for r in after} == {"p4"}
    finally:
        stop.write_text("")
        c.stop()
