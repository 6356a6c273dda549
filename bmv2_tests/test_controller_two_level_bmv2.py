"""The controller runs a job across two bmv2 leaves and a bmv2 spine (docs/CONTROLLER.md, Two
levels on P4 switches): the topology names each leaf's uplink, `serve --topology` programs all
three switches, workers in four namespaces join through the job service, each gets its own leaf
as its aggregator, and the sums are exact. Skipped, with the reason, where bmv2 is missing."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from switchagg import protocol
from switchagg_lab.bmv2.controller_jobs import (
    job_counters,
    job_generation,
    min_progress,
    start_workers,
    stop_together,
    worker_reports,
)
from switchagg_lab.bmv2.skip import skip_reason
from switchagg_lab.testing.controller import Controller
from switchagg_lab.testing.kit import wait_until

RACKS = [2, 2]
METRICS = importlib.util.find_spec("prometheus_client") is not None  # pip install .[metrics]


@pytest.fixture
def racks(tmp_path: Path) -> Iterator[Any]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    from switchagg_lab.testbed.p4racks import P4Racks

    with P4Racks(RACKS, tmp_path / "bed", spine="bmv2") as bed:
        yield bed


def _topology(bed: Any) -> str:
    """The spine (no hosts of its own) and the leaves with their uplinks, as the controller reads them."""
    from switchagg_controller.model import Uplink
    from switchagg_controller.topology import dump_topologies
    from switchagg_lab.testbed.p4racks import UPLINK_PORT

    spine = replace(bed.spine_topology(), name="spine", hosts=())
    leaves = [
        replace(bed.leaf_topology(r), name=f"l{r}", uplink=Uplink("spine", UPLINK_PORT, r + 1))
        for r in range(len(RACKS))
    ]
    return dump_topologies([spine, *leaves])


def test_a_job_across_two_bmv2_leaves_and_a_bmv2_spine(racks: Any, tmp_path: Path) -> None:
    from switchagg_controller import p4_program

    topo = tmp_path / "network.yaml"
    topo.write_text(_topology(racks))
    metrics = ["--metrics-port", "0"] if METRICS else []
    c = Controller(tmp_path, ["--topology", str(topo), "--reap-timeout", "600", *metrics])
    c.start(listen=f"unix:{tmp_path}/jobs.sock")
    stop = tmp_path / "stop"
    try:
        workers = SimpleNamespace(endpoints=racks.workers)
        procs = start_workers(workers, c.address, tmp_path, "tl", iterations=100_000, timeout=30, stop=stop)
        wait_until(  # the job runs (it ends when they leave)
            lambda: min_progress(tmp_path, "tl", racks.workers) >= 3,
            120,
            "the workers' progress",
            0.05,
            alive=procs,
        )
        # Every leaf sends partials up and multicasts the spine's results; the spine sums the leaves.
        names = p4_program.JOB_COUNTER_NAMES | p4_program.LEAF_COUNTER_NAMES
        leaves = [job_counters(sw.grpc_address, 0, names) for sw in racks.leaves]
        spine = job_counters(racks.spine.grpc_address, 0, p4_program.JOB_COUNTER_NAMES)
        assert all(leaf["upstream"] > 0 and leaf["multicast"] > 0 for leaf in leaves), leaves
        assert spine["aggregated"] > 0 and spine["multicast"] > 0, spine
        if METRICS:  # the leaves' own counters reach Prometheus; the spine's plain job has none
            from switchagg_lab.testing.controller import metrics_address
            from switchagg_lab.testing.prom import scrape, value

            samples = scrape(metrics_address(c))
            for r in range(len(RACKS)):
                job = {"switchagg_job": "tl", "data_plane": "p4", "switch": f"l{r}"}
                assert value(samples, "switchagg_job_upstream_total", **job) > 0
                assert value(samples, "switchagg_job_aggregated_total", **job) > 0
            assert value(samples, "switchagg_job_aggregated_total", switchagg_job="tl", switch="spine") > 0
            spine_leaf = [
                k for k in samples if k[0] == "switchagg_job_upstream_total" and ("switch", "spine") in k[1]
            ]
            assert not spine_leaf
        stop_together(stop, tmp_path, "tl", racks.workers)
        reports = worker_reports(procs)
        assert sorted(r["rank"] for r in reports) == list(range(sum(RACKS)))
        assert {r["data_plane"] for r in reports} == {"p4"} and {r["k"] for r in reports} == {protocol.P4_K}
        assert all(r["ok"] >= 3 and r["wrong"] == 0 and r["error"] is None for r in reports), reports
        print(f"\nleaves {leaves}; spine {spine}; allreduces {[r['ok'] for r in reports]}")
    finally:
        stop.write_text("")
        c.stop()


@pytest.mark.reliability(
    "bmv2 restarted",
    "a bmv2 leaf of two (bmv2 spine) restarted empty under running workers; the controller reprograms it",
    outcome="exact or failed cleanly (session timeout)",
    state="the leaf reprogrammed with the job's generation",
)
def test_a_leaf_restarted_under_running_workers_is_reprogrammed_and_no_sum_is_wrong(
    racks: Any, tmp_path: Path
) -> None:
    """bmv2 leaf 0 dies mid-job and comes back empty; the controller reprograms it with the job's
    generation unchanged (its registers are zero; a new generation would also reset the spine's
    and leaf 1's rounds in flight). The workers go on exactly, or fail with their session timeout
    (docs/PROTOCOL.md, Restarting a leaf); no sum is ever wrong."""
    topo = tmp_path / "network.yaml"
    topo.write_text(_topology(racks))
    c = Controller(tmp_path, ["--topology", str(topo), "--reap-timeout", "600"])
    c.start(listen=f"unix:{tmp_path}/jobs.sock")
    stop = tmp_path / "stop"
    try:
        workers = SimpleNamespace(endpoints=racks.workers)
        procs = start_workers(workers, c.address, tmp_path, "rs", iterations=100_000, timeout=20, stop=stop)
        wait_until(
            lambda: min_progress(tmp_path, "rs", racks.workers) >= 3,
            120,
            "the workers' progress",
            0.05,
            alive=procs,
        )
        job_id = 1  # the first job of a fresh controller
        generation = job_generation(racks.spine.grpc_address, job_id)
        assert generation is not None and job_generation(racks.leaves[0].grpc_address, job_id) == generation
        racks.leaves[0].restart()  # empty: no pipeline, no entries, zero registers
        wait_until(
            lambda: job_generation(racks.leaves[0].grpc_address, job_id) is not None,
            120,
            "the controller to reprogram the restarted leaf",
            0.2,
        )
        assert job_generation(racks.leaves[0].grpc_address, job_id) == generation
        assert job_generation(racks.spine.grpc_address, job_id) == generation
        assert job_generation(racks.leaves[1].grpc_address, job_id) == generation
        after = min_progress(tmp_path, "rs", racks.workers)
        wait_until(
            lambda: (
                min_progress(tmp_path, "rs", racks.workers) >= after + 3
                or any(p.poll() is not None for p in procs)
            ),
            60,
            "the workers to go on or fail",
        )
        stop_together(stop, tmp_path, "rs", racks.workers)
        reports = worker_reports(procs)
        print("\nafter the leaf restart:", [(r["rank"], r["ok"], r["error"]) for r in reports])
        assert all(r["wrong"] == 0 for r in reports), reports
        for r in reports:
            assert r["ok"] >= 3
            assert (
                r["error"] is None or "timeout" in r["error"].lower() or "progress" in r["error"].lower()
            ), r
    finally:
        stop.write_text("")
        c.stop()
