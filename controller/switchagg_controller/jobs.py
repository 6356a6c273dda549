"""The job manager: joins, rank and slot assignment, installation, leave, teardown and reaping.

A job exists in two phases. *Pending*: workers are arriving; each Join waits. When the last of
the world_size workers arrives, the job gets an id, ranks, a slot range (P4 switch first, the
software aggregator as fallback), a fresh generation, is installed on its data plane, saved in
the store, and every waiting Join returns. *Active*: workers heartbeat; the job is removed when
all its workers left, on teardown, or when a worker has been silent for the reap timeout.

Who may act on a job: each worker gets a random member token at completion (the store keeps
only its hash); heartbeat and leave for (job, rank) must present that rank's token. What one
client (the address its calls come from, ``client`` of ``join``) may hold is bounded by
``Limits``: jobs, slots, and the joins waiting overall (docs/CONTROLLER.md, Who may do what).

asyncio, on the controller's one loop (the job service's, and the switches'): what runs between
two awaits needs no lock. The one lock, ``_changing``, keeps data plane changes (install, remove)
one at a time, because they await the switch: the job ids, counter indices and desired states
one change computes must not interleave with another's.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import ipaddress
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import grpc

from switchagg import protocol
from switchagg.aggregator import new_key
from switchagg.jobclient import Assignment, ShardAssignment  # what a worker gets: one definition for both
from switchagg_controller import allocation
from switchagg_controller.allocation import AllocationError, Placement, SlotAllocator
from switchagg_controller.model import Job, JobShard
from switchagg_controller.planes import DataPlane, DataPlaneError
from switchagg_controller.reducers import STRIPED, StripedDataPlane
from switchagg_controller.store import JobRecord, Store

MAX_JOB_ID = 0xFFFF


ENDED_KEPT = 1024  # reasons of ended jobs kept for late heartbeats


@dataclass(frozen=True)
class Limits:
    """Quotas; 0 = none. A client is the address a Join comes from (service.client_of): the join
    secret is shared by every worker, so only the network can tell clients apart."""

    jobs_per_client: int = 0  # jobs (pending or active) with a worker of the client
    slots_per_client: int = 0  # slots of those active jobs (a striped job: each shard's)
    pending_joins: int = 0  # Join calls waiting at once, all clients together


def token_hash(token: str) -> str:
    """What the store keeps of a member token. A plain SHA-256 suffices: the token is 256 random
    bits, nothing to guess, so a slow password hash would add nothing."""
    return hashlib.sha256(token.encode()).hexdigest()


class JobError(Exception):
    """A request the manager refuses; ``code`` is the gRPC status the service answers with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _job_k(plane_k: int, members: list[_Member]) -> int:
    """The job's K: the plane's, or less where a worker's route has a smaller MTU (never fragment)."""
    mtus = [m.mtu for m in members if m.mtu > 0]
    return min(plane_k, protocol.k_for_mtu(min(mtus))) if mtus else plane_k


@dataclass
class _Member:
    ip: str
    udp_port: int
    requested_rank: int | None
    shard_ports: tuple[int, ...] = ()  # a striped job: the worker's port per shard
    shard_ips: tuple[str, ...] = ()  # and its IP per shard, where it has one per rail (): ip
    client: str = ""  # where its Join came from (Limits)
    token: str = ""  # its member token, once the job is placed (for the Join reply only)
    mtu: int = 0  # the MTU of its route toward the service (0: unknown)


@dataclass
class _Pending:
    name: str
    world_size: int
    shards: int = 0  # > 0: striped across that many reducers
    members: list[_Member] = field(default_factory=list)
    job: Job | None = None  # set when complete and installed
    data_plane: str = ""
    error: JobError | None = None
    full: asyncio.Event = field(default_factory=asyncio.Event)  # all joined, or torn down
    settled: asyncio.Task[None] | None = None  # placing and installing it (not cancelled with a caller)


@dataclass
class _Active:
    record: JobRecord
    last_seen: dict[int, float]  # rank -> clock() of its last sign of life
    activity: int | None = None  # the job's data plane counters at the last reaper look


@dataclass(frozen=True)
class JobView:
    """A job as ListJobs shows it."""

    name: str
    state: str  # "pending" or "active"
    data_plane: str
    world_size: int
    job: Job | None  # None while pending
    joined: tuple[tuple[str, int], ...]
    left: frozenset[int]


