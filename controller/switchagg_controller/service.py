"""The gRPC face of the job manager (proto/switchagg/jobs.proto), with who may call what.

The join secret admits a worker: Join and Describe. Heartbeat and Leave also need the member
token of the caller's own place in its job (the job manager checks it). ListJobs, Counters and
Teardown, an operator's calls, need the admin secret; the join secret is refused there
(PERMISSION_DENIED), since every worker holds it.

grpc.aio on the controller's one event loop: a waiting Join is a suspended coroutine, not a held
thread, and every handler runs between the job manager's awaits, so none of them needs a lock.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
import urllib.parse
from collections.abc import Callable
from typing import NoReturn

import grpc

from switchagg._proto import jobs_pb2, jobs_pb2_grpc
from switchagg_controller.jobs import JobError, JobManager

log = logging.getLogger("switchagg.service")


ANY_RANK = -1  # JoinRequest.rank for "any rank" (jobs.proto)

JoinObserver = Callable[[float, str], None]  # (seconds from call to answer, outcome: "ok" or a status)


def client_of(peer: str) -> str:
    """Who a call counts against for the quotas: the address it came from, without the port
    (gRPC's peer "ipv4:10.0.0.5:41234" -> "10.0.0.5"; an IPv4-mapped IPv6 peer as IPv4). Every
    caller on a Unix socket is one client, "unix": the socket's file permissions decide who that is."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return kind
    host = rest.rpartition(":")[0].strip("[]")
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return str(mapped or addr)


class JobService(jobs_pb2_grpc.JobServiceServicer):
    def __init__(
        self,
        manager: JobManager,
        secret: str,
        on_join: JoinObserver | None = None,
        admin_secret: str | None = None,
    ) -> None:
        """``admin_secret`` None: no call may list, count or tear down (an embedder's service)."""
        if not secret:
            raise ValueError("the job service needs a non-empty secret")
        if admin_secret is not None and (not admin_secret or admin_secret == secret):
            raise ValueError("the admin secret must be non-empty and differ from the join secret")
        self.manager = manager
        self._secret = secret.encode()
        self._admin = admin_secret.encode() if admin_secret is not None else None
        self._on_join = on_join

    async def _check(self, secret: str, context: grpc.aio.ServicerContext) -> None:
        if not hmac.compare_digest(secret.encode(), self._secret):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong secret for this job service")

    async def _check_admin(self, secret: str, call: str, context: grpc.aio.ServicerContext) -> None:
        given = secret.encode()
        if self._admin is not None and hmac.compare_digest(given, self._admin):
            return
        if hmac.compare_digest(given, self._secret):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{call} needs the admin secret (switchagg-ctl --admin-secret-file); the join secret "
                "only joins jobs",
            )
        if self._admin is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"this job service takes no {call} calls")
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong admin secret for this job service")

    @staticmethod
    async def _fail(e: JobError, context: grpc.aio.ServicerContext) -> NoReturn:
        await context.abort(e.code, str(e))
        raise AssertionError("context.abort() returned")  # it raises; this tells the type checker

    async def Join(
        self, request: jobs_pb2.JoinRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.JoinReply:
        await self._check(request.secret, context)
        start = time.monotonic()
        try:
            a = await self.manager.join(
                request.job_name,
                request.world_size,
                request.ip,
                request.udp_port,
                None if request.rank == ANY_RANK else request.rank,  # other negatives are refused
                request.timeout_s,
                request.shards,
                tuple(request.shard_ports),
                tuple(request.shard_ips),
                client_of(context.peer()),
                request.mtu,
            )
        except JobError as e:
            self._observe_join(start, e.code.name.lower())
            await self._fail(e, context)
        self._observe_join(start, "ok")
        log.info(
            "job %s: rank %d joined from %s:%d; job %d on the %s data plane (%s:%d, slots %d+%d, K=%d)",
            request.job_name, a.rank, request.ip, request.udp_port, a.job_id, a.data_plane,
            a.aggregator_ip, a.aggregator_port, a.slot_base, a.slot_count, a.k,
        )  # fmt: skip
        return jobs_pb2.JoinReply(
            data_plane=a.data_plane,
            aggregator_ip=a.aggregator_ip,
            aggregator_port=a.aggregator_port,
            job_id=a.job_id,
            rank=a.rank,
            world_size=a.world_size,
            slot_base=a.slot_base,
            slot_count=a.slot_count,
            k=a.k,
            generation=a.generation,
            result_key=a.key,
            member_token=a.token,
            shards=[
                jobs_pb2.ShardAssignment(
                    index=s.index,
                    node=s.node,
                    aggregator_ip=s.aggregator_ip,
                    aggregator_port=s.aggregator_port,
                    slot_base=s.slot_base,
                    slot_count=s.slot_count,
                    result_key=s.key,
                    udp_port=s.udp_port,
                )  # fmt: skip
                for s in a.shards
            ],
        )

    def _observe_join(self, start: float, outcome: str) -> None:
        if self._on_join is not None:
            self._on_join(time.monotonic() - start, outcome)

    async def Leave(
        self, request: jobs_pb2.LeaveRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.LeaveReply:
        await self._check(request.secret, context)
        try:
            removed = await self.manager.leave(request.job_id, request.rank, request.member_token)
        except JobError as e:
            await self._fail(e, context)
        return jobs_pb2.LeaveReply(job_removed=removed)

    async def Heartbeat(
        self, request: jobs_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.HeartbeatReply:
        await self._check(request.secret, context)
        try:
            generation = self.manager.heartbeat(request.job_id, request.rank, request.member_token)
        except JobError as e:
            await self._fail(e, context)
        return jobs_pb2.HeartbeatReply(generation=generation)

    async def ListJobs(
        self, request: jobs_pb2.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.ListJobsReply:
        await self._check_admin(request.admin_secret, "ListJobs", context)
        reply = jobs_pb2.ListJobsReply()
        for v in self.manager.list():
            info = reply.jobs.add(
                name=v.name, state=v.state, data_plane=v.data_plane, world_size=v.world_size
            )
            if v.job is not None:
                j = v.job
                info.job_id, info.slot_base, info.slot_count = j.job_id, j.slot_base, j.slot_count
                info.k, info.generation = j.k, j.generation
                for w in sorted(j.workers, key=lambda w: w.rank):
                    info.workers.add(rank=w.rank, ip=w.ip, udp_port=w.udp_port, left=w.rank in v.left)
                striped = self.manager.striped
                for i, shard in enumerate(j.shards if striped is not None else ()):
                    assert striped is not None
                    ip, port = striped.node_address(shard.node)
                    info.shards.add(
                        index=i, node=shard.node, aggregator_ip=ip, aggregator_port=port,
                        slot_base=shard.slot_base, slot_count=shard.slot_count,
                    )  # fmt: skip
            else:
                for ip, port in v.joined:
                    info.workers.add(ip=ip, udp_port=port)
        return reply

    async def Describe(
        self, request: jobs_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.DescribeReply:
        await self._check(request.secret, context)
        striped = self.manager.striped
        return jobs_pb2.DescribeReply(reducers=striped.size if striped is not None else 0)

    async def Teardown(
        self, request: jobs_pb2.TeardownRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.TeardownReply:
        await self._check_admin(request.admin_secret, "Teardown", context)
        try:
            job_id = await self.manager.teardown(request.job)
        except JobError as e:
            await self._fail(e, context)
        log.info("job %s torn down", request.job)
        return jobs_pb2.TeardownReply(job_id=job_id)

    async def Counters(
        self, request: jobs_pb2.CountersRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.CountersReply:
        """Every data plane's counters; a part that cannot be read (a switch that is away) is
        named in ``unavailable`` with the reason, and the others answer."""
        await self._check_admin(request.admin_secret, "Counters", context)
        reply = jobs_pb2.CountersReply()
        planes = list(self.manager.planes.values())
        for reading in await asyncio.gather(*(p.counters() for p in planes)):
            for c in reading.values:
                reply.counters.add(
                    data_plane=c.data_plane,
                    scope=c.scope,
                    name=c.name,
                    index=c.index,
                    packets=c.packets,
                    bytes=c.bytes,
                )
            for plane, error in reading.unavailable.items():
                reply.unavailable.add(data_plane=plane, error=error)
        return reply


async def reap_forever(manager: JobManager) -> None:
    """Removes jobs whose workers stopped heartbeating; looks a few times per reap timeout."""
    while True:
        await asyncio.sleep(max(0.05, manager.reap_timeout / 4))
        try:
            for job_id in await manager.reap():
                log.warning("job %d reaped: a worker stopped heartbeating", job_id)
        except Exception:  # a broken look must not end the reaping
            log.exception("reaping failed")


def make_server(
    manager: JobManager,
    secret: str,
    address: str,
    on_join: JoinObserver | None = None,
    admin_secret: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A server bound to ``address`` ("127.0.0.1:0" picks a port), to be started on the running
    loop (``await server.start()``); returns it and the port."""
    server = grpc.aio.server()
    jobs_pb2_grpc.add_JobServiceServicer_to_server(JobService(manager, secret, on_join, admin_secret), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return server, port
