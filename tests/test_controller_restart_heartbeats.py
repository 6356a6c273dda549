"""Heartbeats across a controller restart: a real switchagg-ctl serve SIGKILLed and started again
on the same state file and address, worker sessions joined through the job service that keep
beating through the outage (jobclient.Heartbeat retries transient failures with backoff), an
idle phase longer than --reap-timeout after the restart, and exact sums before and after."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from switchagg import Session, jobclient
from switchagg_lab.testing.controller import SECRET, Controller
from switchagg_lab.testing.kit import free_port, wait_until

REAP_TIMEOUT = 2.0  # 20 heartbeats: a loaded machine may stall a beating thread a while
N, LENGTH = 2, 40000  # several chunks per slot at the default K


def _tensor(rank: int, step: int) -> np.ndarray:
    return (np.arange(LENGTH, dtype=np.int64) * (step + 3) - 1000 * rank + 17 * step).astype(np.int32)


def _allreduce_exact(pool: ThreadPoolExecutor, sessions: list[Session], step: int) -> None:
    xs = [_tensor(s.rank, step) for s in sessions]
    expected = np.sum([_tensor(r, step).astype(np.int64) for r in range(N)], axis=0).astype(np.int32)
    list(pool.map(lambda s, x: s.allreduce(x), sessions, xs))
    for s, x in zip(sessions, xs, strict=True):
        assert np.array_equal(x, expected), f"rank {s.rank}: wrong sum after step {step}"


@pytest.mark.reliability(
    "controller restarted",
    "switchagg-ctl serve and its embedded aggregator SIGKILLed between allreduces of a running job, "
    "restarted on its state file, then idle for 3x --reap-timeout, 2 ranks (gRPC over TCP and a Unix socket)",
    sums=3 * N,
    recovery="the job reinstalled (new generation) and heartbeats back within seconds",
    state="the job kept (reloaded from the state file)",
)
@pytest.mark.parametrize("listen", ["tcp", "unix"])
def test_a_job_outlives_a_controller_restart_and_a_long_idle_phase(tmp_path: Path, listen: str) -> None:
    udp = free_port(socket.SOCK_DGRAM)  # the restarted aggregator listens where the workers send
    extra = ["--software", "--software-listen", f"127.0.0.1:{udp}", "--reap-timeout", str(REAP_TIMEOUT)]
    c = Controller(tmp_path, extra)
    address = f"unix:{tmp_path}/ctl.sock" if listen == "unix" else f"127.0.0.1:{free_port()}"
    c.start(listen=address)
    sessions: list[Session] = []

    def join(service: str, rank: int) -> Session:
        return Session.from_job_service(
            service, SECRET, "restarted", N, rank=rank, timeout=5.0, join_timeout=30.0, heartbeat_interval=0.1
        )

    with ThreadPoolExecutor(N) as pool:
        try:
            joins = [pool.submit(join, c.address, r) for r in range(N)]
            sessions = [f.result(timeout=60) for f in joins]
            first_generation = sessions[0].assignment.generation
            key = sessions[0].assignment.key  # the job's result key: kept across the restart (store)
            assert key != 0 and all(s.assignment.key == key for s in sessions)
            _allreduce_exact(pool, sessions, 0)

            c.kill()  # the controller and its embedded aggregator die mid-job
            time.sleep(0.5)  # a few heartbeats fail meanwhile (UNAVAILABLE)
            c.start(listen=address)
            assert "1 job(s) reloaded" in c.banner
            beats = [s._membership.heartbeat for s in sessions]
            # Every worker's heartbeats reach the restarted controller again: the job's new
            # generation comes back (the job was reinstalled on the fresh aggregator).
            deadline = time.monotonic() + 15
            while any(hb.generation == first_generation for hb in beats) and time.monotonic() < deadline:
                time.sleep(0.05)

            time.sleep(3 * REAP_TIMEOUT)  # idle: no aggregation traffic, only heartbeats
            listing = c.ctl("jobs", *c.client_args()).stdout
            assert "restarted" in listing, f"the job was reaped: {listing}"
            for step in (1, 2):
                _allreduce_exact(pool, sessions, step)
            for hb in beats:
                assert hb.error is None, hb.error
                assert hb.failures >= 1  # the outage was seen, and survived
                assert hb.retrying is None  # beating normally again
                assert hb.generation != first_generation
        finally:
            for s in sessions:
                s.close()
            c.stop()


def test_a_definitive_answer_stops_the_heartbeats(tmp_path: Path) -> None:
    c = Controller(tmp_path, ["--software", "--software-listen", "127.0.0.1:0"]).start()
    try:
        a = jobclient.join(c.address, SECRET, "gone", 1, "127.0.0.1", 40011, timeout=10)
        with jobclient.Heartbeat(c.address, SECRET, a, interval=0.05) as hb:
            c.ctl("teardown", "gone", *c.client_args())
            wait_until(lambda: hb.error is not None, 30, "the heartbeat's error", 0.05)
            assert "tore it down" in str(hb.error)
            hb._thread.join(5)
            assert not hb._thread.is_alive()  # no more heartbeats for a job that is gone
    finally:
        c.stop()


def test_heartbeats_retry_while_the_service_is_away(tmp_path: Path) -> None:
    """No controller at all: every heartbeat fails UNAVAILABLE, none is final."""
    a = jobclient.Assignment("software", "127.0.0.1", 48879, 1, 0, 1, 0, 4, 64, 1)
    with jobclient.Heartbeat(f"unix:{tmp_path}/nobody.sock", SECRET, a, interval=0.2) as hb:
        wait_until(lambda: hb.failures >= 4, 30, "4 failed heartbeats", 0.05)
        assert hb.error is None
        assert hb.retrying is not None and hb.retrying.code is not None
        assert jobclient.is_transient(hb.retrying)
        assert hb._thread.is_alive()
    assert not hb._thread.is_alive()  # stopping ends the retries
