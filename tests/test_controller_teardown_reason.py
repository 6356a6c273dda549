"""A job the controller ends under its workers tells them why: `switchagg-ctl teardown` of a job
whose rank 0 waits in an allreduce ends that call with the teardown as its reason (through the
heartbeat: the job service answers with why the job ended, and the session cancels its call),
long before the session's timeout; a late heartbeat of a job that every rank left, or that the
controller reaped, hears that reason too. A real `switchagg-ctl serve` and real sessions."""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("grpc", reason="the controller needs its extra (pip install .[controller])")

from switchagg import Session, SwitchaggTeardown, jobclient  # noqa: E402
from switchagg_lab.testing.controller import SECRET, Controller  # noqa: E402
from switchagg_lab.testing.kit import free_port, wait_until  # noqa: E402

SESSION_TIMEOUT_S = 120.0  # the generic "no result" error could only come after this


def _controller(tmp_path: Path, *extra: str) -> Controller:
    udp = free_port(socket.SOCK_DGRAM)
    return Controller(tmp_path, ["--software", "--software-listen", f"127.0.0.1:{udp}", *extra]).start()


def _join(c: Controller, name: str, rank: int, n: int = 2) -> Session:
    return Session.from_job_service(
        c.address, SECRET, name, n, rank=rank, timeout=SESSION_TIMEOUT_S, heartbeat_interval=0.2
    )


@contextlib.contextmanager
def _two_ranks(
    tmp_path: Path, name: str
) -> Iterator[tuple[Controller, Session, concurrent.futures.Executor]]:
    """A controller and rank 0's session of a 2-rank job whose rank 1 joined and never calls."""
    c = _controller(tmp_path)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            s0, s1 = pool.map(lambda r: _join(c, name, r), range(2))
            try:
                yield c, s0, pool
            finally:
                s0.close()
                s1.close()
    finally:
        c.stop()


def test_a_teardown_ends_a_waiting_call_with_its_reason(tmp_path: Path) -> None:
    with _two_ranks(tmp_path, "doomed") as (c, s0, pool):
        x = np.ones(50_000, dtype=np.int32)
        call = pool.submit(s0.allreduce, x)  # rank 1 never calls: rank 0 waits for it
        time.sleep(0.5)
        assert not call.done()
        c.ctl("teardown", "doomed", *c.client_args())
        with pytest.raises(SwitchaggTeardown) as e:  # its own class, not a timeout
            call.result(timeout=SESSION_TIMEOUT_S / 2)  # the timeout would say "no result"
        message = str(e.value)
        assert "tore it down" in message and "switchagg-ctl teardown" in message, message
        assert "doomed" in message
        with pytest.raises(SwitchaggTeardown, match="tore it down"):  # and the session stays ended
            s0.allreduce(np.ones(10, dtype=np.int32))


def test_a_teardown_of_an_idle_job_raises_the_same_class_at_the_next_call(tmp_path: Path) -> None:
    with _two_ranks(tmp_path, "idle") as (c, s0, _):
        c.ctl("teardown", "idle", *c.client_args())
        # The membership hears it within a heartbeat interval (0.2 s); the next call says why.
        membership = s0._membership
        assert membership is not None
        wait_until(lambda: membership.heartbeat.error is not None, SESSION_TIMEOUT_S, "the teardown heard")
        with pytest.raises(SwitchaggTeardown, match="tore it down"):
            s0.allreduce(np.ones(10, dtype=np.int32))


def test_a_late_heartbeat_hears_why_the_job_ended(tmp_path: Path) -> None:
    c = _controller(tmp_path)
    try:
        a = jobclient.join(c.address, SECRET, "short", 1, "127.0.0.1", 40123, timeout=10)
        assert jobclient.leave(c.address, SECRET, a)
        with pytest.raises(jobclient.JobServiceError, match="every rank left it") as e:
            jobclient.heartbeat(c.address, SECRET, a)
        assert not jobclient.is_transient(e.value)
        with pytest.raises(jobclient.JobServiceError, match=r"no job 999 \(torn down, reaped or never"):
            jobclient.heartbeat(c.address, SECRET, jobclient.Assignment(**{**a.__dict__, "job_id": 999}))
    finally:
        c.stop()


def test_a_reaped_job_says_it_was_reaped_and_who_was_silent(tmp_path: Path) -> None:
    c = _controller(tmp_path, "--reap-timeout", "0.5")
    try:
        a = jobclient.join(c.address, SECRET, "silent", 1, "127.0.0.1", 40124, timeout=10)
        deadline = time.monotonic() + 60  # the reaper's own period; only guards against a hang
        while True:
            try:
                jobclient.heartbeat(c.address, SECRET, a)
            except jobclient.JobServiceError as e:
                assert "reaped" in str(e) and "rank(s) [0]" in str(e), e
                break
            assert time.monotonic() < deadline, "the silent job was never reaped"
            time.sleep(1.0)  # silent for longer than the reap timeout between beats
    finally:
        c.stop()
