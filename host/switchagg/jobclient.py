"""The worker side of the controller's job service: join a job, heartbeat, leave.

a = join("127.0.0.1:50051", secret, "resnet", world_size=4, ip="10.0.0.1", udp_port=40001)
membership = Membership("127.0.0.1:50051", secret, a).start()   # heartbeats from a thread
...  # Session(a.job_id, a.rank, ...) and allreduce
membership.end()                                                  # stops them and leaves

Session.from_job_service does all of this for the session's lifetime. The join secret only joins;
heartbeats and the leave also carry the member token the Join returned (``Assignment.token``), so
a worker acts for its own place in its own job only (docs/CONTROLLER.md, Who may do what).
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from switchagg._proto import jobs_pb2, jobs_pb2_grpc


class JobServiceError(Exception):
    """The job service refused a request or could not be reached; ``code`` is the gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ShardAssignment:
    """One shard of a striped job as this worker sees it (docs/PROTOCOL.md, Striping)."""

    index: int
    node: str
    aggregator_ip: str
    aggregator_port: int
    slot_base: int
    slot_count: int
    key: int
    udp_port: int  # this worker's port the shard pins


@dataclass(frozen=True)
class Assignment:
    """What the controller told this worker: where to aggregate and with which parameters."""

    data_plane: str  # "p4" or "software"
    aggregator_ip: str
    aggregator_port: int
    job_id: int
    rank: int
    world_size: int
    slot_base: int
    slot_count: int
    k: int
    generation: int
    key: int = 0  # the job's result key: its aggregator's RESULTs carry it (Session(key=...))
    shards: tuple[ShardAssignment, ...] = ()  # a striped job's shards (the fields above: shard 0's)
    # This worker's credential for its place in the job: heartbeat() and leave() present it (the
    # join secret alone cannot heartbeat or leave a job). Kept out of repr, which logs may show.
    token: str = field(default="", repr=False)


def _call(service: str, what: str, method: str, request: object, timeout: float) -> object:
    try:
        with grpc.insecure_channel(service) as channel:
            stub = jobs_pb2_grpc.JobServiceStub(channel)
            return getattr(stub, method)(request, timeout=timeout)
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.Call) else None
        details = e.details() if isinstance(e, grpc.Call) else str(e)
        if code == grpc.StatusCode.UNAVAILABLE:
            details = f"job service {service} is unreachable ({details})"
        raise JobServiceError(f"{what}: {details}", code) from None


def join(
    service: str,
    secret: str,
    job_name: str,
    world_size: int,
    ip: str,
    udp_port: int,
    rank: int | None = None,
    timeout: float = 60.0,
    shard_ports: tuple[int, ...] = (),
    shard_ips: tuple[str, ...] = (),
    mtu: int = 0,
) -> Assignment:
    """Joins ``job_name``; blocks until all ``world_size`` workers joined or ``timeout`` passed.

    ``rank``: None for any free rank, else 0..world_size-1; ``timeout``: positive seconds
    (ValueError otherwise; the service checks everything else and answers INVALID_ARGUMENT).
    ``shard_ports``: to join a job striped across ``len(shard_ports)`` reducers, this worker's
    UDP port for each shard (the first is ``udp_port``); () for a job that is not striped.
    ``shard_ips``: a worker with one interface per rail, its address on each (the first is ``ip``);
    (): ``ip`` for every shard. ``mtu``: the MTU of this worker's route toward the service (0:
    unknown); the job's K fits the smallest its workers report."""
    if rank is not None and not 0 <= rank < max(world_size, 1):
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1} (None asks for any free rank)")
    if not 0 < timeout < math.inf:
        raise ValueError(f"the join timeout must be a positive finite number of seconds, not {timeout}")
    request = jobs_pb2.JoinRequest(
        secret=secret,
        job_name=job_name,
        world_size=world_size,
        ip=ip,
        udp_port=udp_port,
        rank=-1 if rank is None else rank,
        timeout_s=timeout,
        shards=len(shard_ports),
        shard_ports=list(shard_ports),
        shard_ips=list(shard_ips),
        mtu=mtu,
    )
    # The server enforces the join timeout and answers with a clear error; the RPC deadline
    # only has to outlast it.
    r = _call(service, f"join {job_name!r}", "Join", request, timeout + 10.0)
    assert isinstance(r, jobs_pb2.JoinReply)
    return Assignment(
        r.data_plane,
        r.aggregator_ip,
        r.aggregator_port,
        r.job_id,
        r.rank,
        r.world_size,
        r.slot_base,
        r.slot_count,
        r.k,
        r.generation,
        r.result_key,
        tuple(_shard(s) for s in r.shards),
        r.member_token,
    )


def _shard(s: jobs_pb2.ShardAssignment) -> ShardAssignment:
    return ShardAssignment(
        s.index,
        s.node,
        s.aggregator_ip,
        s.aggregator_port,
        s.slot_base,
        s.slot_count,
        s.result_key,
        s.udp_port,
    )


