"""`switchagg-ctl serve --metrics-port` on a real bmv2: the P4 switch's counters, read over
P4Runtime at scrape time, move as workers in their own namespaces allreduce through it; killed,
the switch shows up as `switchagg_switch_up 0` and the scrape still answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client", reason="the metrics need prometheus-client (pip install .[metrics])")

from switchagg import protocol  # noqa: E402
from switchagg_lab.bmv2.controller_jobs import (  # noqa: E402
    progress,
    start_workers,
    stop_together,
    topology_file,
    worker_reports,
)
from switchagg_lab.testing.controller import Controller, metrics_address  # noqa: E402
from switchagg_lab.testing.kit import wait_until
from switchagg_lab.testing.prom import scrape, value  # noqa: E402

LENGTH = 1000  # the job_worker tensors of controller_jobs.start_workers
CHUNKS = -(-LENGTH // protocol.P4_K)


def _wait_progress(tmp: Path, name: str, bed: Any, procs: list[Any], at_least: int) -> list[int]:
    wait_until(
        lambda: min(progress(tmp, name, bed.endpoints)) >= at_least,
        120,
        f"{at_least} allreduces on every worker",
        0.05,
        alive=procs,
    )
    return progress(tmp, name, bed.endpoints)


def test_p4_counters_move_as_a_job_runs_and_a_dead_switch_is_down(own_bed: Any, tmp_path: Path) -> None:
    topo = topology_file(own_bed, tmp_path / "topology.yaml")
    ctl = Controller(tmp_path, ["--topology", str(topo), "--reap-timeout", "600", "--metrics-port", "0"])
    ctl.start(listen=f"unix:{tmp_path}/jobs.sock")
    stop = tmp_path / "stop"
    try:
        address = metrics_address(ctl)
        switch = own_bed.topology().name
        idle = scrape(address)
        assert value(idle, "switchagg_switch_up", switch=switch, data_plane="p4") == 1
        assert value(idle, "switchagg_switch_primary", switch=switch) == 1
        assert value(idle, "switchagg_switch_programmed_total", switch=switch) >= 1
        assert value(idle, "switchagg_slots_free", switch=switch) == protocol.P4_NUM_SLOTS

        n = len(own_bed.endpoints)
        procs = start_workers(
            own_bed, ctl.address, tmp_path, "metrics", iterations=100_000, timeout=30, stop=stop
        )
        try:
            finished = min(_wait_progress(tmp_path, "metrics", own_bed, procs, 3))
            first = scrape(address)
            job = {"switchagg_job": "metrics", "data_plane": "p4", "switch": switch}
            # Every finished allreduce had all its contributions aggregated by the switch.
            aggregated = value(first, "switchagg_job_aggregated_total", **job)
            assert aggregated >= finished * n * CHUNKS
            # and its bytes: every aggregated frame is an Ethernet/IP/UDP frame of at least a header
            aggregated_bytes = value(first, "switchagg_job_aggregated_bytes_total", **job)
            assert aggregated_bytes >= aggregated * (14 + 20 + 8 + protocol.HEADER_LEN)
            assert value(first, "switchagg_job_slots", **job) == 64
            assert value(first, "switchagg_slots_allocated", switch=switch) == 64
            assert value(first, "switchagg_service_jobs", state="active") == 1
            assert value(first, "switchagg_join_seconds_count", outcome="ok") == n

            later = max(progress(tmp_path, "metrics", own_bed.endpoints)) + 2
            finished = min(_wait_progress(tmp_path, "metrics", own_bed, procs, later))
            second = scrape(address)
            moved = value(second, "switchagg_job_aggregated_total", **job)
            assert moved >= finished * n * CHUNKS and moved > aggregated
            assert value(second, "switchagg_job_multicast_total", **job) >= finished * CHUNKS
        finally:
            stop_together(stop, tmp_path, "metrics", own_bed.endpoints)
            reports = worker_reports(procs)
        assert all(r["wrong"] == 0 and r["error"] is None for r in reports), reports

        own_bed.switch.kill()
        for _ in range(3):  # down, and every scrape still answers
            down = scrape(address)
            assert value(down, "switchagg_switch_up", switch=switch, data_plane="p4") == 0
            assert not [k for k in down if k[0] == "switchagg_drops_total"]
        assert value(down, "switchagg_service_jobs", state="active") == 0
    finally:
        ctl.stop()
