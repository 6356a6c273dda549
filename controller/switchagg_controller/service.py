"""The gRPC face of the job manager (proto/switchagg/jobs.proto), with the shared-secret check."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import NoReturn

import grpc

from switchagg._proto import jobs_pb2, jobs_pb2_grpc
from switchagg_controller.jobs import JobError, JobManager

log = logging.getLogger("switchagg.service")


JoinObserver = Callable[[float, str], None]  # (seconds from call to answer, outcome: "ok" or a status)


class JobService(jobs_pb2_grpc.JobServiceServicer):
    def __init__(self, manager: JobManager, secret: str, on_join: JoinObserver | None = None) -> None:
        if not secret:
            raise ValueError("the job service needs a non-empty secret")
        self.manager = manager
        self._secret = secret.encode()
        self._on_join = on_join

    def _check(self, secret: str, context: grpc.ServicerContext) -> None:
        if not hmac.compare_digest(secret.encode(), self._secret):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong secret for this job service")

    @staticmethod
    def _fail(e: JobError, context: grpc.ServicerContext) -> NoReturn:
        context.abort(e.code, str(e))
        raise AssertionError("context.abort() returned")  # it raises; this tells the type checker

    def Join(self, request: jobs_pb2.JoinRequest, context: grpc.ServicerContext) -> jobs_pb2.JoinReply:
        self._check(request.secret, context)
        start = time.monotonic()
        try:
            a = self.manager.join(
                request.job_name,
                request.world_size,
                request.ip,
                request.udp_port,
                None if request.rank < 0 else request.rank,
                request.timeout_s,
                alive=context.is_active,
            )
        except JobError as e:
            self._observe_join(start, e.code.name.lower())
            self._fail(e, context)
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
        )

    def _observe_join(self, start: float, outcome: str) -> None:
        if self._on_join is not None:
            self._on_join(time.monotonic() - start, outcome)

    def Leave(self, request: jobs_pb2.LeaveRequest, context: grpc.ServicerContext) -> jobs_pb2.LeaveReply:
        self._check(request.secret, context)
        try:
            removed = self.manager.leave(request.job_id, request.rank)
        except JobError as e:
            self._fail(e, context)
        return jobs_pb2.LeaveReply(job_removed=removed)

    def Heartbeat(
        self, request: jobs_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> jobs_pb2.HeartbeatReply:
        self._check(request.secret, context)
        try:
            generation = self.manager.heartbeat(request.job_id, request.rank)
        except JobError as e:
            self._fail(e, context)
        return jobs_pb2.HeartbeatReply(generation=generation)

    def ListJobs(
        self, request: jobs_pb2.ListJobsRequest, context: grpc.ServicerContext
    ) -> jobs_pb2.ListJobsReply:
        self._check(request.secret, context)
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
            else:
                for ip, port in v.joined:
                    info.workers.add(ip=ip, udp_port=port)
        return reply

    def Teardown(
        self, request: jobs_pb2.TeardownRequest, context: grpc.ServicerContext
    ) -> jobs_pb2.TeardownReply:
        self._check(request.secret, context)
        try:
            job_id = self.manager.teardown(request.job)
        except JobError as e:
            self._fail(e, context)
        log.info("job %s torn down", request.job)
        return jobs_pb2.TeardownReply(job_id=job_id)

    def Counters(
        self, request: jobs_pb2.CountersRequest, context: grpc.ServicerContext
    ) -> jobs_pb2.CountersReply:
        self._check(request.secret, context)
        reply = jobs_pb2.CountersReply()
        for plane in self.manager.planes.values():
            try:
                values = plane.counters()
            except Exception as e:  # e.g. the switch is down: say so rather than show zeros
                context.abort(grpc.StatusCode.UNAVAILABLE, f"reading the {plane.name} counters failed: {e}")
            for c in values:
                reply.counters.add(
                    data_plane=c.data_plane,
                    scope=c.scope,
                    name=c.name,
                    index=c.index,
                    packets=c.packets,
                    bytes=c.bytes,
                )
        return reply


class Reaper:
    """Removes jobs whose workers stopped heartbeating; checks a few times per reap timeout."""

    def __init__(self, manager: JobManager) -> None:
        self.manager = manager
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="switchagg-reaper", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(max(0.05, self.manager.reap_timeout / 4)):
            for job_id in self.manager.reap():
                log.warning("job %d reaped: a worker stopped heartbeating", job_id)

    def start(self) -> Reaper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)


def make_server(
    manager: JobManager,
    secret: str,
    address: str,
    max_workers: int = 128,
    on_join: JoinObserver | None = None,
) -> tuple[grpc.Server, int]:
    """A started-ready server bound to ``address`` ("127.0.0.1:0" picks a port); returns it and the port.

    Every waiting Join holds a thread, so ``max_workers`` bounds the workers joining at once.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="jobservice"))
    jobs_pb2_grpc.add_JobServiceServicer_to_server(JobService(manager, secret, on_join), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return server, port
