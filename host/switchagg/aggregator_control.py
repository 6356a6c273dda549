"""The software aggregator's control service (proto/switchagg/aggregator.proto), and its client.

A controller installs jobs on a ``switchagg-aggregator`` that runs elsewhere (a leaf in another
rack, a spine) through this service, as it installs them on a P4 switch over P4Runtime:

    switchagg-aggregator --host 10.0.1.254 --control 10.0.0.1:50061 --control-secret-file s

``RemoteAggregator`` has the methods of ``SoftwareAggregator`` that a controller's data plane
calls (address, add_job, remove_job, jobs, counters), so either serves the same data plane.
Every request carries the secret: without it nobody can install a job, and so nobody can name the
addresses whose packets a sum accepts (docs/PROTOCOL.md, Security).
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import NoReturn

import grpc

from switchagg._proto import aggregator_pb2 as pb
from switchagg._proto import aggregator_pb2_grpc as pb_grpc
from switchagg.aggregator import POOL_SLOTS, Counters, InstalledJob, SoftwareAggregator
from switchagg.keys import UNKEYED, warn_unkeyed

Address = tuple[str, int]
DEFAULT_TIMEOUT_S = 5.0


class ControlError(Exception):
    """A control call failed; ``code`` is the gRPC status (UNAVAILABLE: the aggregator is gone)."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _JobSpec:
    """Everything add_job got, so a failed replacement can put the old job back."""

    job_id: int
    n: int
    slot_base: int
    slot_count: int
    k: int
    generation: int
    addrs: tuple[Address | None, ...]
    name: str
    upstream: Address | None
    leaf_index: int
    key: int
    loss_notices: bool

    def install(self, agg: SoftwareAggregator) -> None:
        agg.add_job(
            self.job_id, self.n, self.slot_base, self.slot_count, self.k, self.generation, self.addrs,
            name=self.name, upstream=self.upstream, leaf_index=self.leaf_index, key=self.key,
            loss_notices=self.loss_notices,
        )  # fmt: skip


class AggregatorControl(pb_grpc.AggregatorControlServicer):
    """Serves one SoftwareAggregator. Calls are serialised: a replace is remove + add, atomic."""

    def __init__(self, agg: SoftwareAggregator, secret: str) -> None:
        if not secret:
            raise ValueError("the aggregator's control service needs a non-empty secret")
        self._agg, self._secret = agg, secret.encode()
        self.boot_id = secrets.token_hex(8)
        self._specs: dict[int, _JobSpec] = {}
        self._lock = threading.Lock()

    def _check(self, secret: str, context: grpc.ServicerContext) -> None:
        if not hmac.compare_digest(secret.encode(), self._secret):
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, "wrong secret for this aggregator")

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoReply:
        self._check(request.secret, context)
        ip, port = self._agg.address
        return pb.InfoReply(boot_id=self.boot_id, ip=ip, udp_port=port, pool_slots=POOL_SLOTS)

    def AddJob(self, request: pb.AddJobRequest, context: grpc.ServicerContext) -> pb.AddJobReply:
        self._check(request.secret, context)
        upstream = (request.upstream_ip, request.upstream_port) if request.upstream_ip else None
        spec = _JobSpec(
            request.job_id, request.world_size, request.slot_base, request.slot_count, request.k,
            request.generation, tuple((r.ip, r.udp_port) if r.present else None for r in request.ranks),
            request.name, upstream, request.leaf_index, request.key, not request.no_loss_notices,
        )  # fmt: skip
        with self._lock:
            replaced = spec.job_id in self._agg.jobs()
            if replaced:
                self._agg.remove_job(spec.job_id)
            try:
                spec.install(self._agg)
            except (ValueError, TypeError, OverflowError) as e:
                old = self._specs.get(spec.job_id)
                if replaced and old is not None:
                    old.install(self._agg)  # a refused replacement leaves the old job serving
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"job {spec.job_id}: {e}")
            self._specs[spec.job_id] = spec
        return pb.AddJobReply(replaced=replaced)

    def RemoveJob(self, request: pb.RemoveJobRequest, context: grpc.ServicerContext) -> pb.RemoveJobReply:
        self._check(request.secret, context)
        with self._lock:
            self._specs.pop(request.job_id, None)
            if request.job_id not in self._agg.jobs():
                return pb.RemoveJobReply(removed=False)
            self._agg.remove_job(request.job_id)
        return pb.RemoveJobReply(removed=True)

    def ListJobs(self, request: pb.AggListJobsRequest, context: grpc.ServicerContext) -> pb.AggListJobsReply:
        self._check(request.secret, context)
        return pb.AggListJobsReply(
            jobs=[
                pb.InstalledJobInfo(
                    job_id=j,
                    world_size=i.n,
                    slot_base=i.slot_base,
                    slot_count=i.slot_count,
                    k=i.k,
                    name=i.name,
                    key=i.key,
                )
                for j, i in sorted(self._agg.jobs().items())
            ]
        )

    def Counters(self, request: pb.AggCountersRequest, context: grpc.ServicerContext) -> pb.AggCountersReply:
        self._check(request.secret, context)
        return pb.AggCountersReply(counters_json=json.dumps(self._agg.counters()))


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("context.abort() returned")  # it raises; this tells the type checker


