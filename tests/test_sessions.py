"""A sum belongs to the run that asked for it (docs/PROTOCOL.md, Sessions; issue 41), on the software
aggregator: one ``switchagg-aggregator --job`` process with one standing job, and runs of a script
of two ranks, each rank a process of its own (switchagg_lab.testing.standing_job has the scenarios;
bmv2_tests/test_sessions_bmv2.py runs them through the P4 switch)."""

from __future__ import annotations

import concurrent.futures
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from switchagg import Session, _core, protocol
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
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()  # it says where it listens as soon as it does, or exits
        assert first.startswith("switchagg-aggregator listening on 127.0.0.1:"), first + proc.stderr.read()
        agg = ("127.0.0.1", int(first.split("127.0.0.1:")[1].split(";")[0]))

        def start_rank(rank: int, base: int, calls: int, timeout: float) -> subprocess.Popen[str]:
            argv = sj.rank_argv(
                JOB, rank, N, agg, ("127.0.0.1", ports[rank]), key, base, calls, timeout, 0, SLOTS, K
            )
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


def _hello_packet(rank: int, words: list[int], inc: int, slot: int) -> bytes:
    """Rank ``rank``'s packet of a hello round (docs/PROTOCOL.md, Sessions) on ``slot``, set 0."""
    payload = [0] * K
    payload[rank] = words[rank] - 2**32 if words[rank] >= 2**31 else words[rank]
    flags = protocol.FLAG_HELLO
    return protocol.Header(
        job=JOB, rank=rank, slot=slot, flags=flags, call=0, total=N, key=inc, values=payload
    ).pack()


def _leave_hello_rounds(
    agg_address: tuple[str, int], addrs: list[tuple[str, int]], rounds: int, last_from: int
) -> None:
    """Plays an earlier session killed in its hello: its ranks' first ``rounds`` rounds, each on its
    slot, in the incarnation the protocol gives it; the last one sent by ranks ``0..last_from-1``
    only (N: complete)."""
    inc = 0
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in addrs]
    try:
        for sock, a in zip(socks, addrs, strict=True):
            sock.bind(a)
            sock.settimeout(5)
        for k in range(rounds):
            words = [0x10000 * (k + 1) + 2 * r + 2 for r in range(N)]  # no vouch: they are stale-able
            senders = range(N) if k < rounds - 1 else range(last_from)
            for r in senders:
                socks[r].sendto(_hello_packet(r, words, inc, k), agg_address)
            if len(senders) == N:
                for sock in socks:  # the round completed: its result reaches every rank
                    sock.recvfrom(65536)
            inc = _core.hello_digest(words, "h")
    finally:
        for sock in socks:
            sock.close()


def _sessions(agg: SoftwareAggregator, key: int, addrs: list[tuple[str, int]]) -> list[Session]:
    """Each rank's session of one run, on sockets bound anew at the job's addresses (as a run's
    processes bind them)."""
    return [
        Session(JOB, r, N, agg.address, 0, SLOTS, K, timeout=10, key=key, _worker=_core.Worker(*a))
        for r, a in enumerate(addrs)
    ]


def _open_and_sum(sessions: list[Session], run: int, calls: int) -> list[int]:
    """Every rank opens its session and makes ``calls`` int32 calls of 3 packets, checked exact;
    returns each rank's hello rounds."""

    def work(r: int, s: Session) -> None:
        s.open()
        for c in range(1, calls + 1):
            x = np.full(3 * K, 100 * run + 10 * c + r, np.int32)
            s.allreduce(x)
            assert (x == N * (100 * run + 10 * c) + N * (N - 1) // 2).all(), (run, c, x[:4])

    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        for f in [pool.submit(work, r, s) for r, s in enumerate(sessions)]:
            f.result(timeout=sj.WAIT_S)
    return [s.stats()["hello_rounds"] for s in sessions]


@pytest.mark.parametrize(
    ("left", "last_from", "rounds"),
    [
        (0, 0, 3),  # nothing left: 2 rounds and the one that overwrites the first
        (1, 1, 4),  # a first round of rank 0 alone: joined, so mixed; rank 0 does not vouch
        (1, N, 4),  # a whole first round: stored, every rank finds its own word missing
        (2, N, 5),  # two whole rounds: the second's incarnation is the digest of the first, stored too
        (2, 1, 5),  # a whole first round and half a second one
    ],
)
def test_a_hello_that_meets_an_earlier_sessions_rounds_opens_a_session_of_its_own(
    left: int, last_from: int, rounds: int
) -> None:
    """An earlier session killed in its hello left ``left`` rounds on the job's slots (the last one from
    ranks 0..last_from-1): the next run's ranks take as many rounds as those and 2 more (and the one
    that overwrites the first), all alike, and their sums are their own. The run after needs 3 again,
    as does one after a run that opened its sessions and made no call."""
    with SoftwareAggregator() as agg:
        bound = [_core.Worker("127.0.0.1", 0) for _ in range(N)]
        addrs = [w.address for w in bound]
        key = agg.add_job(JOB, N, 0, SLOTS, K, 1, addrs)
        for w in bound:
            w.close()
        _leave_hello_rounds(agg.address, addrs, left, last_from)
        for run, (calls, want) in enumerate(((1, rounds), (0, 3), (2, 3))):
            sessions = _sessions(agg, key, addrs)
            try:
                assert _open_and_sum(sessions, run, calls) == [want] * N, run
            finally:
                for s in sessions:
                    s.close()
