"""A sum belongs to the run that asked for it (docs/PROTOCOL.md, Sessions), tried as a user would: one
``switchagg-aggregator --job`` process with one standing job, and runs of a two-rank script
(``switchagg_lab.testing.run_rank``), each rank a process of its own that binds the port the job
names, makes int32 allreduces whose exact sums differ per run and call, and exits.

The bmv2 twin of these tests is bmv2_tests/test_sessions_bmv2.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import pytest

from switchagg.aggregator import new_key
from switchagg_lab.testing.kit import free_ports
from switchagg_lab.testing.reliability import Reliability

N = 2
JOB = 1
K = 64
SLOTS = 16
WAIT_S = 60  # bound on any wait here


@dataclass
class StandingJob:
    aggregator: tuple[str, int]
    ports: list[int]
    key: int


def _read_line(stream: IO[str], deadline: float) -> str:
    """One line, or "" at EOF; fails the test past the deadline (the reader never blocks for ever:
    every process here exits by itself within its session timeout)."""
    if time.monotonic() > deadline:
        pytest.fail("no output in time")
    return stream.readline()


@pytest.fixture
def standing_job() -> Iterator[StandingJob]:
    """``switchagg-aggregator`` with job 1 (2 ranks, K = 64, 16 slots) installed for as long as it runs."""
    ports = free_ports(N)
    key = new_key()
    addrs = ",".join(f"127.0.0.1:{p}" for p in ports)
    cmd = [sys.executable, "-m", "switchagg.aggregator_cli", "--port", "0", "--threads", "1"]
    cmd += ["--job", f"{JOB}:{N}:0:{SLOTS}:{K}:1:{key}@{addrs}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = _read_line(proc.stdout, time.monotonic() + WAIT_S)
        assert first.startswith("switchagg-aggregator listening on 127.0.0.1:"), first
        port = int(first.split("127.0.0.1:")[1].split(";")[0])
        yield StandingJob(("127.0.0.1", port), ports, key)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def start_rank(job: StandingJob, rank: int, base: int, calls: int = 1, timeout: float = 10.0) -> subprocess.Popen[str]:
    agg = "{}:{}".format(*job.aggregator)
    cmd = [sys.executable, "-m", "switchagg_lab.testing.run_rank", str(JOB), str(rank), str(N), agg]
    cmd += [f"127.0.0.1:{job.ports[rank]}", hex(job.key), str(base), "--calls", str(calls), "--k", str(K)]
    cmd += ["--slots", str(SLOTS), "--timeout", str(timeout)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str]) -> tuple[int, list[dict[str, Any]]]:
    out, err = proc.communicate(timeout=WAIT_S)
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert proc.returncode in (0, 3), err
    return proc.returncode, lines


def exact_sum(base: int, call: int) -> int:
    return N * base * call + N * (N - 1) // 2


@pytest.mark.reliability(
    "standing job reused",
    "runs of a 2-rank script, each rank a process, one after another on one switchagg-aggregator --job",
    state="nothing: the aggregator serves the next run",
    recovery="none needed",
)
def test_every_run_on_a_standing_job_gets_its_own_sums(standing_job: StandingJob, reliability: Reliability) -> None:
    """The issue's script, run 4 times: one int32 allreduce per run, rank r contributing base + r.
    Every run's first call has the identity of the run before's last round (call 1, set 0, offset 0,
    same length); each gets its own sum, never the run before's."""
    sums = 0
    for run, base in enumerate((100, 1000, 100, 7)):
        procs = [start_rank(standing_job, r, base) for r in range(N)]
        for r, proc in enumerate(procs):
            rc, lines = finish(proc)
            assert rc == 0 and lines == [{"call": 1, "sum": exact_sum(base, 1), "exact": True}], (run, r, lines)
            sums += 1
    reliability.record(runs=4, sums=sums, wrong=0)


@pytest.mark.reliability(
    "standing job reused",
    "a run SIGKILLed mid-call (both ranks), then a new run on the same standing job",
    state="the killed run's rounds, half done, stay in the slots; the new run's sessions never see them",
    recovery="none needed",
)
def test_a_run_killed_mid_call_leaves_nothing_for_the_next(standing_job: StandingJob, reliability: Reliability) -> None:
    procs = [start_rank(standing_job, r, 50, calls=10_000, timeout=3) for r in range(N)]
    deadline = time.monotonic() + WAIT_S
    for proc in procs:  # let both get well into their calls, then kill them mid-stream
        assert proc.stdout is not None
        while True:
            line = _read_line(proc.stdout, deadline)
            assert line, "the first run ended early"
            if json.loads(line).get("call", 0) >= 30:
                break
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=WAIT_S)
    sums = 0
    for base in (50, 51):
        procs = [start_rank(standing_job, r, base, calls=5) for r in range(N)]
        for proc in procs:
            rc, lines = finish(proc)
            assert rc == 0 and lines == [{"call": c, "sum": exact_sum(base, c), "exact": True} for c in range(1, 6)]
            sums += 5
    reliability.record(sums=sums, wrong=0)


@pytest.mark.reliability(
    "rank restarted alone",
    "rank 1 of a running 2-rank run SIGKILLed and started again while rank 0 goes on",
    outcome="failed cleanly",
    state="nothing: the next run of both ranks gets exact sums",
)
def test_a_rank_restarted_alone_fails_every_rank(standing_job: StandingJob, reliability: Reliability) -> None:
    """Never a sum after the restart: rank 0 fails its call (the dead process's contribution never
    comes), the new rank 1 fails to open its session (its peer never says hello); every sum printed
    before was exact. Then a run of both ranks works again."""
    timeout = 3.0
    first = [start_rank(standing_job, r, 10, calls=100_000, timeout=timeout) for r in range(N)]
    deadline = time.monotonic() + WAIT_S
    seen: list[dict[str, Any]] = []
    assert first[1].stdout is not None
    while len(seen) < 20:
        line = _read_line(first[1].stdout, deadline)
        assert line, "rank 1 ended early"
        seen.append(json.loads(line))
    first[1].send_signal(signal.SIGKILL)
    first[1].communicate(timeout=WAIT_S)
    killed = time.monotonic()
    restarted = start_rank(standing_job, 1, 20, calls=3, timeout=timeout)
    rc0, lines0 = finish(first[0])
    rc1, lines1 = finish(restarted)
    elapsed = time.monotonic() - killed
    assert all(line.get("exact", True) for line in seen + lines0 + lines1), "a wrong sum"
    assert rc0 == 3 and lines0[-1]["error"] == "SwitchaggTimeout", lines0[-1]
    assert rc1 == 3 and lines1 == [lines1[-1]] and lines1[-1]["error"] == "SwitchaggTimeout", lines1
    assert "opening the session failed" in lines1[-1]["message"], lines1[-1]
    assert "restarted alone" in lines1[-1]["message"]
    sums = len(seen) + len(lines0) - 1
    again = [start_rank(standing_job, r, 30, calls=2) for r in range(N)]
    for proc in again:
        rc, lines = finish(proc)
        assert rc == 0 and lines == [{"call": c, "sum": exact_sum(30, c), "exact": True} for c in (1, 2)]
        sums += 2
    reliability.record(sums=sums, wrong=0, recovery_s=round(elapsed, 1))