class JobManager:
    def __init__(
        self,
        store: Store,
        data_planes: list[DataPlane],
        join_timeout: float = 60.0,
        reap_timeout: float = 30.0,
        max_counter_index: int = 64,
        clock: Callable[[], float] = time.monotonic,
        limits: Limits = Limits(),
    ) -> None:
        """``data_planes`` in order of preference; a job that does not fit on one goes to the next."""
        if not data_planes:
            raise ValueError("the job manager needs at least one data plane")
        self.store = store
        self.planes = {p.name: p for p in data_planes}
        self.order = [p.name for p in data_planes]
        self.allocator = SlotAllocator(
            p4_slots=protocol.P4_NUM_SLOTS if allocation.P4 in self.planes else None,
            sw_slots=allocation.SW_POOL_SLOTS if allocation.SOFTWARE in self.planes else None,
            pools={
                key: size
                for p in data_planes
                for key, size in p.pool_sizes().items()
                if key not in (allocation.P4, allocation.SOFTWARE)
            },
        )
        self.join_timeout, self.reap_timeout = join_timeout, reap_timeout
        self.max_counter_index = max_counter_index
        self.clock = clock
        self.limits = limits
        self._changing = asyncio.Lock()
        self._pending: dict[str, _Pending] = {}
        self._active: dict[int, _Active] = {}
        # Why recent jobs ended, by job id: a worker's heartbeat for one is answered with the reason
        # (torn down, reaped), so its error says what happened instead of a generic timeout; with
        # its members' token hashes, so only a member hears it.
        self._ended: collections.OrderedDict[int, tuple[str, dict[int, str]]] = collections.OrderedDict()

    # -- startup -----------------------------------------------------------------------------

    async def reload(self) -> list[Job]:
        """Loads the stored jobs and reinstalls each with a new generation (its data plane may be new)."""
        loaded: dict[str, list[Job]] = {name: [] for name in self.planes}
        for record in self.store.load():
            job = record.job
            if record.data_plane not in self.planes:
                raise JobError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"stored job {job.name!r} runs on the {record.data_plane} data plane, "
                    "which this controller does not serve",
                )
            plane = self.planes[record.data_plane]
            self.allocator.reserve(
                Placement(record.data_plane, job.slot_base, job.slot_count, self._pools(plane, job))
            )
            record.job = replace(job, generation=self.store.next_generation())
            self.store.save(record)
            now = self.clock()
            self._active[job.job_id] = _Active(record, {w.rank: now for w in job.workers})
            loaded[record.data_plane].append(record.job)
        for name, jobs in loaded.items():
            await self.planes[name].restore(jobs)
        return [j for jobs in loaded.values() for j in jobs]

    # -- join ---------------------------------------------------------------------------------

    async def join(
        self,
        name: str,
        world_size: int,
        ip: str,
        udp_port: int,
        rank: int | None = None,
        timeout: float | None = None,
        shards: int = 0,
        shard_ports: tuple[int, ...] = (),
        shard_ips: tuple[str, ...] = (),
        client: str = "",
        mtu: int = 0,
    ) -> Assignment:
        """Waits until the job is complete and installed. A caller cancelled while the others are
        still missing (the worker gave up) is dropped from the job. ``shards`` > 0: stripe the job
        across that many reducers, ``shard_ports`` this worker's port for each, ``shard_ips`` its
        address for each where it has one per rail (() : ``ip`` for all). ``client``: where the
        call came from, for the quotas (``Limits``). ``mtu``: the MTU of the worker's route (0:
        unknown); the job's K is the most one IP packet carries at its workers' smallest."""
        self._check_join(name, world_size, ip, udp_port, rank, timeout)
        self._check_shards(udp_port, shards, shard_ports)
        self._check_shard_ips(ip, shards, shard_ips)
        wait = self.join_timeout if not timeout else min(timeout, self.join_timeout)
        self._check_not_running(name, ip, udp_port)
        self._check_quotas(self._pending.get(name), world_size, client)
        pending = self._pending.setdefault(name, _Pending(name, world_size, shards))
        self._check_member(pending, world_size, ip, udp_port, rank)
        if shards != pending.shards:
            raise JobError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"job {name!r} is striped across {pending.shards} reducers, not {shards}",
            )
        member = _Member(ip, udp_port, rank, tuple(shard_ports), tuple(shard_ips), client, mtu=mtu)
        pending.members.append(member)
        if len(pending.members) == pending.world_size:
            del self._pending[name]
            pending.settled = asyncio.create_task(self._complete(pending), name=f"complete job {name}")
            pending.full.set()
        try:
            await asyncio.wait_for(pending.full.wait(), wait)
        except asyncio.CancelledError:  # the caller gave up
            if not pending.full.is_set():
                self._drop(pending, member)
            raise
        except asyncio.TimeoutError:
            if not pending.full.is_set():
                self._drop(pending, member)
                raise JobError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"job {name!r}: {len(pending.members) + 1} of {world_size} workers joined "
                    f"within {wait:g} s; the others never came",
                ) from None
        if pending.settled is not None:
            await asyncio.shield(pending.settled)  # a caller that gives up does not stop the install
        if pending.error is not None:
            raise pending.error
        assert pending.job is not None
        return self._assignment(pending.data_plane, pending.job, ip, udp_port, member.token)

    def _check_quotas(self, pending: _Pending | None, world_size: int, client: str) -> None:
        """Refuses a join that would take ``client`` past its job quota, or the service past its
        waiting joins (a waiting Join holds memory and a coroutine until its timeout). The join
        that completes a job waits for nobody: it frees waiting joins, so it is never refused so."""
        limits, exhausted = self.limits, grpc.StatusCode.RESOURCE_EXHAUSTED
        completes = (len(pending.members) if pending is not None else 0) + 1 >= world_size
        if limits.pending_joins and not completes:
            waiting = sum(len(p.members) for p in self._pending.values())
            if waiting >= limits.pending_joins:
                raise JobError(
                    exhausted,
                    f"{waiting} joins are waiting for their jobs, the most this controller allows "
                    "(--max-pending-joins); try again later",
                )
        if limits.jobs_per_client and (pending is None or all(m.client != client for m in pending.members)):
            held = len(self._of(client)) + sum(
                any(m.client == client for m in p.members) for p in self._pending.values()
            )
            if held >= limits.jobs_per_client:
                raise JobError(
                    exhausted,
                    f"client {client} has workers in {held} jobs, the most this controller allows per "
                    f"client (--max-jobs-per-client {limits.jobs_per_client})",
                )

    def _of(self, client: str) -> list[_Active]:
        """The active jobs with a worker of ``client``."""
        return [a for a in self._active.values() if client in a.record.clients.values()]

    def _check_slot_quota(self, pending: _Pending, slots: int) -> None:
        """Raises AllocationError (this data plane cannot take the job) when a client of the job
        would hold more than its slots with the job's ``slots`` added."""
        quota = self.limits.slots_per_client
        if not quota:
            return
        for client in sorted({m.client for m in pending.members}):
            held = sum(_slots_held(a.record.job) for a in self._of(client))
            if held + slots > quota:
                raise AllocationError(
                    f"client {client} would hold {held + slots} slots, more than the {quota} this "
                    "controller allows per client (--max-slots-per-client)"
                )

    def _check_not_running(self, name: str, ip: str, udp_port: int) -> None:
        """A Join for a job that already runs is refused, saying whether this worker is in it."""
        for active in self._active.values():
            job = active.record.job
            if job.name != name:
                continue
            for w in job.workers:
                if (w.ip, w.udp_port) == (ip, udp_port):
                    raise JobError(
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"{ip}:{udp_port} already joined job {name!r} as rank {w.rank}",
                    )
            raise JobError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"job {name!r} is already running with all {job.n} workers",
            )

    def _assignment(self, data_plane: str, done: Job, ip: str, udp_port: int, token: str) -> Assignment:
        """What the worker at ip:udp_port is told of its installed job (and of each shard), with
        its member ``token``."""
        my = next(w for w in done.workers if (w.ip, w.udp_port) == (ip, udp_port))
        agg_ip, agg_port = self.planes[data_plane].aggregator_of(done, my.rank)
        striped = self.striped
        mine = tuple(
            ShardAssignment(
                i, s.node, *striped.node_address(s.node), s.slot_base, s.slot_count, s.key, s.ports[my.rank]
            )
            for i, s in enumerate(done.shards)
            if striped is not None
        )
        return Assignment(
            data_plane, agg_ip, agg_port, done.job_id, my.rank, done.n, done.slot_base, done.slot_count,
            done.k, done.generation, done.key, mine, token,
        )  # fmt: skip

    @property
    def striped(self) -> StripedDataPlane | None:
        """The reducer pool's data plane, if this controller has one."""
        plane = self.planes.get(STRIPED)
        return plane if isinstance(plane, StripedDataPlane) else None

    def _pools(self, plane: DataPlane, job: Job) -> tuple[str, ...]:
        """The slot pools ``job``'s range was taken from (a striped job: its reducers')."""
        if job.shards and isinstance(plane, StripedDataPlane):
            return plane.job_pools(job)
        return plane.slot_pools(job.workers)

    def _check_shards(self, udp_port: int, shards: int, ports: tuple[int, ...]) -> None:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if shards == 0:
            if ports:
                raise JobError(bad, "shard_ports without shards")
            return
        if len(ports) != shards or ports[0] != udp_port:
            raise JobError(bad, f"a striped join names one port per shard ({shards}), the first its udp_port")
        if len(set(ports)) != shards or not all(1 <= p <= 65535 for p in ports):
            raise JobError(bad, f"shard ports must be distinct UDP ports, not {list(ports)}")
        pool = self.striped.size if self.striped is not None else 0
        if not 1 <= shards <= pool:
            raise JobError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a striped job takes 1..{pool} shards of this controller's reducer pool, not {shards}"
                if pool
                else "this controller has no reducer pool (switchagg-ctl serve --reducers FILE)",
            )

    @staticmethod
    def _check_shard_ips(ip: str, shards: int, ips: tuple[str, ...]) -> None:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not ips:
            return
        if len(ips) != shards or ips[0] != ip:
            raise JobError(bad, f"shard_ips names one address per shard ({shards}), the first the join's ip")
        for other in ips:
            _check_result_address(other, "shard address ")

    def _drop(self, pending: _Pending, member: _Member) -> None:
        pending.members.remove(member)
        if not pending.members and self._pending.get(pending.name) is pending:
            del self._pending[pending.name]

    @staticmethod
    def _check_join(
        name: str, world_size: int, ip: str, udp_port: int, rank: int | None, timeout: float | None
    ) -> None:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not name or len(name) > 200:
            raise JobError(bad, "the job name must be 1..200 characters")
        if not 1 <= world_size <= protocol.MAX_WORKERS:
            raise JobError(bad, f"world size must be 1..{protocol.MAX_WORKERS}, not {world_size}")
        _check_result_address(ip)
        if not 1 <= udp_port <= 65535:
            raise JobError(bad, f"UDP port must be 1..65535, not {udp_port}")
        if rank is not None and not 0 <= rank < world_size:
            raise JobError(bad, f"rank {rank} is outside 0..{world_size - 1} (-1 asks for any free rank)")
        # None or 0 (a JoinRequest without timeout_s): the server's join timeout.
        if timeout is not None and timeout != 0 and not 0 < timeout < math.inf:
            raise JobError(
                bad, f"the join timeout must be a positive finite number of seconds, not {timeout}"
            )

    @staticmethod
    def _check_member(pending: _Pending, world_size: int, ip: str, udp_port: int, rank: int | None) -> None:
        if world_size != pending.world_size:
            raise JobError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"job {pending.name!r} has world size {pending.world_size}, not {world_size}",
            )
        for m in pending.members:
            if (m.ip, m.udp_port) == (ip, udp_port):
                raise JobError(
                    grpc.StatusCode.ALREADY_EXISTS, f"{ip}:{udp_port} already joined job {pending.name!r}"
                )
            if rank is not None and m.requested_rank == rank:
                raise JobError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"rank {rank} of job {pending.name!r} is already taken by {m.ip}:{m.udp_port}",
                )

    async def _complete(self, pending: _Pending) -> None:
        """Assigns ranks and slots and installs; any failure is handed to every waiting worker."""
        try:
            async with self._changing:
                await self._place(pending)
        except DataPlaneError as e:
            pending.error = JobError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"job {pending.name!r}: {e}")
        except Exception as e:  # a bug or a broken store: every waiting worker hears it
            pending.error = JobError(grpc.StatusCode.INTERNAL, f"job {pending.name!r}: {e}")

    async def _place(self, pending: _Pending) -> None:
        taken = {m.requested_rank for m in pending.members if m.requested_rank is not None}
        free = iter(r for r in range(pending.world_size) if r not in taken)
        ranks = [m.requested_rank if m.requested_rank is not None else next(free) for m in pending.members]
        errors = []
        unavailable = False
        key = new_key()  # the job's for life: kept across reinstalls and controller restarts
        striped = pending.shards > 0
        for plane_name in self.order:
            plane = self.planes[plane_name]
            if striped != (plane_name == STRIPED):  # a striped job runs on the reducers, no other on them
                continue
            try:
                workers = tuple(
                    sorted(
                        (
                            plane.worker_addr(r, m.ip, m.udp_port)
                            for r, m in zip(ranks, pending.members, strict=True)
                        ),
                        key=lambda w: w.rank,
                    )
                )
                shards: tuple[JobShard, ...] = ()
                if isinstance(plane, StripedDataPlane):
                    nodes = plane.choose(pending.shards, self.allocator.free_slots)
                    self._check_slot_quota(pending, plane.shard_slots(pending.shards) * pending.shards)
                    placement = self.allocator.place_on_all(
                        plane_name,
                        tuple(dict.fromkeys(plane.node_pool(n) for n in nodes)),
                        plane.shard_slots(pending.shards),
                    )
                    by_rank = dict(zip(ranks, pending.members, strict=True))
                    ports = [by_rank[r].shard_ports for r in range(pending.world_size)]
                    ips = (
                        [
                            by_rank[r].shard_ips or (by_rank[r].ip,) * pending.shards
                            for r in range(pending.world_size)
                        ]
                        if any(m.shard_ips for m in pending.members)
                        else None
                    )
                    shards = plane.shards_of(
                        nodes, placement.slot_base, placement.slot_count, key, ports, ips
                    )
                else:
                    self._check_slot_quota(pending, plane.default_slots)
                    placement = self.allocator.place_on_all(
                        plane_name, plane.slot_pools(workers), plane.default_slots
                    )
            except (AllocationError, DataPlaneError) as e:
                errors.append(str(e))
                continue
            job = Job(
                job_id=self._free_job_id(),
                name=pending.name,
                n=pending.world_size,
                slot_base=placement.slot_base,
                slot_count=placement.slot_count,
                k=_job_k(plane.k, pending.members),
                generation=self.store.next_generation(),
                workers=workers,
                counter_index=self._free_counter_index(plane_name),
                key=key,
                shards=shards,
            )
            try:
                await plane.install(job)
            except DataPlaneError as e:
                self.allocator.release(placement)
                errors.append(str(e))
                unavailable = unavailable or e.unavailable
                continue
            self._activate(pending, job, plane_name)
            return
        code = grpc.StatusCode.UNAVAILABLE if unavailable else grpc.StatusCode.RESOURCE_EXHAUSTED
        pending.error = JobError(code, f"job {pending.name!r} cannot be placed: " + "; ".join(errors))

    def _activate(self, pending: _Pending, job: Job, plane_name: str) -> None:
        """An installed job: each member's token drawn (only its hash kept), saved, and active."""
        for m in pending.members:
            m.token = secrets.token_urlsafe(32)
        by_address = {(w.ip, w.udp_port): w.rank for w in job.workers}
        ranked = [(by_address[m.ip, m.udp_port], m) for m in pending.members]
        record = JobRecord(
            job,
            plane_name,
            tokens={r: token_hash(m.token) for r, m in ranked},
            clients={r: m.client for r, m in ranked},
        )
        self.store.save(record)
        now = self.clock()
        self._active[job.job_id] = _Active(record, {w.rank: now for w in job.workers})
        pending.job, pending.data_plane = job, plane_name

    def _free_job_id(self) -> int:
        used = set(self._active)
        return next(i for i in range(1, MAX_JOB_ID + 1) if i not in used)

    def _counted(self, plane_name: str) -> bool:
        """Whether jobs on ``plane_name`` take a P4 counter index: the P4 switches' jobs, and the
        striped ones where the pool has rails (a rail's shard counts at the job's index)."""
        striped = self.striped
        return plane_name == allocation.P4 or (
            plane_name == STRIPED and striped is not None and striped.has_rails
        )

    def _free_counter_index(self, plane_name: str) -> int:
        if not self._counted(plane_name):
            return 0  # only the P4 switch has per-job counter arrays
        used = {
            a.record.job.counter_index for a in self._active.values() if self._counted(a.record.data_plane)
        }
        for i in range(self.max_counter_index):
            if i not in used:
                return i
        raise DataPlaneError(f"all {self.max_counter_index} job counter indices are in use")

    # -- running jobs ------------------------------------------------------------------------

    def _member(self, job_id: int, rank: int, token: str) -> _Active:
        """The active job of which ``token`` is rank ``rank``'s member token; else NOT_FOUND (with
        why it ended, to its members only) or PERMISSION_DENIED."""
        active = self._active.get(job_id)
        if active is None:
            reason, tokens = self._ended.get(job_id, ("", {}))
            if reason and _is_token(token, tokens.get(rank)):
                raise JobError(grpc.StatusCode.NOT_FOUND, reason)
            if reason:
                raise _not_member(job_id, rank)
            raise JobError(grpc.StatusCode.NOT_FOUND, f"no job {job_id} (torn down, reaped or never created)")
        if rank not in active.last_seen:
            raise JobError(grpc.StatusCode.NOT_FOUND, f"job {job_id} has no rank {rank}")
        if not _is_token(token, active.record.tokens.get(rank)):
            raise _not_member(job_id, rank)
        return active

    def heartbeat(self, job_id: int, rank: int, token: str) -> int:
        """Rank ``rank`` of job ``job_id`` is alive; ``token`` is its member token."""
        active = self._member(job_id, rank, token)
        if rank in active.record.left:
            raise JobError(grpc.StatusCode.FAILED_PRECONDITION, f"rank {rank} already left job {job_id}")
        active.last_seen[rank] = self.clock()
        return active.record.job.generation

    async def leave(self, job_id: int, rank: int, token: str) -> bool:
        """Marks a rank as gone (``token``: its member token); the job is removed once all ranks
        left (the others may still need a resent result, so the first to leave cannot free the
        slots)."""
        active = self._member(job_id, rank, token)
        active.record.left.add(rank)
        if len(active.record.left) < active.record.job.n:
            self.store.mark_left(job_id, rank)
            return False
        async with self._changing:
            if self._active.get(job_id) is active:  # not removed while we waited
                await self._remove(active, "every rank left it")
        return True

    async def teardown(self, job: str) -> int:
        async with self._changing:  # a job being installed is torn down once it is
            for active in list(self._active.values()):
                if active.record.job.name == job or str(active.record.job.job_id) == job:
                    await self._remove(active, "an operator tore it down (switchagg-ctl teardown)")
                    return active.record.job.job_id
            pending = self._pending.pop(job, None)
            if pending is not None:
                pending.error = JobError(grpc.StatusCode.ABORTED, f"job {job!r} was torn down while joining")
                pending.full.set()
                return 0
        raise JobError(grpc.StatusCode.NOT_FOUND, f"no job named or numbered {job!r}")

    async def _remove(self, active: _Active, reason: str) -> None:
        """Under ``_changing``. ``reason`` is what a heartbeat for the job is told from now on."""
        job = active.record.job
        del self._active[job.job_id]
        self._ended[job.job_id] = (f"job {job.job_id} ({job.name!r}) ended: {reason}", active.record.tokens)
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        self.store.delete(job.job_id)
        plane = self.planes[active.record.data_plane]
        await plane.remove(job)
        self.allocator.release(
            Placement(active.record.data_plane, job.slot_base, job.slot_count, self._pools(plane, job))
        )

    async def reap(self) -> list[int]:
        """Removes jobs with a worker silent for longer than the reap timeout; returns their ids.

        Aggregation traffic counts as a sign of life too: a job whose data plane counters moved
        since the last look is kept, so workers that never heartbeat are not reaped mid-training.
        """
        now = self.clock()
        candidates = [
            (job_id, a.record)
            for job_id, a in self._active.items()
            if any(
                r not in a.record.left and now - seen > self.reap_timeout for r, seen in a.last_seen.items()
            )
        ]
        if not candidates:
            return []
        seen_activity = await asyncio.gather(*(self._activity(record) for _, record in candidates))
        reaped = []
        async with self._changing:
            for (job_id, record), activity in zip(candidates, seen_activity, strict=True):
                active = self._active.get(job_id)
                if active is None or active.record is not record:
                    continue
                baseline, active.activity = active.activity, activity
                if activity is None or baseline is None:
                    # Unknown (data plane unreadable, e.g. the switch restarting) or a first look:
                    # keep the job until a later look can tell whether its traffic moved.
                    continue
                if activity != baseline:
                    active.last_seen = dict.fromkeys(active.last_seen, self.clock())
                    continue
                silent = sorted(
                    r
                    for r, seen in active.last_seen.items()
                    if r not in record.left and now - seen > self.reap_timeout
                )
                await self._remove(
                    active,
                    f"the controller reaped it: rank(s) {silent} sent no heartbeat and the job no "
                    f"traffic for {self.reap_timeout:g} s",
                )
                reaped.append(job_id)
        return reaped

    async def _activity(self, record: JobRecord) -> int | None:
        """A number that changes when the job's packets are aggregated (None: unknown)."""
        try:
            reading = await self.planes[record.data_plane].counters()
        except Exception:  # unreadable right now: no evidence either way
            return None
        mine = [c.packets for c in reading.values if c.scope == "job" and c.index == record.job.job_id]
        if not mine and reading.unavailable:  # its switch did not answer
            return None
        return sum(mine)

    def bump_generations(
        self, plane_name: str, select: Callable[[Job], bool] = lambda job: True
    ) -> list[Job]:
        """New generations for the (selected) jobs on a data plane (it, or one of its switches,
        restarted: their slot state is gone)."""
        jobs = []
        for active in self._active.values():
            if active.record.data_plane == plane_name and select(active.record.job):
                active.record.job = replace(active.record.job, generation=self.store.next_generation())
                self.store.save(active.record)
                jobs.append(active.record.job)
        return jobs

    def jobs(self, plane_name: str | None = None) -> list[Job]:
        return [
            a.record.job
            for a in self._active.values()
            if plane_name is None or a.record.data_plane == plane_name
        ]

    def list(self) -> list[JobView]:
        views = [
            JobView(
                a.record.job.name,
                "active",
                a.record.data_plane,
                a.record.job.n,
                a.record.job,
                tuple((w.ip, w.udp_port) for w in a.record.job.workers),
                frozenset(a.record.left),
            )
            for a in sorted(self._active.values(), key=lambda a: a.record.job.job_id)
        ]
        views += [
            JobView(
                p.name,
                "pending",
                "",
                p.world_size,
                None,
                tuple((m.ip, m.udp_port) for m in p.members),
                frozenset(),
            )
            for p in self._pending.values()
        ]
        return views


def _slots_held(job: Job) -> int:
    """The slots a job takes: its range, on each shard of a striped job."""
    return job.slot_count * max(1, len(job.shards))


def _is_token(token: str, want: str | None) -> bool:
    """Whether ``token`` is the member token whose hash is ``want``. A member stored without a
    hash ('') joined under a controller before member tokens: its job runs on with the join
    secret alone, as its workers (told no token) expect."""
    if want is None:
        return False
    return want == "" or hmac.compare_digest(token_hash(token), want)


def _not_member(job_id: int, rank: int) -> JobError:
    return JobError(
        grpc.StatusCode.PERMISSION_DENIED,
        f"not rank {rank}'s member token of job {job_id}: a worker may heartbeat and leave only its "
        "own place in its own job, with the token its Join returned",
    )


def _check_result_address(ip: str, what: str = "") -> None:
    """A worker's address as a join names it: an IPv4 address that can receive unicast results."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    try:
        addr = ipaddress.IPv4Address(ip)
    except ValueError:
        raise JobError(bad, f"{what}{ip!r} is not an IPv4 address") from None
    if addr.is_unspecified or addr.is_multicast or ip == "255.255.255.255":
        raise JobError(bad, f"{ip} cannot receive results: join with the worker's own address")
