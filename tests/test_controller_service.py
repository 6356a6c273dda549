"""The job service end to end: switchagg-ctl serve with its software aggregator, real gRPC on
127.0.0.1, and worker processes that join, allreduce through switchagg.Session and leave."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from switchagg import jobclient, protocol
from switchagg_lab.testing.controller import (
    ADMIN_SECRET,
    SECRET,
    Controller,
    aio_join,
    collect,
    expected_int_sum,
    start_workers,
)
from switchagg_lab.testing.kit import free_port


@pytest.fixture
def controller(tmp_path: Path):
    c = Controller(
        tmp_path, ["--software", "--software-listen", "127.0.0.1:0", "--join-timeout", "60"]
    ).start()
    yield c
    c.stop()


def test_workers_join_allreduce_and_leave(controller: Controller) -> None:
    n, length = 3, 20000  # several chunks per slot at the default K
    results = collect(start_workers(controller.address, SECRET, "e2e", n, length, seed=2))
    assert sorted(r["rank"] for r in results) == list(range(n))
    assert {r["job_id"] for r in results} == {results[0]["job_id"]}
    assert {r["data_plane"] for r in results} == {"software"}
    assert {r["k"] for r in results} == {protocol.DEFAULT_SW_K}
    total, head = expected_int_sum(n, length, seed=2)
    for r in results:
        assert r["int_sum"] == total and r["int_head"] == head
        assert r["float_head"] == pytest.approx([n * (n + 1) / 4] * 4, abs=protocol.error_bound(n, 2))
    assert sum(bool(r["removed"]) for r in results) == 1  # the last to leave frees the slots
    assert "no jobs" in controller.ctl("jobs", *controller.client_args()).stdout


def test_the_jobs_k_fits_the_smallest_mtu_its_workers_report(controller: Controller) -> None:
    """Workers report their route's MTU at Join (issue 34: never fragment): the job's K is the most one
    IP packet carries at the smallest, here 1500 against 9000 and an unknown (0), for every rank."""
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        joins = [
            pool.submit(
                jobclient.join, controller.address, SECRET, "mtus", 3, "127.0.0.1", 41000 + r, r, 30, mtu=m
            )
            for r, m in enumerate((9000, 1500, 0))
        ]
        assignments = [j.result(timeout=60) for j in joins]
    assert {a.k for a in assignments} == {protocol.k_for_mtu(1500)}
    assert protocol.packet_len(assignments[0].k) + protocol.IPV4_UDP_HEADERS <= 1500
    for a in assignments:
        jobclient.leave(controller.address, SECRET, a)


def test_requested_ranks_are_honoured(controller: Controller) -> None:
    results = collect(start_workers(controller.address, SECRET, "ranked", 3, 100, ranks=[2, None, 0]))
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    total, _ = expected_int_sum(3, 100, 0)
    assert all(r["int_sum"] == total for r in results)


def test_bad_secret_is_unauthenticated(controller: Controller) -> None:
    with pytest.raises(jobclient.JobServiceError, match="wrong secret") as e:
        jobclient.join(controller.address, "not-the-secret", "j", 1, "127.0.0.1", 40000, timeout=5)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    r = controller.ctl("jobs", "--service", controller.address, "--admin-secret", "nope", check=False)
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr


def test_double_join_from_one_address_is_refused(controller: Controller) -> None:
    errors: list[jobclient.JobServiceError] = []

    def first() -> None:
        try:
            jobclient.join(controller.address, SECRET, "dup", 2, "127.0.0.1", 40001, timeout=20)
        except jobclient.JobServiceError as e:
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    try:
        # Wait until the first join is registered, then join again from the same address.
        for _ in range(200):
            if "127.0.0.1:40001" in controller.ctl("jobs", *controller.client_args()).stdout:
                break
        with pytest.raises(jobclient.JobServiceError, match="already joined") as e:
            jobclient.join(controller.address, SECRET, "dup", 2, "127.0.0.1", 40001, rank=1, timeout=5)
        assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    finally:
        controller.ctl("teardown", "dup", *controller.client_args())  # releases the waiting join
        t.join(30)
    assert errors and errors[0].code == grpc.StatusCode.ABORTED


def test_join_times_out_with_a_clear_error(controller: Controller) -> None:
    with pytest.raises(jobclient.JobServiceError, match="1 of 2 workers joined within 1 s") as e:
        jobclient.join(controller.address, SECRET, "lonely", 2, "127.0.0.1", 40002, timeout=1.0)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "lonely" not in controller.ctl("jobs", *controller.client_args()).stdout


def test_bad_join_requests(controller: Controller) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(world_size=0), "world size"),
        (dict(world_size=33), "world size"),
        (dict(ip="10.0.0.300"), "not an IPv4 address"),
        (dict(ip="0.0.0.0"), "join with the worker's own address"),
        (dict(job_name=""), "job name"),
    ]
    for change, message in cases:
        args: dict[str, Any] = dict(job_name="bad", world_size=2, ip="127.0.0.1", udp_port=40003, rank=None)
        args.update(change)
        with pytest.raises(jobclient.JobServiceError, match=message) as e:
            jobclient.join(controller.address, SECRET, timeout=5, **args)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_join_refuses_bad_ranks_and_timeouts(controller: Controller) -> None:
    """Through a raw stub (jobclient.join refuses these before sending): only -1 means any rank,
    and the join timeout is a positive finite number (0, i.e. unset: the server's default)."""
    from switchagg._proto import jobs_pb2, jobs_pb2_grpc

    cases: list[tuple[dict[str, Any], str]] = [
        (dict(rank=-5), r"rank -5 is outside 0\.\.1"),
        (dict(rank=-2), r"rank -2 is outside 0\.\.1"),
        (dict(rank=-(2**31)), "outside 0..1"),
        (dict(rank=2), r"rank 2 is outside 0\.\.1"),
        (dict(rank=5), "outside 0..1"),
        (dict(timeout_s=float("nan")), "positive finite number of seconds, not nan"),
        (dict(timeout_s=float("inf")), "positive finite number of seconds, not inf"),
        (dict(timeout_s=float("-inf")), "not -inf"),
        (dict(timeout_s=-1.0), "positive finite number of seconds, not -1"),
        (dict(timeout_s=-1e-9), "positive finite"),
    ]
    with grpc.insecure_channel(controller.address) as channel:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        for change, message in cases:
            fields: dict[str, Any] = dict(
                secret=SECRET,
                job_name="bad",
                world_size=2,
                ip="127.0.0.1",
                udp_port=40003,
                rank=-1,
                timeout_s=5.0,
            )
            fields.update(change)
            with pytest.raises(grpc.RpcError) as e:
                stub.Join(jobs_pb2.JoinRequest(**fields), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (change, e.value.details())
            assert re.search(message, e.value.details()), (change, e.value.details())
        # A refused join left nothing behind; a good one still works (world size 1, rank -1: any).
        assert "bad" not in controller.ctl("jobs", *controller.client_args()).stdout
        ok = jobs_pb2.JoinRequest(
            secret=SECRET,
            job_name="fine",
            world_size=1,
            ip="127.0.0.1",
            udp_port=40012,
            rank=-1,
            timeout_s=0.0,
        )
        assert stub.Join(ok, timeout=30).rank == 0  # timeout_s 0 (unset): the server's default


def test_jobclient_join_checks_rank_and_timeout_before_sending() -> None:
    unreachable = "127.0.0.1:1"  # nothing is sent: no service needed
    for rank in (-1, -5, 2):
        with pytest.raises(ValueError, match=f"rank {rank} is outside 0..1"):
            jobclient.join(unreachable, SECRET, "j", 2, "127.0.0.1", 40013, rank=rank)
    for timeout in (float("nan"), float("inf"), 0.0, -3.0):
        with pytest.raises(ValueError, match="positive finite number of seconds"):
            jobclient.join(unreachable, SECRET, "j", 2, "127.0.0.1", 40013, timeout=timeout)


def test_heartbeat_teardown_and_counters(controller: Controller) -> None:
    a = jobclient.join(controller.address, SECRET, "solo", 1, "127.0.0.1", 40004, timeout=10)
    assert a.world_size == 1 and a.rank == 0 and a.generation > 0
    assert jobclient.heartbeat(controller.address, SECRET, a) == a.generation
    listing = controller.ctl("jobs", *controller.client_args()).stdout
    assert "solo" in listing and f"{a.slot_base}..{a.slot_base + a.slot_count - 1}" in listing
    counters = controller.ctl(
        "counters", *controller.client_args(), "--interval", "0.1", "--count", "2"
    ).stdout
    assert counters.count("[software]") == 2 and "bad_version" in counters
    lines = controller.ctl(
        "counters", *controller.client_args(), "--json", "--interval", "0.1", "--count", "2"
    ).stdout.splitlines()
    assert len(lines) == 2  # JSON lines: one object per round
    for line in lines:
        (plane,) = json.loads(line)["data_planes"]
        assert plane["jobs"] == [{"job_id": a.job_id, **dict.fromkeys(protocol.JOB_COUNTERS, 0)}]
    (listed,) = json.loads(controller.ctl("jobs", *controller.client_args(), "--json").stdout)["jobs"]
    assert listed["workers"] == [{"rank": 0, "ip": "127.0.0.1", "udp_port": 40004, "left": False}]
    assert f"job {a.job_id}" not in controller.ctl("teardown", "solo", *controller.client_args()).stdout
    with pytest.raises(jobclient.JobServiceError, match=r"ended: an operator tore it down") as e:
        jobclient.heartbeat(controller.address, SECRET, a)  # the reason, not only "no job"
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_silent_jobs_are_reaped(tmp_path: Path) -> None:
    # The reap timeout is 20 heartbeats: a loaded machine may stall the beating thread a while.
    c = Controller(
        tmp_path, ["--software", "--software-listen", "127.0.0.1:0", "--reap-timeout", "2.0"]
    ).start()
    try:
        a = jobclient.join(c.address, SECRET, "quiet", 1, "127.0.0.1", 40005, timeout=10)
        with jobclient.Heartbeat(c.address, SECRET, a, interval=0.1) as hb:
            b = jobclient.join(c.address, SECRET, "dies", 1, "127.0.0.1", 40006, timeout=10)
            # "dies" never heartbeats; wait (bounded) for the reaper while "quiet" keeps beating.
            for _ in range(300):
                if "dies" not in c.ctl("jobs", *c.client_args()).stdout:
                    break
            listing = c.ctl("jobs", *c.client_args()).stdout
            assert "dies" not in listing and "quiet" in listing
            assert hb.error is None
        with pytest.raises(jobclient.JobServiceError, match=r"the controller reaped it: rank\(s\) \[0\]"):
            jobclient.heartbeat(c.address, SECRET, b)
    finally:
        c.stop()


def test_a_session_from_the_job_service_heartbeats_by_itself_and_leaves_on_close(tmp_path: Path) -> None:
    import numpy as np

    from switchagg import Session

    c = Controller(
        tmp_path, ["--software", "--software-listen", "127.0.0.1:0", "--reap-timeout", "1.0"]
    ).start()
    try:
        with Session.from_job_service(c.address, SECRET, "idle", 1, heartbeat_interval=0.1) as s:
            time.sleep(3.0)  # three reap timeouts without an allreduce
            assert "idle" in c.ctl("jobs", *c.client_args()).stdout
            x = np.arange(10, dtype=np.int32)
            s.allreduce(x)
            assert x.tolist() == list(range(10))
        listing = c.ctl("jobs", *c.client_args()).stdout
        assert "idle" not in listing  # closing the session left the job, which freed it
    finally:
        c.stop()


def test_state_survives_a_controller_restart(tmp_path: Path) -> None:
    udp = free_port()  # the restarted aggregator must listen where the workers were told to send
    extra = ["--software", "--software-listen", f"127.0.0.1:{udp}"]
    c = Controller(tmp_path, extra).start()
    a = jobclient.join(c.address, SECRET, "durable", 1, "127.0.0.1", 40007, timeout=10)
    port = int(c.address.rsplit(":", 1)[1])
    c.stop()
    c.start(port)
    try:
        assert "1 job(s) reloaded" in c.banner
        listing = c.ctl("jobs", *c.client_args()).stdout
        assert "durable" in listing and f"{a.slot_base}..{a.slot_base + a.slot_count - 1}" in listing
        gen = jobclient.heartbeat(c.address, SECRET, a)
        assert gen != a.generation  # reinstalled on a fresh aggregator: a new generation
        # New jobs never get the reloaded job's id or slots.
        b = jobclient.join(c.address, SECRET, "second", 1, "127.0.0.1", 40008, timeout=10)
        assert b.job_id != a.job_id
        assert b.slot_base >= a.slot_base + a.slot_count or b.slot_base + b.slot_count <= a.slot_base
        assert jobclient.leave(c.address, SECRET, a) is True
    finally:
        c.stop()
    c.start(port)
    try:
        assert "1 job(s) reloaded" in c.banner  # "durable" left for good; "second" remains
    finally:
        c.stop()


def test_a_worker_that_gives_up_waiting_is_forgotten(controller: Controller) -> None:
    from switchagg._proto import jobs_pb2, jobs_pb2_grpc

    request = jobs_pb2.JoinRequest(
        secret=SECRET,
        job_name="impatient",
        world_size=2,
        ip="127.0.0.1",
        udp_port=40009,
        rank=-1,
        timeout_s=60,
    )
    with grpc.insecure_channel(controller.address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            jobs_pb2_grpc.JobServiceStub(channel).Join(request, timeout=1.0)  # the client's own deadline
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The service notices the cancelled call (bounded wait) and drops the waiting member.
    for _ in range(300):
        if "impatient" not in controller.ctl("jobs", *controller.client_args()).stdout:
            break
    assert "impatient" not in controller.ctl("jobs", *controller.client_args()).stdout


def test_a_worker_bound_to_any_address_reports_a_real_one(tmp_path: Path) -> None:
    """The controller pins what a worker reports; a socket bound to 0.0.0.0 reports the address
    routed towards the job service instead (the controller refuses 0.0.0.0), and a Unix-socket
    service asks for an explicit one."""
    import numpy as np

    from switchagg import Session

    c = Controller(tmp_path, ["--software", "--software-listen", "127.0.0.1:0"]).start()
    try:
        with Session.from_job_service(c.address, SECRET, "any", 1, bind=("0.0.0.0", 0)) as s:
            x = np.arange(10, dtype=np.int32)
            s.allreduce(x)  # the aggregator answers the pinned, real address
            assert x.tolist() == list(range(10))
    finally:
        c.stop()
    with pytest.raises(ValueError, match="cannot tell the job service"):
        Session.from_job_service(f"unix:{tmp_path}/none.sock", SECRET, "any", 1, bind=("0.0.0.0", 0))


async def test_sixteen_concurrent_joins_on_one_loop_are_all_answered_without_overlap(
    controller: Controller,
) -> None:
    """16 joins through the real gRPC port, all waiting at once on the service's one event loop:
    a job of 8 and two of 4, interleaved. The 8-worker job's last member is held back until
    ListJobs (answered meanwhile) shows the other 7 waiting; then every join is answered, each
    job with ranks 0..n-1 and one slot range, the ranges disjoint."""
    from switchagg._proto import jobs_pb2, jobs_pb2_grpc

    sizes = {"big": 8, "left": 4, "right": 4}
    members = [(name, m) for name, n in sizes.items() for m in range(n)]
    random.Random(16).shuffle(members)
    members.remove(("big", 7))
    port = iter(range(43000, 43016))
    async with grpc.aio.insecure_channel(controller.address) as channel:
        stub = jobs_pb2_grpc.JobServiceStub(channel)

        def join(name: str) -> asyncio.Task[Any]:
            return asyncio.create_task(aio_join(stub, SECRET, name, sizes[name], "127.0.0.1", next(port)))

        waiting = [join(name) for name, _ in members]
        big = [t for t, (name, _) in zip(waiting, members, strict=True) if name == "big"]
        deadline = time.monotonic() + 60
        while True:  # the service answers while 15 joins wait (bounded)
            listing = await stub.ListJobs(jobs_pb2.ListJobsRequest(admin_secret=ADMIN_SECRET), timeout=10)
            pending = [len(j.workers) for j in listing.jobs if j.name == "big" and j.state == "pending"]
            if pending == [7]:
                break
            assert time.monotonic() < deadline, f"7 waiting joins never showed: {listing}"
            await asyncio.sleep(0.05)
        assert not any(t.done() for t in big)  # all 7 still waiting for the 8th
        replies = await asyncio.gather(*waiting, join("big"))
    by_job: dict[int, list[Any]] = {}
    for r in replies:
        by_job.setdefault(r.job_id, []).append(r)
    assert sorted(len(rs) for rs in by_job.values()) == [4, 4, 8]
    ranges = []
    for rs in by_job.values():
        assert sorted(r.rank for r in rs) == list(range(len(rs)))
        assert len({(r.slot_base, r.slot_count, r.generation) for r in rs}) == 1
        ranges.append((rs[0].slot_base, rs[0].slot_base + rs[0].slot_count))
    ranges.sort()
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False)), ranges
