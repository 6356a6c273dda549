"""Who may do what on the job service (docs/CONTROLLER.md, Who may do what), against a real
``switchagg-ctl serve`` (or the service in process, where the test needs the manager's clock) with
real gRPC on loopback:

- Heartbeat and Leave need the member token of the caller's own place in its job, which its Join
  returned: another job's token, another rank's, or none is PERMISSION_DENIED and changes nothing.
- ListJobs, Counters and Teardown need the admin secret; the join secret is PERMISSION_DENIED.
- Quotas per client, the address calls come from (a TCP forwarder from 127.0.0.2 plays a second
  host): a join flood takes its client's quota and no more, waiting joins stay bounded, and a
  real job of another client is still placed and sums exactly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import stat
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from switchagg import Session, jobclient
from switchagg._proto import jobs_pb2, jobs_pb2_grpc
from switchagg.aggregator import SoftwareAggregator
from switchagg_controller.jobs import JobManager
from switchagg_controller.planes import SoftwareDataPlane
from switchagg_controller.service import client_of, make_server
from switchagg_controller.store import Store
from switchagg_lab.testing.controller import SECRET, Controller, aio_join, ctl_json
from switchagg_lab.testing.kit import free_port
from switchagg_lab.testing.source_proxy import SourceProxy

DENIED = grpc.StatusCode.PERMISSION_DENIED
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _serve(tmp_path: Path, *extra: str, admin_secret: str | None = "admin-for-auth-tests") -> Controller:
    udp = f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}"
    return Controller(
        tmp_path, ["--software", "--software-listen", udp, *extra], admin_secret=admin_secret
    ).start()


@pytest.fixture
def controller(tmp_path: Path):
    c = _serve(tmp_path)
    yield c
    c.stop()


def _target(c: Controller) -> tuple[str, int]:
    host, _, port = c.address.rpartition(":")
    return host, int(port)


def _jobs(c: Controller) -> dict[str, dict[str, Any]]:
    return {j["name"]: j for j in ctl_json(c, "jobs")["jobs"]}


# -- member tokens ------------------------------------------------------------------------------


def test_heartbeat_and_leave_need_the_callers_own_member_token(controller: Controller) -> None:
    c = controller
    a = jobclient.join(c.address, SECRET, "mine", 1, "127.0.0.1", 40201, timeout=10)
    b = jobclient.join(c.address, SECRET, "theirs", 1, "127.0.0.1", 40202, timeout=10)
    assert a.token and b.token and a.token != b.token
    assert a.token not in repr(a)  # an Assignment in a log does not give its token away
    for forged in (replace(a, token=b.token), replace(a, token=""), replace(a, token="x" * 43)):
        for call in (jobclient.heartbeat, jobclient.leave):
            with pytest.raises(jobclient.JobServiceError, match="not rank 0's member token of job") as e:
                call(c.address, SECRET, forged)
            assert e.value.code == DENIED and not jobclient.is_transient(e.value)
    listed = _jobs(c)
    assert set(listed) == {"mine", "theirs"}  # the refused leaves removed nothing
    assert listed["mine"]["workers"] == [{"rank": 0, "ip": "127.0.0.1", "udp_port": 40201, "left": False}]
    assert jobclient.heartbeat(c.address, SECRET, a) == a.generation
    assert jobclient.leave(c.address, SECRET, a) is True
    # An ended job: its member hears why; anyone else hears nothing of it.
    with pytest.raises(jobclient.JobServiceError, match="every rank left it") as e:
        jobclient.heartbeat(c.address, SECRET, a)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(jobclient.JobServiceError) as e:
        jobclient.heartbeat(c.address, SECRET, replace(a, token=b.token))
    assert e.value.code == DENIED and "left" not in str(e.value)


def test_a_rank_cannot_act_for_another_rank_of_its_job(controller: Controller) -> None:
    c = controller

    def join(rank: int) -> jobclient.Assignment:
        return jobclient.join(c.address, SECRET, "pair", 2, "127.0.0.1", 40210 + rank, rank=rank, timeout=30)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        r0, r1 = pool.map(join, range(2))
    assert r0.token != r1.token
    with pytest.raises(jobclient.JobServiceError, match="not rank 0's member token of job") as e:
        jobclient.leave(c.address, SECRET, replace(r0, token=r1.token))
    assert e.value.code == DENIED
    assert [w["left"] for w in _jobs(c)["pair"]["workers"]] == [False, False]
    assert jobclient.leave(c.address, SECRET, r1) is False
    assert jobclient.leave(c.address, SECRET, r0) is True  # rank 0 had not left: it frees the job
    assert _jobs(c) == {}


async def test_a_refused_heartbeat_keeps_no_job_alive(tmp_path: Path) -> None:
    """In process, on the manager's own clock (no waiting): heartbeats with another job's token
    for 18 s of a 10 s reap timeout are refused, and the job is reaped as if they never came;
    the job whose token it was, beating meanwhile, stays."""
    now = [0.0]
    with SoftwareAggregator("127.0.0.1", 0) as agg:
        store = Store(tmp_path / "ctl.db")
        plane = SoftwareDataPlane(agg, k=64, default_slots=4)
        manager = JobManager(store, [plane], reap_timeout=10.0, clock=lambda: now[0])
        server, port = make_server(manager, SECRET, "127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = jobs_pb2_grpc.JobServiceStub(channel)
                victim = await aio_join(stub, SECRET, "victim", 1, "127.0.0.1", 40220)
                other = await aio_join(stub, SECRET, "other", 1, "127.0.0.1", 40221)

                def beat(job_id: int) -> jobs_pb2.HeartbeatRequest:
                    token = other.member_token
                    return jobs_pb2.HeartbeatRequest(secret=SECRET, job_id=job_id, rank=0, member_token=token)

                for _ in range(3):
                    now[0] += 6.0
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.Heartbeat(beat(victim.job_id), timeout=10)
                    assert e.value.code() == DENIED
                    await stub.Heartbeat(beat(other.job_id), timeout=10)
                assert await manager.reap() == []  # the first look takes the counters' baseline
                assert await manager.reap() == [victim.job_id]
                assert [j.name for j in manager.jobs()] == ["other"]
        finally:
            await server.stop(0)
            store.close()


# -- the admin secret ---------------------------------------------------------------------------


def test_only_the_admin_secret_lists_counts_and_tears_down(controller: Controller) -> None:
    c = controller
    a = jobclient.join(c.address, SECRET, "kept", 1, "127.0.0.1", 40203, timeout=10)
    calls: list[tuple[str, Any]] = [
        ("ListJobs", jobs_pb2.ListJobsRequest(admin_secret=SECRET)),
        ("Counters", jobs_pb2.CountersRequest(admin_secret=SECRET)),
        ("Teardown", jobs_pb2.TeardownRequest(admin_secret=SECRET, job="kept")),
        ("Teardown", jobs_pb2.TeardownRequest(admin_secret=SECRET, job=str(a.job_id))),
    ]
    with grpc.insecure_channel(c.address) as channel:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        for method, request in calls:
            with pytest.raises(grpc.RpcError) as e:
                getattr(stub, method)(request, timeout=10)
            assert e.value.code() == DENIED, method
            assert f"{method} needs the admin secret" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Teardown(jobs_pb2.TeardownRequest(admin_secret="guess", job="kept"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert jobclient.heartbeat(c.address, SECRET, a) == a.generation  # still there
    join_secret = ["--service", c.address, "--secret-file", str(c.secret_file)]
    r = c.ctl("teardown", "kept", *join_secret, check=False)
    assert r.returncode == 1 and "teardown needs the admin secret" in r.stderr, r.stderr
    assert "the join secret, which no longer lists, counts or tears down jobs" in r.stderr
    assert "(id" in c.ctl("teardown", "kept", *c.client_args()).stdout
    with pytest.raises(jobclient.JobServiceError, match="tore it down"):
        jobclient.heartbeat(c.address, SECRET, a)


def test_serve_keeps_an_admin_secret_of_its_own_beside_its_state(tmp_path: Path) -> None:
    c = _serve(tmp_path, admin_secret=None)
    try:
        path = c.admin_secret_file
        assert path == Path(f"{c.state}.admin-secret") and f"admin secret in {path}" in c.banner
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        made = path.read_text().strip()
        assert len(made) >= 32 and made != SECRET
        assert c.ctl("jobs", *c.client_args()).stdout.strip() == "no jobs"
        port = _target(c)[1]
        c.stop()
        c.start(port)
        assert path.read_text().strip() == made  # a restart keeps it
        assert c.ctl("jobs", *c.client_args()).stdout.strip() == "no jobs"
    finally:
        c.stop()
    same = tmp_path / "same"
    same.mkdir()
    with pytest.raises(RuntimeError, match="the admin secret must differ from the join secret"):
        _serve(same, admin_secret=SECRET)


# -- quotas per client --------------------------------------------------------------------------


def test_a_client_holds_at_most_its_jobs(tmp_path: Path) -> None:
    c = _serve(tmp_path, "--max-jobs-per-client", "3")
    try:
        held = [
            jobclient.join(c.address, SECRET, f"j{i}", 1, "127.0.0.1", 40230 + i, timeout=10)
            for i in range(3)
        ]
        with pytest.raises(
            jobclient.JobServiceError,
            match=r"client 127\.0\.0\.1 has workers in 3 jobs.*--max-jobs-per-client 3",
        ) as e:
            jobclient.join(c.address, SECRET, "j3", 1, "127.0.0.1", 40233, timeout=10)
        assert e.value.code == EXHAUSTED
        with SourceProxy(_target(c), "127.0.0.2") as elsewhere:  # another client: a quota of its own
            b = jobclient.join(elsewhere.address, SECRET, "other", 1, "127.0.0.1", 40240, timeout=10)
            assert jobclient.leave(elsewhere.address, SECRET, b) is True
        assert jobclient.leave(c.address, SECRET, held[0]) is True
        again = jobclient.join(c.address, SECRET, "j3", 1, "127.0.0.1", 40233, timeout=10)
        assert sorted(_jobs(c)) == ["j1", "j2", "j3"] and again.rank == 0
    finally:
        c.stop()


def test_a_join_flood_takes_its_clients_slots_not_the_pool(tmp_path: Path) -> None:
    """The issue's flood, scaled down: at 2048 slots a job, 16 jobs fill the software pool (32768
    slots). One client's 300 one-worker joins get its 8192 slots (4 jobs) and every other join is
    refused naming the quota; the service holds those 4 jobs and nothing else; a 2-worker job of
    another client is placed and sums exactly."""
    c = _serve(tmp_path, "--sw-slots", "2048", "--sw-k", "64", "--max-slots-per-client", "8192")
    try:
        placed: list[jobs_pb2.JoinReply] = []
        refused: list[tuple[grpc.StatusCode, str]] = []
        with SourceProxy(_target(c), "127.0.0.2") as flood, grpc.insecure_channel(flood.address) as channel:
            stub = jobs_pb2_grpc.JobServiceStub(channel)
            for i in range(300):
                request = jobs_pb2.JoinRequest(
                    secret=SECRET, job_name=f"flood{i}", world_size=1, ip="127.0.0.1", udp_port=20000 + i,
                    rank=-1, timeout_s=10,
                )  # fmt: skip
                try:
                    placed.append(stub.Join(request, timeout=60))
                except grpc.RpcError as e:
                    refused.append((e.code(), e.details()))
        assert len(placed) == 4 and len(refused) == 296
        for code, details in refused:
            assert code == EXHAUSTED, details
            assert (
                "client 127.0.0.2 would hold 10240 slots" in details and "--max-slots-per-client" in details
            )
        assert sorted(_jobs(c)) == sorted(f"flood{i}" for i in range(4))

        def rank(r: int) -> list[int]:
            with Session.from_job_service(c.address, SECRET, "real", 2, rank=r, timeout=60) as s:
                x = np.arange(1000, dtype=np.int32) * (r + 1)
                s.allreduce(x)
                return [int(v) for v in x]

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            sums = list(pool.map(rank, range(2)))
        assert sums == [[3 * i for i in range(1000)]] * 2
    finally:
        c.stop()


async def test_waiting_joins_are_bounded_per_client_and_overall(tmp_path: Path) -> None:
    """Joins that wait for partners that never come: one client's 200 (each of its own job) stop
    at its job quota (20 waiting); a real job of another client is still placed; a third client's
    flood stops at the service's bound (30 waiting in all), which still lets a join complete a
    waiting job; once the flooders give up, nothing of them is left."""
    c = _serve(tmp_path, "--max-jobs-per-client", "20", "--max-pending-joins", "30")
    proxies = [SourceProxy(_target(c), "127.0.0.2"), SourceProxy(_target(c), "127.0.0.3")]
    try:
        async with (
            grpc.aio.insecure_channel(proxies[0].address) as one,
            grpc.aio.insecure_channel(proxies[1].address) as two,
            grpc.aio.insecure_channel(c.address) as own,
        ):

            def flood(channel: grpc.aio.Channel, name: str, count: int, port: int) -> list[asyncio.Task[Any]]:
                stub = jobs_pb2_grpc.JobServiceStub(channel)
                return [
                    asyncio.create_task(aio_join(stub, SECRET, f"{name}{i}", 2, "127.0.0.1", port + i))
                    for i in range(count)
                ]

            async def settle(tasks: list[asyncio.Task[Any]], refused: int) -> list[str]:
                """Waits (bounded: a hang guard) until ``refused`` of ``tasks`` were answered."""
                deadline = time.monotonic() + 120
                while sum(t.done() for t in tasks) < refused:
                    assert time.monotonic() < deadline, f"{sum(t.done() for t in tasks)} answered"
                    await asyncio.sleep(0.05)
                errors = [t.exception() for t in tasks if t.done()]
                assert all(isinstance(e, grpc.aio.AioRpcError) and e.code() == EXHAUSTED for e in errors)
                return [e.details() or "" for e in errors if isinstance(e, grpc.aio.AioRpcError)]

            first = flood(one, "a", 200, 21000)
            for details in await settle(first, 180):
                assert "client 127.0.0.2 has workers in 20 jobs" in details, details
                assert "--max-jobs-per-client 20" in details
            assert sum(not t.done() for t in first) == 20

            stub = jobs_pb2_grpc.JobServiceStub(own)
            real = await asyncio.gather(
                *(aio_join(stub, SECRET, "real", 2, "127.0.0.1", 22000 + r) for r in range(2))
            )
            assert sorted(r.rank for r in real) == [0, 1]

            second = flood(two, "b", 50, 23000)
            for details in await settle(second, 40):
                assert "30 joins are waiting" in details and "--max-pending-joins" in details, details
            listing = await stub.ListJobs(jobs_pb2.ListJobsRequest(admin_secret=_admin(c)), timeout=10)
            waiting = [j.name for j in listing.jobs if j.state == "pending"]
            assert len(waiting) == 30
            assert [j.name for j in listing.jobs if j.state == "active"] == ["real"]
            # A join that completes a waiting job waits for nobody: the bound does not stop it.
            done = await aio_join(stub, SECRET, waiting[0], 2, "127.0.0.1", 22010)
            assert done.rank in (0, 1)

            for t in first + second:
                t.cancel()  # the flooders give up: the service drops what they left waiting
            await asyncio.gather(*first, *second, return_exceptions=True)
            deadline = time.monotonic() + 120
            while True:
                listing = await stub.ListJobs(jobs_pb2.ListJobsRequest(admin_secret=_admin(c)), timeout=10)
                if sorted(j.name for j in listing.jobs) == sorted(["real", waiting[0]]):
                    break
                assert time.monotonic() < deadline, [j.name for j in listing.jobs]
                await asyncio.sleep(0.05)
    finally:
        for p in proxies:
            p.close()
        c.stop()


def _admin(c: Controller) -> str:
    return c.admin_secret_file.read_text().strip()


@pytest.mark.parametrize(
    "peer, client",
    [
        ("ipv4:10.0.0.5:41234", "10.0.0.5"),
        ("ipv6:[2001:db8::1]:5000", "2001:db8::1"),
        ("ipv6:%5B::1%5D:46138", "::1"),  # newer gRPC percent-encodes the brackets
        ("ipv6:[::ffff:127.0.0.2]:80", "127.0.0.2"),  # IPv4 through a dual-stack socket: the same client
        ("unix:/run/jobs.sock", "unix"),
        ("unix:", "unix"),
    ],
)
def test_a_client_is_the_address_its_calls_come_from(peer: str, client: str) -> None:
    assert client_of(peer) == client