def describe(service: str, secret: str, timeout: float = 10.0) -> int:
    """The size of the service's reducer pool: how many shards a striped job gets by default (0:
    none; also from a controller older than the Describe call)."""
    request = jobs_pb2.DescribeRequest(secret=secret)
    try:
        r = _call(service, "describe the job service", "Describe", request, timeout)
    except JobServiceError as e:
        if e.code == grpc.StatusCode.UNIMPLEMENTED:
            return 0
        raise
    assert isinstance(r, jobs_pb2.DescribeReply)
    return int(r.reducers)


def leave(service: str, secret: str, assignment: Assignment, timeout: float = 10.0) -> bool:
    """Leaves the job (with ``assignment.token``); True when this was the last worker and the
    job's slots were freed."""
    request = jobs_pb2.LeaveRequest(
        secret=secret, job_id=assignment.job_id, rank=assignment.rank, member_token=assignment.token
    )
    r = _call(service, f"leave job {assignment.job_id}", "Leave", request, timeout)
    assert isinstance(r, jobs_pb2.LeaveReply)
    return r.job_removed


def heartbeat(service: str, secret: str, assignment: Assignment, timeout: float = 10.0) -> int:
    """Tells the service this worker is alive (with ``assignment.token``); returns the job's
    current generation."""
    request = jobs_pb2.HeartbeatRequest(
        secret=secret, job_id=assignment.job_id, rank=assignment.rank, member_token=assignment.token
    )
    r = _call(service, f"heartbeat job {assignment.job_id}", "Heartbeat", request, timeout)
    assert isinstance(r, jobs_pb2.HeartbeatReply)
    return r.generation


# Answers that may change if asked again: the service is away or restarting (a restarted
# controller reloads its jobs and answers again), overloaded, or the call broke on the way.
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)


def is_transient(error: JobServiceError) -> bool:
    """Whether asking again may succeed (see TRANSIENT_CODES); NOT_FOUND (the job was torn
    down or reaped), UNAUTHENTICATED, PERMISSION_DENIED, FAILED_PRECONDITION etc. are final."""
    return error.code is None or error.code in TRANSIENT_CODES


class Heartbeat:
    """Heartbeats every ``interval`` seconds from a daemon thread while the job runs.

    A heartbeat that fails transiently (the service is away or restarting: UNAVAILABLE,
    DEADLINE_EXCEEDED, see ``is_transient``) is retried with exponential backoff, from
    ``min(interval, 0.1)`` s doubling up to ``min(interval, 5)`` s (with jitter), until it
    succeeds or the heartbeat stops: a controller restart does not get the job reaped later. The
    last such failure is in ``retrying`` (None once a heartbeat succeeded again), their number in
    ``failures``. A definitive answer (NOT_FOUND: the job was torn down or reaped;
    UNAUTHENTICATED, PERMISSION_DENIED, ...) is kept in ``error`` and stops the thread, since
    the job's slots may already belong to someone else; ``on_error(error)`` is then called (from
    the heartbeat thread) so that the call in progress can end with the reason at once (a
    teardown, a reap) instead of waiting for its timeout.
    """

    def __init__(
        self,
        service: str,
        secret: str,
        assignment: Assignment,
        interval: float = 2.0,
        on_error: Callable[[JobServiceError], None] | None = None,
    ) -> None:
        if not interval > 0 or math.isinf(interval):
            raise ValueError(f"the heartbeat interval must be positive and finite, not {interval}")
        self.service, self.secret, self.assignment, self.interval = service, secret, assignment, interval
        self.error: JobServiceError | None = None
        self.on_error = on_error
        self.retrying: JobServiceError | None = None
        self.failures = 0
        self.generation = assignment.generation
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="switchagg-heartbeat", daemon=True)

    def _run(self) -> None:
        backoff_cap = min(self.interval, 5.0)
        delay = self.interval
        retries = 0
        while not self._stop.wait(delay):
            try:
                self.generation = heartbeat(self.service, self.secret, self.assignment)
            except JobServiceError as e:
                if not is_transient(e):
                    self.error = e
                    if self.on_error is not None:
                        self.on_error(e)
                    return
                self.retrying, self.failures = e, self.failures + 1
                backoff = min(backoff_cap, min(self.interval, 0.1) * 2.0**retries)
                delay = random.uniform(backoff / 2, backoff)  # workers of one job do not retry in step
                retries = min(retries + 1, 32)  # 2**32 times the first delay is past any cap
                continue
            self.retrying, delay, retries = None, self.interval, 0

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.interval + 15.0)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class Membership:
    """A worker's place in a job: heartbeats while it lasts, leaves the job at end()."""

    def __init__(
        self,
        service: str,
        secret: str,
        assignment: Assignment,
        interval: float = 2.0,
        on_error: Callable[[JobServiceError], None] | None = None,
    ) -> None:
        self.service, self.secret, self.assignment = service, secret, assignment
        self.heartbeat = Heartbeat(service, secret, assignment, interval, on_error)

    def start(self) -> Membership:
        self.heartbeat.start()
        return self

    def end(self) -> None:
        self.heartbeat.stop()
        try:
            leave(self.service, self.secret, self.assignment)
        except JobServiceError:
            pass  # the job is gone already (torn down, reaped, service restarted): nothing to leave
