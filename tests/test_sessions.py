"""A sum belongs to the run that asked for it (docs/PROTOCOL.md, Sessions; issue 41), on the software
aggregator: one ``switchagg-aggregator --job`` process with one standing job, and runs of a script
of two ranks, each rank a process of its own (switchagg_lab.testing.standing_job has the scenarios;
bmv2_tests/test_sessions_bmv2.py runs them through the P4 switch)."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from switchagg import Session, _core
from switchagg.aggregator import SoftwareAggregator, new_key
from switchagg_lab.testing import standing_job as sj
from switchagg_lab.testing.kit import free_ports
from switchagg_lab.testing.reliability import Reliability

N = 2
JOB = 1
K = 64
SLOTS = 16


@pytest.fixture
def start() -> Iterator[sj.Start]:
    """``switchagg-aggregator`` with job 1 (2 ranks on loopback ports) installed for as long as it
    runs; yields how to start a rank of a run on it."""
    ports = free_ports(N)
    key = new_key()
    addrs = ",".join(f"127.0.0.1:{p}" for p in ports)
    cmd = [sys.executable, "-m", "switchagg.aggregator_cli", "--port", "0", "--threads", "1"]
    cmd += ["--job", f"{JOB}:{N}:0:{SLOTS}:{K}:1:{key}@{addrs}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # it says where it listens as soon as it does, or exits
        assert first.startswith("switchagg-aggregator listening on 127.0.0.1:"), first + proc.stderr.read()
        agg = ("127.0.0.1", int(first.split("127.0.0.1:")[1].split(";")[0]))

        def start_rank(rank: int, base: int, calls: int, timeout: float) -> subprocess.Popen[str]:
            argv = sj.rank_argv(JOB, rank, N, agg, ("127.0.0.1", ports[rank]), key, base, calls, timeout, 0, SLOTS, K)
            return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        yield start_rank
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=sj.WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.mark.reliability(
    "standing job reused",
    "software aggregator: 4 runs of a 2-rank script (a process per rank) one after another on one "
    "switchagg-aggregator --job, each run's first call of the same identity as the run before's last",
    state="nothing: the aggregator serves the next run",
    recovery="none needed: each session's hello",
)
def test_every_run_on_a_standing_job_gets_its_own_sums(start: sj.Start, reliability: Reliability) -> None:
    hellos = sj.Hellos()
    reliability.record(runs=4, sums=sj.runs_one_after_another(start, N, hellos), recovery=hellos.summary())


@pytest.mark.reliability(
    "standing job reused",
    "software aggregator: a 2-rank run SIGKILLed mid-call, then new runs on the same standing job",
    state="the killed run's rounds, half done, stay in the slots; no later session sees them",
    recovery="none needed",
)
def test_a_run_killed_mid_call_leaves_nothing_for_the_next(start: sj.Start, reliability: Reliability) -> None:
    reliability.record(sums=sj.killed_mid_call_then_a_new_run(start, N))


@pytest.mark.reliability(
    "rank restarted alone",
    "software aggregator: rank 1 of a running 2-rank run SIGKILLed and started again while rank 0 goes on",
    outcome="failed cleanly",
    state="nothing: the next run of both ranks is exact",
)
def test_a_rank_restarted_alone_fails_every_rank(start: sj.Start, reliability: Reliability) -> None:
    sums, elapsed = sj.restarted_alone(start, N)
    reliability.record(sums=sums, recovery_s=round(elapsed, 1))


def _sessions(agg: SoftwareAggregator, key: int, addrs: list[tuple[str, int]]) -> list[Session]:
    """Each rank's session of one run, on sockets bound anew at the job's addresses (as a run's
    processes bind them)."""
    return [
        Session(JOB, r, N, agg.address, 0, SLOTS, K, timeout=10, key=key, _worker=_core.Worker(*a))
        for r, a in enumerate(addrs)
    ]


def _each(sessions: list[Session], what: Callable[[int, Session], None]) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        for f in [pool.submit(what, r, s) for r, s in enumerate(sessions)]:
            f.result(timeout=sj.WAIT_S)


def test_a_hello_that_meets_an_earlier_sessions_hello_goes_on_until_every_rank_vouches() -> None:
    """Run A only opens its sessions (two hello rounds, then no call), so its rounds stay stored on
    both sets of the first slot. Run B's first round is answered with A's stored first round (its
    ranks find their words missing, and do not vouch), and its second, whose incarnation is the
    digest of that same round, with A's second: 4 rounds then, all ranks alike; B's sums are its
    own. Run C, after B's calls overwrote both sets, needs 2."""
    with SoftwareAggregator() as agg:
        bound = [_core.Worker("127.0.0.1", 0) for _ in range(N)]
        addrs = [w.address for w in bound]
        key = agg.add_job(JOB, N, 0, SLOTS, K, 1, addrs)
        for w in bound:
            w.close()
        for run, (calls, want_rounds) in enumerate(((0, 2), (2, 4), (1, 2))):
            sessions = _sessions(agg, key, addrs)
            try:

                def work(r: int, s: Session, run: int = run, calls: int = calls) -> None:
                    s.open()
                    for c in range(1, calls + 1):
                        x = np.full(3 * K, 100 * run + 10 * c + r, np.int32)
                        s.allreduce(x)
                        assert (x == N * (100 * run + 10 * c) + N * (N - 1) // 2).all(), (run, c, x[:4])

                _each(sessions, work)
                assert [s.stats()["hello_rounds"] for s in sessions] == [want_rounds] * N, run
            finally:
                for s in sessions:
                    s.close()
