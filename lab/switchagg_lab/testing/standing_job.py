"""Runs on a standing job, tried as a user would (docs/PROTOCOL.md, Sessions; issue 41): a job
installed once, and runs of a script of N ranks (``switchagg_lab.testing.run_rank``), each rank a
process of its own that binds the port the job names, makes int32 allreduces and exits. The
scenarios take a ``start(rank, base, calls, timeout)`` that starts rank ``rank``'s process where
the data plane reaches it (a subprocess on loopback for the software aggregator, one in the rank's
namespace for bmv2), so tests/test_sessions.py and bmv2_tests/test_sessions_bmv2.py share them."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

WAIT_S = 60  # bound on any wait here: every rank exits by itself within its session timeout
SHORT_TIMEOUT = 3.0  # the session timeout of the runs that are meant to fail

Start = Callable[[int, int, int, float], "subprocess.Popen[str]"]


def rank_argv(
    job: int, rank: int, n: int, aggregator: tuple[str, int], bind: tuple[str, int], key: int, base: int,
    calls: int, timeout: float, slot_base: int, slots: int, k: int,
) -> list[str]:  # fmt: skip
    """The command line of rank ``rank`` of a run whose call c sums ``base * c + r`` over the ranks."""
    argv = [sys.executable, "-m", "switchagg_lab.testing.run_rank", str(job), str(rank), str(n)]
    argv += ["{}:{}".format(*aggregator), "{}:{}".format(*bind), hex(key), str(base), "--calls", str(calls)]
    argv += ["--slot-base", str(slot_base), "--slots", str(slots), "--k", str(k), "--timeout", str(timeout)]
    return argv


def exact_sum(n: int, base: int, call: int) -> int:
    return n * base * call + n * (n - 1) // 2


class Hellos:
    """What the runs' hellos cost: each rank's rounds and milliseconds."""

    def __init__(self) -> None:
        self.rounds: list[int] = []
        self.ms: list[float] = []

    def add(self, line: dict[str, Any]) -> None:
        self.rounds.append(int(line["hello_rounds"]))
        self.ms.append(float(line["hello_ms"]))

    def summary(self) -> str:
        if not self.ms:
            return "no hello"
        rounds = "/".join(str(r) for r in sorted(set(self.rounds)))
        return f"each session's hello: {rounds} rounds, median {statistics.median(self.ms):.1f} ms"


def finish(proc: subprocess.Popen[str], hellos: Hellos | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Its exit status and its JSON lines (one per call, or the error), the hello's line taken out
    (into ``hellos``)."""
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode in (0, 3), f"exit {proc.returncode}: {err[-2000:]}"
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    if lines and "hello_rounds" in lines[0]:
        if hellos is not None:
            hellos.add(lines[0])
        lines = lines[1:]
    return proc.returncode, lines


def _lines_until(proc: subprocess.Popen[str], calls: int) -> list[dict[str, Any]]:
    """proc's call lines until it reported call ``calls`` (bounded: it fails past WAIT_S)."""
    assert proc.stdout is not None
    deadline, seen = time.monotonic() + WAIT_S, list[dict[str, Any]]()
    while not seen or seen[-1].get("call", 0) < calls:
        assert time.monotonic() < deadline, "no progress in time"
        line = proc.stdout.readline()
        assert line, f"the rank ended early: {seen[-1:]}"
        seen.append(json.loads(line))
    return [line for line in seen if "hello_rounds" not in line]


def run_exact(start: Start, n: int, base: int, calls: int, hellos: Hellos | None = None) -> int:
    """One run of every rank; asserts every rank printed every call's exact sum. Returns the sums."""
    procs = [start(r, base, calls, 10.0) for r in range(n)]
    for r, proc in enumerate(procs):
        rc, lines = finish(proc, hellos)
        want = [{"call": c, "sum": exact_sum(n, base, c), "exact": True} for c in range(1, calls + 1)]
        assert rc == 0 and lines == want, f"run of base {base}, rank {r}: {lines}"
    return n * calls


def runs_one_after_another(start: Start, n: int, hellos: Hellos | None = None) -> int:
    """The issue's script, 4 runs of one int32 allreduce: each run's first call has the identity of the
    last round of the run before (call 1, set 0, offset 0, the same length); each gets its own sum."""
    return sum(run_exact(start, n, base, 1, hellos) for base in (100, 1000, 100, 7))


def killed_mid_call_then_a_new_run(start: Start, n: int) -> int:
    """Every rank of a run SIGKILLed in the middle of its calls (rounds half done stay in the slots),
    then new runs: exact. Returns the sums checked."""
    procs = [start(r, 50, 10_000, SHORT_TIMEOUT) for r in range(n)]
    sums = sum(len(_lines_until(p, 30)) for p in procs)
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=WAIT_S)
    return sums + run_exact(start, n, 50, 5) + run_exact(start, n, 51, 5)


def restarted_alone(start: Start, n: int) -> tuple[int, float]:
    """Rank n-1 of a running run SIGKILLed and started again while the others go on: never a sum
    after that. The others fail their call (the dead process's contribution never comes), the new
    rank fails to open its session (its peers never say hello); every sum printed before was exact.
    Then a run of every rank is exact again. Returns the sums checked and the seconds from the kill
    to the last rank's error."""
    first = [start(r, 10, 100_000, SHORT_TIMEOUT) for r in range(n)]
    seen = _lines_until(first[-1], 20)
    first[-1].send_signal(signal.SIGKILL)
    first[-1].communicate(timeout=WAIT_S)
    killed = time.monotonic()
    restarted = start(n - 1, 20, 3, SHORT_TIMEOUT)
    ended = [finish(p) for p in (*first[:-1], restarted)]
    elapsed = time.monotonic() - killed
    for rc, lines in ended:
        assert all(line.get("exact", True) for line in lines), f"a wrong sum: {lines}"
        assert rc == 3 and lines[-1]["error"] == "SwitchaggTimeout", lines[-1:]
    assert all(line.get("exact") for line in seen), f"a wrong sum: {seen}"
    rc, lines = ended[-1]
    assert len(lines) == 1, f"the restarted rank made a call: {lines}"
    assert "opening the session failed" in lines[0]["message"] and "restarted alone" in lines[0]["message"]
    sums = len(seen) + sum(len(lines) - 1 for _, lines in ended[:-1])
    return sums + run_exact(start, n, 30, 2), elapsed
