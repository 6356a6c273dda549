"""Slot allocation: pools never overlap, misfits get a clear error or the fallback, and many
concurrent joins for several jobs through a real job service end with disjoint ranges."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest

from switchagg import protocol
from switchagg._proto import jobs_pb2, jobs_pb2_grpc
from switchagg.aggregator import SoftwareAggregator
from switchagg_controller.allocation import P4, SOFTWARE, AllocationError, SlotAllocator, SlotPool
from switchagg_controller.jobs import JobManager
from switchagg_controller.planes import SoftwareDataPlane
from switchagg_controller.service import make_server
from switchagg_controller.store import Store
from switchagg_lab.testing.controller import aio_join

SECRET = "contention"


def _disjoint(ranges: list[tuple[int, int]]) -> bool:
    ranges = sorted(ranges)
    return all(b0 + c0 <= b1 for (b0, c0), (b1, _) in zip(ranges, ranges[1:], strict=False))


def _largest_gap(live: dict[int, int], size: int) -> int:
    edges = [0] + [e for b, c in sorted(live.items()) for e in (b, b + c)] + [size]
    return max(edges[i + 1] - edges[i] for i in range(0, len(edges), 2))


def test_first_fit_reuses_freed_ranges() -> None:
    pool = SlotPool("p", 100)
    assert [pool.allocate(30), pool.allocate(30), pool.allocate(30)] == [0, 30, 60]
    pool.free(30)
    assert pool.allocate(20) == 30
    assert pool.allocate(10) == 50
    with pytest.raises(AllocationError, match="no free range of 20 slots \\(10 of 100 free\\)"):
        pool.allocate(20)
    assert pool.allocate(10) == 90


def test_random_churn_never_overlaps() -> None:
    rng = random.Random(7)
    pool = SlotPool("p", protocol.P4_NUM_SLOTS)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            base = rng.choice(list(live))
            pool.free(base)
            del live[base]
        else:
            count = rng.randint(1, 128)
            try:
                live[pool.allocate(count)] = count
            except AllocationError:
                assert _largest_gap(live, protocol.P4_NUM_SLOTS) < count  # refused only when nothing fits
        assert _disjoint(list(live.items()))
        assert all(b >= 0 and b + c <= protocol.P4_NUM_SLOTS for b, c in live.items())
        assert pool.free_slots() == protocol.P4_NUM_SLOTS - sum(live.values())


def test_bad_requests_and_reservations() -> None:
    pool = SlotPool("P4 switch pool", 1024)
    with pytest.raises(AllocationError, match="1..1024 slots, not 0"):
        pool.allocate(0)
    with pytest.raises(AllocationError, match="1..1024 slots, not 2000"):
        pool.allocate(2000)
    pool.reserve(100, 50)
    with pytest.raises(AllocationError, match="overlaps 100\\+50"):
        pool.reserve(120, 10)
    with pytest.raises(AllocationError, match="outside"):
        pool.reserve(1000, 50)
    with pytest.raises(AllocationError, match="no range starts at slot 7"):
        pool.free(7)


def test_fallback_placement_says_where_it_went() -> None:
    alloc = SlotAllocator(p4_slots=100, sw_slots=1000)
    first = alloc.place([(P4, 80), (SOFTWARE, 500)])
    second = alloc.place([(P4, 80), (SOFTWARE, 500)])
    assert (first.data_plane, first.slot_base) == (P4, 0)
    assert (second.data_plane, second.slot_base) == (SOFTWARE, 0)
    alloc.place([(SOFTWARE, 500)])
    with pytest.raises(
        AllocationError, match="P4 switch pool: no free range.*software aggregator pool: no free"
    ):
        alloc.place([(P4, 80), (SOFTWARE, 500)])
    with pytest.raises(AllocationError, match="no p4 data plane is configured"):
        SlotAllocator(p4_slots=None).place([(P4, 1)])


async def test_concurrent_joins_for_several_jobs_get_disjoint_slots(tmp_path: Path) -> None:
    """In process: the job service on this test's event loop, 24 joins waiting at once on it."""
    jobs, n = 6, 4
    with SoftwareAggregator("127.0.0.1", 0) as agg:
        store = Store(tmp_path / "ctl.db")
        # 6 jobs of 5000 slots fit (30000 of 32768); the 7th cannot.
        manager = JobManager(store, [SoftwareDataPlane(agg, default_slots=5000)], join_timeout=60)
        server, port = make_server(manager, SECRET, "127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = jobs_pb2_grpc.JobServiceStub(channel)
                order = [(j, m) for j in range(jobs) for m in range(n)]
                random.Random(3).shuffle(order)
                replies = await asyncio.gather(
                    *(aio_join(stub, SECRET, f"job{j}", n, "127.0.0.1", 41000 + j * n + m) for j, m in order)
                )
                by_job: dict[int, list[jobs_pb2.JoinReply]] = {}
                for a in replies:
                    by_job.setdefault(a.job_id, []).append(a)
                assert len(by_job) == jobs
                for members in by_job.values():
                    assert sorted(a.rank for a in members) == list(range(n))
                    assert len({(a.slot_base, a.slot_count, a.generation) for a in members}) == 1
                ranges = [(m[0].slot_base, m[0].slot_count) for m in by_job.values()]
                assert _disjoint(ranges) and all(c == 5000 for _, c in ranges)
                assert len({m[0].generation for m in by_job.values()}) == jobs

                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await aio_join(stub, SECRET, "one-too-many", 1, "127.0.0.1", 42000, timeout=10)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "cannot be placed" in str(e.value.details()) and "no free range" in str(
                    e.value.details()
                )
                # Freeing one job makes room again, at the freed range.
                freed = by_job[min(by_job)][0]
                await manager.teardown(str(freed.job_id))
                again = await aio_join(stub, SECRET, "one-too-many", 1, "127.0.0.1", 42000, timeout=10)
                assert again.slot_base == freed.slot_base
        finally:
            await server.stop(0)
            store.close()
