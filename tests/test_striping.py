"""A job striped across several software aggregators (docs/PROTOCOL.md, Striping): each rank's
Session cuts every tensor into contiguous shards and sums each on its own aggregator, all at once.
Real aggregators (embedded C threads, and one in a process of its own that is killed), real UDP
sockets; the ranks are threads of this process (each a Session with its own sockets)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from switchagg import _core, protocol
from switchagg.aggregator import SoftwareAggregator
from switchagg.session import Session
from switchagg.striping import Shard, shard_bounds, shard_key
from switchagg_lab.testing.kit import free_port
from switchagg_lab.testing.reliability import Reliability

K = 64
SLOTS = 8
JOB = 3


def test_shard_bounds_cover_the_tensor_in_whole_chunks() -> None:
    for length in (0, 1, K - 1, K, K + 1, 5 * K + 17, 64 * K):
        for m in (1, 2, 3, 4, 8):
            bounds = shard_bounds(length, K, m)
            assert bounds[0][0] == 0 and bounds[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
            assert all(lo % K == 0 or lo == length for lo, _ in bounds)  # on a chunk boundary
            chunks = [-(-(hi - lo) // K) for lo, hi in bounds]
            assert max(chunks) - min(chunks) <= 1
    assert shard_key(0, 3) == 0 and shard_key(77, 0) == 77
    assert len({shard_key(77, s) for s in range(8)}) == 8 and all(shard_key(77, s) for s in range(8))


def _striped_job(
    n: int, m: int, key: int = 0x5EC, **faults: Any
) -> tuple[list[SoftwareAggregator], list[list[_core.Worker]]]:
    """``m`` aggregators, each with the job installed for its shard: its own key, each rank
    pinned to that rank's socket for the shard."""
    aggs = [SoftwareAggregator("127.0.0.1", 0, **faults, seed=s + 1).start() for s in range(m)]
    workers = [[_core.Worker("127.0.0.1", 0) for _ in range(m)] for _ in range(n)]
    for s, agg in enumerate(aggs):
        agg.add_job(JOB, n, 0, SLOTS, K, 1, [workers[r][s].address for r in range(n)], key=shard_key(key, s))
    return aggs, workers


def _session(r: int, n: int, aggs: list[SoftwareAggregator], workers: list[list[_core.Worker]],
             key: int = 0x5EC, timeout: float = 10.0) -> Session:  # fmt: skip
    shards = [Shard(a.address, 0, SLOTS, shard_key(key, s)) for s, a in enumerate(aggs)]
    return Session(JOB, r, n, k=K, timeout=timeout, shards=shards, _workers=workers[r])


def _ranks(n: int, body: Callable[[int], object]) -> list[object]:
    """``body(rank)`` on n threads at once; each result or the exception it raised."""
    out: list[object] = [None] * n

    def run(r: int) -> None:
        try:
            out[r] = body(r)
        except Exception as e:
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a rank hung"
    return out


@pytest.mark.parametrize("m", [2, 3])
def test_striped_sums_exact_and_within_the_bound(m: int) -> None:
    n = 3
    lengths = (5 * K + 17, 1, 2 * K, 40 * K + 3)  # unequal shards, a shard left empty, many chunks
    aggs, workers = _striped_job(n, m)
    rng = np.random.default_rng(7)
    ints = [
        [rng.integers(-(2**28), 2**28, size=length, dtype=np.int32) for length in lengths] for _ in range(n)
    ]
    floats = [[rng.standard_normal(length).astype(np.float32) * 100 for length in lengths] for _ in range(n)]

    def body(r: int) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, int]]:
        with _session(r, n, aggs, workers) as s:
            xs = [x.copy() for x in ints[r]]
            fs = [f.copy() for f in floats[r]]
            for x, f in zip(xs, fs, strict=True):
                s.allreduce(x)
                s.allreduce(f)
            return xs, fs, s.stats()

    try:
        results = _ranks(n, body)
    finally:
        counted = [a.counters()["jobs"][JOB]["aggregated"] for a in aggs]
        for a in aggs:
            a.stop()
    assert all(c > 0 for c in counted), f"every shard's aggregator summed something: {counted}"
    for r, res in enumerate(results):
        assert isinstance(res, tuple), f"rank {r}: {res!r}"
        xs, fs, stats = res
        assert stats["allreduces"] == 2 * len(lengths) and stats["call"] == 2 * len(lengths)
        for i in range(len(lengths)):
            want = np.sum([ints[q][i] for q in range(n)], axis=0, dtype=np.int64).astype(np.int32)
            np.testing.assert_array_equal(xs[i], want)
            exact = np.sum([floats[q][i].astype(np.float64) for q in range(n)], axis=0)
            for lo in range(0, lengths[i], K):  # the bound per K-block, from its max exponent
                block = slice(lo, lo + K)
                top = max(float(np.abs(floats[q][i][block]).max()) for q in range(n))
                e = int(np.frexp(np.float32(top))[1])
                assert np.abs(fs[i][block] - exact[block]).max() <= protocol.error_bound(n, e)


