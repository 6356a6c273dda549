"""Two-level software aggregation through the controller (docs/CONTROLLER.md, Two levels in
software): one slot range common to the spine and every leaf a job crosses, the flat fallback when
there is none, the per-leaf install, and a real `switchagg-ctl serve` with 2 leaves x 2 workers
joining through the job service, int32 exact. Everything runs on loopback (127.0.x.y)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest

from switchagg import Session
from switchagg.aggregator import SoftwareAggregator
from switchagg_controller.allocation import SOFTWARE, TWO_LEVEL, AllocationError, Placement, SlotAllocator
from switchagg_controller.jobs import JobManager
from switchagg_controller.planes import SoftwareDataPlane
from switchagg_controller.service import make_server
from switchagg_controller.store import Store
from switchagg_controller.topology import TopologyError
from switchagg_controller.two_level_plane import TwoLevelDataPlane
from switchagg_controller.two_level_spec import parse_two_level
from switchagg_lab.testing.controller import SECRET, Controller, collect, expected_int_sum, start_workers
from switchagg_lab.testing.topologies import LOOPBACK_TWO_LEVEL as SPEC
from switchagg_lab.testing.topologies import LOOPBACK_WORKER_IPS as WORKER_IPS


def test_place_on_all_takes_the_lowest_range_free_everywhere() -> None:
    a = SlotAllocator(p4_slots=None)
    for key in ("spine", "l0", "l1"):
        a.add_pool(key, 100)
    assert a.place_on_all(TWO_LEVEL, ("spine", "l0"), 10).slot_base == 0  # spine, l0: 0..9
    assert a.place_on_all(TWO_LEVEL, ("l1",), 15).slot_base == 0  # l1: 0..14
    p = a.place_on_all(TWO_LEVEL, ("spine", "l0", "l1"), 10)
    assert (p.slot_base, p.pool_keys) == (15, ("spine", "l0", "l1"))  # past both, on all three
    assert a.ranges("spine") == a.ranges("l0") == [(0, 10), (15, 10)]
    assert a.ranges("l1") == [(0, 15), (15, 10)]
    with pytest.raises(AllocationError, match="no free range of 80 slots"):
        a.place_on_all(TWO_LEVEL, ("spine", "l1"), 80)
    assert a.ranges("spine") == [(0, 10), (15, 10)]  # a refusal takes nothing
    a.release(p)
    assert a.ranges("l1") == [(0, 15)] and a.ranges("spine") == [(0, 10)]


def test_place_on_all_matches_a_brute_force_search_under_churn() -> None:
    rng = random.Random(11)
    keys = ("s", "a", "b", "c")
    a = SlotAllocator(p4_slots=None)
    for key in keys:
        a.add_pool(key, 200)
    live: list[Placement] = []
    for _ in range(1500):
        if live and rng.random() < 0.45:
            a.release(live.pop(rng.randrange(len(live))))
            continue
        chosen = ("s", *rng.sample(keys[1:], rng.randint(1, 3)))
        count = rng.randint(1, 40)
        used = {k: [r for p in live if k in p.pool_keys for r in [(p.slot_base, p.slot_count)]] for k in keys}
        free_everywhere = [
            b for b in range(200 - count + 1)
            if all(not (b < ub + uc and ub < b + count) for k in chosen for ub, uc in used[k])
        ]  # fmt: skip
        try:
            p = a.place_on_all(TWO_LEVEL, chosen, count)
        except AllocationError:
            assert not free_everywhere
            continue
        assert p.slot_base == free_everywhere[0]
        live.append(p)


def test_reserve_on_all_is_all_or_nothing() -> None:
    a = SlotAllocator(p4_slots=None)
    a.add_pool("x", 50)
    a.add_pool("y", 50)
    a.place_on_all(TWO_LEVEL, ("y",), 10)
    with pytest.raises(AllocationError, match="overlaps"):
        a.reserve(Placement(TWO_LEVEL, 5, 10, ("x", "y")))
    assert a.ranges("x") == []


def test_two_level_file_errors_name_the_line() -> None:
    with pytest.raises(TopologyError, match=r"<two-level>:4: leaves\[1\].subnets: overlaps"):
        parse_two_level(
            "spine: {listen: 127.0.0.1:1}\nleaves:\n"
            "  - {name: a, listen: 127.0.0.2:1, subnets: [10.0.0.0/8]}\n"
            "  - {name: b, listen: 127.0.0.3:1, subnets: [10.1.0.0/16]}\n"
        )
    with pytest.raises(TopologyError, match="is not an IPv4 subnet"):
        parse_two_level(
            "spine: {listen: 127.0.0.1:1}\nleaves:\n  - {name: a, listen: 127.0.0.2:1, subnets: [x]}\n"
        )


async def _join_all(manager: JobManager, name: str, ips: list[str], ports: list[int]) -> list:
    return list(
        await asyncio.gather(
            *(manager.join(name, len(ips), ip, port, timeout=30) for ip, port in zip(ips, ports, strict=True))
        )
    )


async def test_manager_installs_per_leaf_and_falls_back_to_flat(tmp_path: Path) -> None:
    spec = parse_two_level(SPEC)
    with (
        SoftwareAggregator(*spec.spine) as spine,
        SoftwareAggregator(*spec.leaves[0].listen) as l0,
        SoftwareAggregator(*spec.leaves[1].listen) as l1,
        SoftwareAggregator("127.0.0.1", 0) as flat,
    ):
        two = TwoLevelDataPlane(spec, spine, [l0, l1], k=64, default_slots=16384)
        manager = JobManager(Store(tmp_path / "s.db"), [two, SoftwareDataPlane(flat, k=64, default_slots=16)])
        # A job on rack1 only, then one across both racks: the same range on spine and leaves.
        (only1,) = await _join_all(manager, "rack1", ["127.0.2.9"], [7000])
        both = await _join_all(manager, "both", WORKER_IPS, [7001, 7002, 7003, 7004])
        assert only1.data_plane == TWO_LEVEL and only1.slot_base == 0
        assert {(a.data_plane, a.job_id, a.slot_base) for a in both} == {(TWO_LEVEL, both[0].job_id, 16384)}
        by_ip = {ip: a for ip, a in zip(WORKER_IPS, both, strict=True)}
        for ip, a in by_ip.items():  # each worker is told ITS leaf
            leaf = l0 if ip.startswith("127.0.1.") else l1
            assert (a.aggregator_ip, a.aggregator_port) == leaf.address
        job = both[0].job_id
        c0, c1, cs = (agg.counters()["jobs"][job] for agg in (l0, l1, spine))
        assert "upstream" in c0 and "upstream" in c1 and "upstream" not in cs  # leaves vs spine
        # The spine has no range of 16384 left: a third job falls back to the flat aggregator.
        third = await _join_all(manager, "third", ["127.0.1.7", "127.0.2.7"], [7005, 7006])
        assert {a.data_plane for a in third} == {SOFTWARE}
        assert {(a.aggregator_ip, a.aggregator_port) for a in third} == {flat.address}
        # A worker behind no leaf: flat too.
        outside = await _join_all(manager, "outside", ["127.0.9.1"], [7007])
        assert outside[0].data_plane == SOFTWARE
        # Removing the cross-rack job frees its range on all three pools and on the aggregators.
        await manager.teardown("both")
        assert job not in l0.counters()["jobs"] and job not in spine.counters()["jobs"]
        assert manager.allocator.ranges("two-level:spine") == [(0, 16384)]
        assert manager.allocator.ranges("two-level:rack0") == []


async def test_sessions_through_the_manager_sum_exactly(tmp_path: Path) -> None:
    """In process: the job service on this test's loop, real Sessions (threads: they are the
    workers) on 4 loopback addresses, real aggregators."""
    spec = parse_two_level(SPEC)
    with (
        SoftwareAggregator(*spec.spine) as spine,
        SoftwareAggregator(*spec.leaves[0].listen) as l0,
        SoftwareAggregator(*spec.leaves[1].listen) as l1,
    ):
        two = TwoLevelDataPlane(spec, spine, [l0, l1], k=64, default_slots=8)
        manager = JobManager(Store(tmp_path / "s.db"), [two])
        server, port = make_server(manager, SECRET, "127.0.0.1:0")
        await server.start()
        try:
            results: list = [None] * 4
            seen: list = [None] * 4

            def worker(i: int) -> None:
                with Session.from_job_service(
                    f"127.0.0.1:{port}", SECRET, "j", 4, bind=(WORKER_IPS[i], 0)
                ) as s:
                    x = (np.arange(5000, dtype=np.int64) * 3 + s.assignment.rank * 1_000_003).astype(np.int32)
                    s.allreduce(x)
                    results[s.assignment.rank] = x
                    seen[s.assignment.rank] = [c for c in two.counter_values() if c.scope == "job"]

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:  # the loop serves the joins while we wait (bounded)
                await asyncio.to_thread(t.join, 120)
            parts = [np.arange(5000, dtype=np.int64) * 3 + r * 1_000_003 for r in range(4)]
            want = np.sum(parts, axis=0).astype(np.int32)
            for x in results:
                assert x is not None and np.array_equal(x, want)
            names = {(c.data_plane, c.name) for c in seen[0]}
            assert ("two-level:rack0", "upstream") in names and ("two-level:spine", "aggregated") in names
        finally:
            await server.stop(0)


def test_serve_two_level_end_to_end_int32_exact(tmp_path: Path) -> None:
    spec = tmp_path / "two-level.yaml"
    spec.write_text(SPEC)
    c = Controller(
        tmp_path, ["--two-level", str(spec), "--software", "--software-listen", "127.0.0.1:0"]
    ).start()
    try:
        assert "two-level spine 127.0.0.254:" in c.banner
        length = 3000
        procs = start_workers(c.address, SECRET, "racks", 4, length, seed=5, bind_ips=WORKER_IPS)
        results = collect(procs)
        total, head = expected_int_sum(4, length, 5)
        assert {r["data_plane"] for r in results} == {TWO_LEVEL}
        assert len({(r["job_id"], r["slot_base"]) for r in results}) == 1
        assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
        for r in results:
            assert r["int_sum"] == total and r["int_head"] == head
        counters = json.loads(c.ctl("counters", "--json", *c.client_args()).stdout)
        planes = {p["data_plane"]: p for p in counters["data_planes"]}
        for node in ("two-level:spine", "two-level:rack0", "two-level:rack1"):
            assert planes[node]["total"]["rx"] > 0 and sum(planes[node]["drops"].values()) == 0
        assert planes["software"]["total"]["rx"] == 0  # nothing went to the flat fallback
    finally:
        c.stop()
