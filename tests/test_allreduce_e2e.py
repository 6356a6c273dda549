"""End to end: worker processes allreduce through the software aggregator over real UDP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from switchagg import protocol
from switchagg.aggregator import SoftwareAggregator
from switchagg_lab.testing.checks import check_results, inputs
from switchagg_lab.testing.local import run_job


def ok(procs: list[subprocess.CompletedProcess[str]]) -> None:
    assert all(p.returncode == 0 for p in procs), [p.stderr for p in procs]


@pytest.fixture
def aggregator():
    agg = SoftwareAggregator("127.0.0.1", 0)
    agg.start()
    yield agg
    agg.stop()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_int32_exact_and_float32_within_bound(aggregator: SoftwareAggregator, tmp_path: Path, n: int) -> None:
    k, slots = 256, 8
    tensors = [("int32", 10_000), ("float32", 9_999), ("int32", 1), ("float32", 300_001)]
    tensors += [("float32/16", 100_003), ("float32/8", 100_003)]  # narrow lanes (docs/PROTOCOL.md)
    ok(run_job(aggregator, 1, n, tensors, tmp_path, slots=slots, k=k))
    check_results(1, n, k, tensors, tmp_path)
    c = aggregator.counters()
    assert sum(c["drops"].values()) == 0
    assert c["jobs"][1]["multicast"] > 0


@pytest.mark.reliability(
    "duplicated packets",
    "5% dropped and 5% duplicated each way by the aggregator's fault injector, loopback, "
    "4 ranks x 2 allreduces",
    sums=8,
    recovery="every loss repaired by retransmission, every duplicate ignored",
    state="nothing: the same bits as a loss-free run",
)
def test_loss_and_duplication_give_identical_results(tmp_path: Path) -> None:
    n, k, slots = 4, 128, 8
    tensors = [("int32", 20_000), ("float32", 20_000)]
    outs = []
    for lossy in (False, True):
        p = 0.05 if lossy else 0.0
        agg = SoftwareAggregator("127.0.0.1", 0, drop_in=p, dup_in=p, drop_out=p, dup_out=p, seed=7)
        agg.start()
        try:
            d = tmp_path / str(lossy)
            d.mkdir()
            ok(run_job(agg, 1, n, tensors, d, slots=slots, k=k, rto=0.02))
            stats = check_results(1, n, k, tensors, d)
            counters = agg.counters()
        finally:
            agg.stop()
        if lossy:
            f = counters["faults"]
            assert f["dropped_in"] > 0 and f["dropped_out"] > 0 and f["duplicated_in"] > 0
            assert sum(s["retransmits"] for s in stats) > 0
            assert sum(s["fast_retransmits"] for s in stats) > 0  # later results revealed losses
            assert counters["jobs"][1]["resent"] > 0
        outs.append([np.load(d / f"job1_rank{r}.npz") for r in range(n)])
    for rank in range(n):
        for i in range(len(tensors)):
            np.testing.assert_array_equal(outs[0][rank][f"t{i}"], outs[1][rank][f"t{i}"])


@pytest.mark.reliability(
    "worker killed",
    "1 of 3 ranks SIGKILLed mid-allreduce (1M int32), loopback",
    sums=0,
    outcome="failed cleanly: the 2 others raise SwitchaggTimeout, nothing written",
    recovery="the session timeout (2 s)",
    state="the job's sessions broken (open new ones); the aggregator keeps the job until removed",
)
def test_killed_worker_makes_the_others_fail_cleanly(aggregator: SoftwareAggregator, tmp_path: Path) -> None:
    n = 3
    procs = run_job(
        aggregator,
        1,
        n,
        [("int32", 1_000_000)],
        tmp_path,
        k=64,
        slots=4,
        timeout=2.0,
        per_rank={1: {"die_after": 20}},
    )
    assert procs[1].returncode == -9  # SIGKILL, mid-allreduce
    for rank in (0, 2):
        assert procs[rank].returncode == 3, procs[rank].stderr
        assert (
            "SwitchaggTimeout" in procs[rank].stderr and "a peer has not made this call" in procs[rank].stderr
        )
    assert not (tmp_path / "job1_rank0.npz").exists()


def test_a_bad_argument_aborts_the_call_and_the_session(aggregator: SoftwareAggregator) -> None:
    """A world of one: sums go through the aggregator; a bad argument is raised with its reason
    and aborts the call on every rank (here only this one), after which the session is unusable."""
    from switchagg import Session, SwitchaggError

    for bad, message in [
        (np.ones(10, np.float64), "float32 and int32"),
        (np.ones((10, 10), np.float32)[:, 1], "C-contiguous"),
        ([1.0, 2.0], "numpy array or a CPU torch tensor"),
    ]:
        with Session(2, 0, 1, aggregator.address, 0, 4, 64, timeout=5, key=77) as s:
            aggregator.add_job(2, 1, 0, 4, 64, 1, [s.local_address], key=77)
            y = np.arange(-500, 500, dtype=np.int32)
            s.allreduce(y)
            np.testing.assert_array_equal(y, np.arange(-500, 500, dtype=np.int32))
            assert s.allreduce_async(y).result(timeout=30) is None
            assert s.stats()["allreduces"] == 2
            with pytest.raises(TypeError, match=f"{message}.*aborted on every rank"):
                s.allreduce(bad)
            with pytest.raises(
                SwitchaggError, match="earlier call on this session failed.*aborted its call 3"
            ):
                s.allreduce(y)
            assert s.stats()["call"] == 3
            aggregator.remove_job(2)


def test_torch_tensors_are_reduced_in_place(aggregator: SoftwareAggregator) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from switchagg import Session

    with Session(3, 0, 1, aggregator.address, 0, 4, 64, timeout=5, key=33) as s:
        aggregator.add_job(3, 1, 0, 4, 64, 1, [s.local_address], key=33)
        t = torch.arange(1000, dtype=torch.int32)
        ptr = t.data_ptr()
        s.allreduce(t)
        assert t.data_ptr() == ptr and torch.equal(t, torch.arange(1000, dtype=torch.int32))
        g = torch.ones(3, requires_grad=True)
        s.allreduce(g.grad if g.grad is not None else torch.zeros(3))
        with pytest.raises(TypeError, match="float32 and int32"):
            s.allreduce(torch.ones(4, dtype=torch.float64))


def test_a_small_receive_buffer_shrinks_the_window_instead_of_losing_results(
    aggregator: SoftwareAggregator,
) -> None:
    """16 slots of 64 KiB results do not fit a 200 kB receive buffer: the session warns, keeps as
    many in flight as fit, and a loss-free run needs no retransmission."""
    from switchagg import Session

    n, slots, k = 2, 16, protocol.DEFAULT_SW_K
    with pytest.warns(RuntimeWarning, match="too small for the results of 16 slots"):
        sessions = [
            Session(1, r, n, aggregator.address, 0, slots, k, rcvbuf=200_000, key=9) for r in range(n)
        ]
    try:
        assert all(1 <= s.window < slots for s in sessions)
        aggregator.add_job(1, n, 0, slots, k, 1, [s.local_address for s in sessions], key=9)
        xs = [inputs(1, r, 40 * k + 3, "int32", 5) for r in range(n)]
        want = np.sum([x.astype(np.int64) for x in xs], axis=0).astype(np.int32)
        futures = [s.allreduce_async(x) for s, x in zip(sessions, xs, strict=True)]
        for f in futures:
            f.result(timeout=60)
        for x in xs:
            np.testing.assert_array_equal(x, want)
        # No result lost to the buffer: nothing taken for lost by RACK or the timer. A tail loss
        # probe may fire once or twice on a loaded host (a stall of 2 round trips, >= 1 ms);
        # results lost to an overflowing buffer would cost one in every few of the 41 rounds.
        stats = [s.stats() for s in sessions]
        assert [(st["fast_retransmits"], st["timeouts"]) for st in stats] == [(0, 0)] * n, stats
        assert all(st["retransmits"] == st["tail_probes"] <= 2 for st in stats), stats
    finally:
        for s in sessions:
            s.close()


def test_demo_command_runs() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "switchagg.demo", "--workers", "2", "--size", "50000", "--iters", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "demo passed" in p.stdout