def test_a_shard_whose_aggregator_dies_fails_every_rank_naming_the_shard() -> None:
    """Shard 1's aggregator is a process of its own, SIGKILLed between two calls: every rank's
    next call fails with the session timeout, and the error names shard 1 and its aggregator."""
    n = 3
    aggs, workers = _striped_job(n, 1)  # shard 0 embedded here
    port = free_port()
    shard1 = [_core.Worker("127.0.0.1", 0) for _ in range(n)]
    pinned = [w.address for w in shard1]
    code = (
        "import sys, time\n"
        "from switchagg.aggregator import SoftwareAggregator\n"
        f"a = SoftwareAggregator('127.0.0.1', {port}).start()\n"
        f"a.add_job({JOB}, {n}, 0, {SLOTS}, {K}, 1, {pinned!r}, key={shard_key(0x5EC, 1)})\n"
        "print('up', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        shards = [
            Shard(aggs[0].address, 0, SLOTS, 0x5EC),
            Shard(("127.0.0.1", port), 0, SLOTS, shard_key(0x5EC, 1)),
        ]
        first_done = threading.Barrier(n + 1)
        killed = threading.Event()

        def body(r: int) -> object:
            with Session(
                JOB, r, n, k=K, timeout=1.0, shards=shards, _workers=[workers[r][0], shard1[r]]
            ) as s:
                x = np.full(4 * K, r + 1, dtype=np.int32)
                s.allreduce(x)
                assert (x == n * (n + 1) // 2).all()
                first_done.wait(60)
                killed.wait(60)
                with pytest.raises(_core.SwitchaggTimeout) as err:
                    s.allreduce(x)
                with pytest.raises(_core.SwitchaggError) as again:  # the session stays failed
                    s.allreduce(x)
                return str(err.value), str(again.value)

        results: list[object] = []
        runner = threading.Thread(target=lambda: results.extend(_ranks(n, body)))
        runner.start()
        first_done.wait(60)
        proc.kill()
        proc.wait(30)
        killed.set()
        runner.join(120)
    finally:
        proc.kill()
        for a in aggs:
            a.stop()
    assert len(results) == n
    for r, res in enumerate(results):
        assert isinstance(res, tuple), f"rank {r}: {res!r}"
        first, again = res
        assert first.startswith(f"shard 1 of 2 (127.0.0.1:{port}), in a call of {4 * K} int32"), first
        assert "no result from the aggregator" in first, first
        assert "shard" in again


def test_a_striped_call_that_differs_fails_on_every_rank() -> None:
    """Rank 1 sends a longer tensor: shard 0's round is poisoned (a mismatch), every rank fails
    at once with what differed and the shard it was seen on, never a partial sum."""
    n, m = 2, 2
    aggs, workers = _striped_job(n, m)

    def body(r: int) -> object:
        with _session(r, n, aggs, workers, timeout=5.0) as s:
            x = np.ones(4 * K if r == 0 else 6 * K, dtype=np.int32)
            with pytest.raises(_core.SwitchaggMismatch) as err:
                s.allreduce(x)
            return str(err.value)

    try:
        results = _ranks(n, body)
    finally:
        for a in aggs:
            a.stop()
    for r, res in enumerate(results):
        # Each rank names its own whole call (the user's length), and the aggregator's verdict, not the
        # cancel it sent its other shard.
        assert isinstance(res, str) and res.startswith("shard "), res
        assert f"in a call of {(4 if r == 0 else 6) * K} int32 elements" in res, res
        assert "failed on every rank" in res, res


def test_a_rank_that_cannot_make_a_striped_call_aborts_it_everywhere() -> None:
    n, m = 2, 3
    aggs, workers = _striped_job(n, m)

    def body(r: int) -> object:
        with _session(r, n, aggs, workers, timeout=5.0) as s:
            x = np.ones(5 * K, dtype=np.int32 if r == 0 else np.int64)
            with pytest.raises((_core.SwitchaggError, TypeError)) as err:
                s.allreduce(x)
            return str(err.value)

    try:
        results = _ranks(n, body)
    finally:
        for a in aggs:
            a.stop()
    assert "aborted" in str(results[0]), results[0]
    assert "int64" in str(results[1]), results[1]


@pytest.mark.reliability(
    "loss",
    "striped job, 3 ranks x 3 shard aggregators (loopback): each aggregator drops 5% and duplicates 3% "
    "of what it receives and sends, 6 allreduces",
    sums=18,
    recovery="every shard repairs its own losses",
    state="nothing: the sessions go on",
)
def test_a_striped_job_survives_loss_and_duplicates_on_every_node() -> None:
    """The reliability suite's loss row on a striped job: each of 3 nodes drops 5% and duplicates
    3% of what it receives and sends; every shard repairs its own losses, every sum is exact."""
    n, m = 3, 3
    aggs, workers = _striped_job(n, m, drop_in=0.05, drop_out=0.05, dup_in=0.03, dup_out=0.03)

    def body(r: int) -> list[np.ndarray]:
        with _session(r, n, aggs, workers, timeout=20.0) as s:
            out = []
            for i in range(6):
                x = (np.arange(20 * K + i, dtype=np.int32) + i) * (r + 1)
                s.allreduce(x)
                out.append(x)
            return out

    try:
        results = _ranks(n, body)
        faults = [a.counters()["faults"] for a in aggs]
    finally:
        for a in aggs:
            a.stop()
    assert all(sum(f.values()) > 0 for f in faults), faults  # every node did drop and duplicate
    for r, res in enumerate(results):
        assert isinstance(res, list), f"rank {r}: {res!r}"
        for i, x in enumerate(res):
            want = (np.arange(20 * K + i, dtype=np.int64) + i) * (n * (n + 1) // 2)
            np.testing.assert_array_equal(x, want.astype(np.int32))


RESTART_STEPS = 150


@pytest.mark.reliability(
    "aggregator restarted",
    "striped job, 3 ranks x 3 shard aggregators (loopback): shard 1's aggregator stopped mid-job and "
    f"restarted on its port with the shard's job (new generation), {RESTART_STEPS} allreduces",
    state="a failed job's sessions are broken (open new ones); the restarted aggregator holds its shard",
)
def test_a_shard_aggregator_restarted_mid_job_gives_exact_sums_or_fails_cleanly(
    reliability: Reliability,
) -> None:
    """docs/PROTOCOL.md, Striping: each shard is a call stream of its own, so a restarted shard
    aggregator is the one-level case: its rounds no rank had finished are rebuilt from the resends,
    else every rank fails with its session timeout, naming the shard. Never a wrong sum."""
    n, m = 3, 3
    aggs, workers = _striped_job(n, m)
    done: list[list[tuple[float, int, np.ndarray]]] = [[] for _ in range(n)]

    def value(r: int, step: int) -> np.ndarray:
        return (np.arange(10 * K + step, dtype=np.int32) * (step + 1) + 1000 * r).astype(np.int32)

    def body(r: int) -> object:
        with _session(r, n, aggs, workers, timeout=3.0) as s:
            for step in range(RESTART_STEPS):
                x = value(r, step)
                s.allreduce(x)
                done[r].append((time.monotonic(), step, x))
        return None

    results: list[object] = []
    runner = threading.Thread(target=lambda: results.extend(_ranks(n, body)))
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while min(len(d) for d in done) < 20 and time.monotonic() < deadline and runner.is_alive():
            time.sleep(0.002)
        address = aggs[1].address
        aggs[1].stop()  # mid-job: the ranks are in their next allreduces
        killed = time.monotonic()
        time.sleep(0.3)  # down a while: resends meet a closed port
        aggs[1] = SoftwareAggregator(*address).start()
        aggs[1].add_job(
            JOB, n, 0, SLOTS, K, 2, [workers[r][1].address for r in range(n)], key=shard_key(0x5EC, 1)
        )
        runner.join(180)
        assert not runner.is_alive(), "a rank hung"
    finally:
        for a in aggs:
            a.stop()
    checked = wrong = 0
    for r in range(n):
        for _, step, x in done[r]:
            want = (
                n * (np.arange(10 * K + step, dtype=np.int64) * (step + 1)) + 1000 * sum(range(n))
            ).astype(np.int32)
            checked += 1
            wrong += not np.array_equal(x, want)
    failed = [res for res in results if res is not None]
    for res in failed:  # every failure is the timeout of the restarted shard, never another error
        assert isinstance(res, _core.SwitchaggTimeout) and "shard 1 of 3" in str(res), res
    exact = not failed
    after = [next((t for t, _, _ in d if t > killed), None) for d in done]
    recovered = max(a for a in after if a is not None) - killed if exact and None not in after else None
    reliability.record(
        sums=checked,
        wrong=wrong,
        outcome="exact" if exact else "failed cleanly: every rank's session timeout names shard 1",
        recovery_s=None if recovered is None else round(recovered, 2),
        recovery=None if exact else "the session timeout (3 s)",
    )
    assert wrong == 0
