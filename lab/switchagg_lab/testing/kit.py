"""The shared test kit, one of each for tests, bench and lab: free ports, a bounded wait, and the
collection of worker processes (a hung one is killed, never waited for forever)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


def free_port(kind: int = socket.SOCK_STREAM, host: str = "127.0.0.1") -> int:
    """A port the kernel just had free on ``host`` (TCP unless ``kind`` says SOCK_DGRAM)."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(count: int, kind: int = socket.SOCK_DGRAM, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports: all sockets are held open together while they are chosen."""
    socks = [socket.socket(socket.AF_INET, kind) for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(
    predicate: Callable[[], object],
    timeout: float = 60.0,
    what: str = "condition",
    interval: float = 0.1,
    alive: Sequence[subprocess.Popen[str]] = (),
) -> None:
    """Polls ``predicate`` until it is true; the bound only guards against a hang, never times a
    result. With ``alive``, a process among them that ends first fails the wait at once."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if any(p.poll() is not None for p in alive):
            raise AssertionError(f"a process ended while waiting for {what}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def wait_rx(aggregator: Any, rx: int, timeout: float = 30.0) -> dict[str, Any]:
    """Polls a software aggregator's counters until it has read ``rx`` datagrams (what a test sent
    it over loopback: all of them arrive, later or sooner); returns those counters."""
    counters: dict[str, Any] = aggregator.counters()
    deadline = time.monotonic() + timeout
    while counters["rx"] < rx:
        if time.monotonic() >= deadline:
            raise AssertionError(f"the aggregator read {counters['rx']} of {rx} datagrams in {timeout:g} s")
        time.sleep(0.0005)
        counters = aggregator.counters()
    return counters


def wait_all(
    procs: Sequence[subprocess.Popen[str]], timeout: float = 300.0
) -> list[subprocess.CompletedProcess[str]]:
    """Every process's outcome within one deadline; one still running at the deadline is killed
    and its stderr says so (a hung rank must not hang the test)."""
    deadline = time.monotonic() + timeout
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate(timeout=30)
            err = f"killed: still running {timeout:g} s after the wait began\n{err}"
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def json_reports(procs: Sequence[subprocess.Popen[str]], timeout: float = 300.0) -> list[dict[str, Any]]:
    """The last stdout line of each process, as JSON, once all exited 0 (else the failures' stderr)."""
    done = wait_all(procs, timeout)
    failed = [f"exit {d.returncode}: {(d.stderr or '').strip()[-2000:]}" for d in done if d.returncode != 0]
    assert not failed, "\n".join(failed)
    return [json.loads(d.stdout.strip().splitlines()[-1]) for d in done]


def run_testbed_cli(
    *args: str, env: dict[str, str], timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``switchagg-testbed ARGS`` (as this interpreter's module), its output captured."""
    argv = [sys.executable, "-m", "switchagg_lab.testbed.testbed_cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def allreduce_all(sessions: Sequence[Any], tensors: Sequence[Any], timeout: float = 120.0) -> None:
    """Every rank's allreduce at once, one thread each (the worker releases the GIL): the ranks of
    one call must all be in it. A rank's error is raised here, in the caller's thread."""
    errors: list[BaseException] = []

    def one(s: Any, t: Any) -> None:
        try:
            s.allreduce(t)
        except BaseException as e:  # reported below
            errors.append(e)

    runs = [threading.Thread(target=one, args=st) for st in zip(sessions, tensors, strict=True)]
    for t in runs:
        t.start()
    for t in runs:
        t.join(timeout)
    assert not errors, errors
    assert not any(t.is_alive() for t in runs), f"an allreduce still runs after {timeout:g} s"


def local_sessions(
    agg: Any,
    n: int,
    *,
    k: int = 256,
    slots: int = 8,
    job: int = 1,
    slot_base: int = 0,
    timeout: float = 5.0,
    key: int = 0x5EC12E7,
) -> list[Any]:
    """n Sessions of one job on a started SoftwareAggregator ``agg`` in this process, the job installed
    with their addresses and ``key``."""
    from switchagg import Session

    sessions = [
        Session(job, r, n, agg.address, slot_base, slots, k, timeout=timeout, key=key) for r in range(n)
    ]
    agg._agg.add_job(job, n, slot_base, slots, k, 1, [s.local_address for s in sessions], key=key)
    return sessions


def on_every_rank(
    sessions: Sequence[Any], work: Callable[[int, Any], Any], timeout: float = 60.0
) -> list[Any]:
    """Runs work(rank, session) on one thread per rank (the C path releases the GIL); returns each
    rank's result or the exception it raised. Bounded: a thread that hangs fails the test."""
    out: list[Any] = [None] * len(sessions)

    def run(r: int) -> None:
        try:
            out[r] = work(r, sessions[r])
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank hung"
    return out