def serve_control(agg: SoftwareAggregator, listen: str, secret: str) -> tuple[grpc.Server, int, str]:
    """Serves ``agg``'s control on ``listen`` (``host:port``, port 0 picks one, or ``unix:PATH``).
    Returns the started server, the bound TCP port (0 for a Unix socket) and the boot id."""
    control = AggregatorControl(agg, secret)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_AggregatorControlServicer_to_server(control, server)
    port = server.add_insecure_port(listen)
    if port == 0 and not listen.startswith("unix:"):
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return server, (0 if listen.startswith("unix:") else port), control.boot_id


class RemoteAggregator:
    """A ``switchagg-aggregator`` reached through its control service. Blocking calls, each
    bounded by ``timeout``; a failure raises ControlError with the gRPC status."""

    def __init__(
        self, target: str, secret: str, timeout: float = DEFAULT_TIMEOUT_S, address: Address | None = None
    ) -> None:
        """``address``: where it takes packets, if known (else asked by Info on first use)."""
        self.target, self._secret, self.timeout = target, secret, timeout
        # A controller should see a restarted aggregator within seconds, not grpc's default
        # backoff of up to two minutes.
        self._channel = grpc.insecure_channel(
            target,
            options=[("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)],
        )
        self._stub = pb_grpc.AggregatorControlStub(self._channel)
        self._address = address

    def _call(self, method: str, request: object) -> object:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
            detail = e.details() if isinstance(e, grpc.Call) else str(e)
            raise ControlError(f"aggregator {self.target}: {method}: {detail}", code) from e

    def info(self) -> pb.InfoReply:
        reply = self._call("Info", pb.InfoRequest(secret=self._secret))
        assert isinstance(reply, pb.InfoReply)
        if self._address is None:
            self._address = (reply.ip, reply.udp_port)
        return reply

    @property
    def address(self) -> Address:
        """Where the aggregator takes packets (given, or asked once and remembered)."""
        if self._address is None:
            self.info()
        assert self._address is not None
        return self._address

    def add_job(
        self,
        job_id: int,
        n: int,
        slot_base: int,
        slot_count: int,
        k: int,
        generation: int,
        addrs: Sequence[Address | None],
        *,
        name: str = "",
        upstream: Address | None = None,
        leaf_index: int = 0,
        key: int | None = None,
        loss_notices: bool = True,
    ) -> bool:
        """As SoftwareAggregator.add_job, except that an installed job id is replaced (the
        controller's reinstall with a new generation); True if it was. ``key`` is required: the
        caller hands it to the workers (UNKEYED, with a warning, for none)."""
        if key is None:
            raise ValueError(
                f"job {job_id}: a job installed through the control service needs key= (the result key "
                "its workers are given; switchagg.UNKEYED for none)"
            )
        if key == UNKEYED:
            warn_unkeyed(f"job {job_id}")
        ranks = [
            pb.RankAddress(present=False)
            if a is None
            else pb.RankAddress(present=True, ip=a[0], udp_port=a[1])
            for a in addrs  # None: a rank behind another leaf
        ]
        request = pb.AddJobRequest(
            secret=self._secret, job_id=job_id, world_size=n, slot_base=slot_base, slot_count=slot_count, k=k,
            generation=generation, ranks=ranks, name=name, leaf_index=leaf_index, key=key,
            upstream_ip=upstream[0] if upstream else "", upstream_port=upstream[1] if upstream else 0,
            no_loss_notices=not loss_notices,
        )  # fmt: skip
        reply = self._call("AddJob", request)
        assert isinstance(reply, pb.AddJobReply)
        return reply.replaced

    def remove_job(self, job_id: int) -> bool:
        """Idempotent; True if the job was installed."""
        reply = self._call("RemoveJob", pb.RemoveJobRequest(secret=self._secret, job_id=job_id))
        assert isinstance(reply, pb.RemoveJobReply)
        return reply.removed

    def jobs(self) -> dict[int, InstalledJob]:
        reply = self._call("ListJobs", pb.AggListJobsRequest(secret=self._secret))
        assert isinstance(reply, pb.AggListJobsReply)
        return {
            j.job_id: InstalledJob(j.world_size, j.slot_base, j.slot_count, j.k, j.name, j.key)
            for j in reply.jobs
        }

    def counters(self) -> Counters:
        reply = self._call("Counters", pb.AggCountersRequest(secret=self._secret))
        assert isinstance(reply, pb.AggCountersReply)
        result: Counters = json.loads(reply.counters_json)
        result["jobs"] = {int(j): c for j, c in result.get("jobs", {}).items()}  # JSON keys are strings
        return result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RemoteAggregator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
