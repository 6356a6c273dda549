"""End to end: worker processes in their namespaces allreduce through bmv2 with the host library."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from switchagg import protocol
from switchagg_controller import p4_program
from switchagg_lab.bmv2.frames import counters, delta
from switchagg_lab.bmv2.run import check_results, finish, start_job
from switchagg_lab.bmv2.switch_jobs import make_job
from switchagg_lab.testing.checks import hello_rounds

TENSORS = [("int32", 4096), ("int32", 1000), ("float32", 2048)]


@pytest.mark.parametrize("n", [2, 4])
def test_allreduce_exact(n: int, bed: Any, switch: Any, tmp_path: Path) -> None:
    eps = bed.endpoints[:n]
    job = make_job(21, eps, slot_base=64, slot_count=16, counter_index=1)
    switch.apply(p4_program.desired_state(bed.topology(), [job]))
    before = counters(switch, {job.job_id: job.counter_index})
    finish(start_job(job, eps, TENSORS, tmp_path))
    stats = check_results(job, TENSORS, tmp_path)
    _, jobs = delta(before, counters(switch, {job.job_id: job.counter_index}))
    # Every chunk completes once: float32 tensors add a PRIME round per slot; the sessions' hello its
    # rounds (the same on every rank).
    chunks = sum((size + 63) // 64 for _, size in TENSORS) + min(job.slot_count, (2048 + 63) // 64)
    chunks += hello_rounds(stats)
    assert jobs[job.job_id]["multicast"] == chunks
    assert jobs[job.job_id]["aggregated"] == chunks * n


# float32 calls in 16- and 8-bit lanes, and an int32 call between them (always 32-bit lanes).
NARROW = [("float32/16", 2000), ("int32", 300), ("float32/8", 3000)]


def test_allreduce_narrow_lanes(bed: Any, switch: Any, tmp_path: Path) -> None:
    """docs/PROTOCOL.md, Narrow lanes, through the P4 switch's per-lane add and per-byte scale max:
    every rank within the width's bound, ranks bitwise equal, every chunk (V values) completed once."""
    eps = bed.endpoints[:3]
    job = make_job(23, eps, slot_base=160, slot_count=16, counter_index=7)
    switch.apply(p4_program.desired_state(bed.topology(), [job]))
    before = counters(switch, {job.job_id: job.counter_index})
    finish(start_job(job, eps, NARROW, tmp_path, seed=3))
    stats = check_results(job, NARROW, tmp_path, seed=3)
    _, jobs = delta(before, counters(switch, {job.job_id: job.counter_index}))
    chunks = hello_rounds(stats)
    for spec, size in NARROW:
        bits = int(spec.partition("/")[2] or 32)
        data = -(-size // protocol.lanes_per_packet(protocol.P4_K, bits))
        chunks += data + (min(job.slot_count, data) if spec.startswith("float32") else 0)  # PRIME rounds
    assert jobs[job.job_id]["multicast"] == chunks
    assert jobs[job.job_id]["aggregated"] == chunks * len(eps)


@pytest.mark.reliability(
    "loss",
    "bmv2 data plane: 10% of aggregation packets dropped each way at every worker (nftables), "
    "4 ranks x 2 allreduces",
    sums=8,
    recovery="every loss repaired by retransmission",
    state="nothing: rules removed",
)
def test_allreduce_survives_loss(bed: Any, switch: Any, tmp_path: Path) -> None:
    eps = bed.endpoints[:4]
    job = make_job(22, eps, slot_base=128, slot_count=16, counter_index=2)
    switch.apply(p4_program.desired_state(bed.topology(), [job]))
    for e in eps:
        e.set_loss(10)  # 10 % of aggregation packets in each direction, at every worker
    tensors = [("int32", 4096), ("float32", 1024)]
    before = counters(switch, {job.job_id: job.counter_index})
    finish(start_job(job, eps, tensors, tmp_path, seed=5))
    check_results(job, tensors, tmp_path, seed=5)
    _, jobs = delta(before, counters(switch, {job.job_id: job.counter_index}))
    lost = sum(e.lost() for e in eps)
    # Loss happened (hundreds of packets at 10 %) and was repaired by resends.
    assert lost > 0
    assert jobs[job.job_id]["resent"] + jobs[job.job_id]["retrans_ignored"] > 0, jobs


def test_two_jobs_at_once(bed: Any, switch: Any, tmp_path: Path) -> None:
    a = make_job(31, bed.endpoints[0:2], slot_base=200, slot_count=8, counter_index=3)
    b = make_job(32, bed.endpoints[2:5], slot_base=208, slot_count=8, counter_index=4)
    switch.apply(p4_program.desired_state(bed.topology(), [a, b]))
    tensors = [("int32", 3000), ("int32", 64)]
    procs = start_job(a, bed.endpoints[0:2], tensors, tmp_path, seed=1)
    procs += start_job(b, bed.endpoints[2:5], tensors, tmp_path, seed=2)
    finish(procs)
    check_results(a, tensors, tmp_path, seed=1)
    check_results(b, tensors, tmp_path, seed=2)
