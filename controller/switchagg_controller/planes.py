"""The places a job can run: the P4 switches and the software aggregator.

The job manager only calls install/remove; how a job reaches the data plane (P4Runtime writes
of the whole desired state, or add_job on the C aggregator) is hidden here. Everything runs on
the controller's event loop: the software aggregator's C calls (add_job, remove_job, counters)
take about 0.1 ms and are called directly; the P4 switches are awaited.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc

from switchagg import protocol
from switchagg_controller import allocation
from switchagg_controller.model import HostPort, Job, SoftwareSpine, SwitchState, Topology, WorkerAddr

if TYPE_CHECKING:
    from switchagg.aggregator import AggregatorHandle, Counters
    from switchagg_controller.supervisor import SwitchSupervisor

_T = TypeVar("_T")
_AWAY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # a remote aggregator away
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CounterValue:
    data_plane: str
    scope: str  # "drops", "job" or "total"
    name: str
    index: int  # job id for scope "job"
    packets: int
    bytes: int = 0


@dataclass
class CounterReading:
    """A data plane's counters; ``unavailable``: the parts (data plane labels, e.g. "p4:s1") that
    could not be read, each with the reason (a switch that is away)."""

    values: list[CounterValue] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)


class DataPlaneError(Exception):
    """A job cannot be placed on or installed on this data plane; the message says why.

    ``unavailable``: the data plane is away right now (a retry later may succeed)."""

    def __init__(self, message: str, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


class DataPlane(Protocol):
    name: str  # allocation.P4 or allocation.SOFTWARE
    k: int
    default_slots: int

    @property
    def aggregator(self) -> tuple[str, int]: ...

    def aggregator_of(self, job: Job, rank: int) -> tuple[str, int]:
        """Where rank ``rank`` of ``job`` sends its packets."""
        ...

    def pool_sizes(self) -> dict[str, int]:
        """The slot pools this data plane needs in the allocator (key -> slots)."""
        ...

    def slot_pools(self, workers: tuple[WorkerAddr, ...]) -> tuple[str, ...]:
        """The pools a job of these workers takes its one slot range from (on all of them)."""
        ...

    def worker_addr(self, rank: int, ip: str, udp_port: int) -> WorkerAddr: ...

    async def install(self, job: Job) -> None: ...

    async def remove(self, job: Job) -> None: ...

    async def restore(self, jobs: list[Job]) -> None:
        """Installs reloaded jobs; where the data plane is not reachable yet it applies them later."""
        ...

    async def counters(self) -> CounterReading: ...


def job_counters(plane: str, c: Counters) -> list[CounterValue]:
    """A software aggregator's per-job counters; a leaf job's include protocol.LEAF_COUNTERS."""
    out = []
    for job_id in sorted(c["jobs"]):
        row = c["jobs"][job_id]
        names = protocol.JOB_COUNTERS + (protocol.LEAF_COUNTERS if protocol.LEAF_COUNTERS[0] in row else ())
        out += [CounterValue(plane, "job", name, int(job_id), int(row[name])) for name in names]
    return out


def _install_failed(what: str, e: BaseException) -> DataPlaneError:
    """The error of an install that failed on a switch: unavailable if the switch was away."""
    from switchagg_controller.supervisor import SwitchUnavailable

    unavailable = isinstance(e, SwitchUnavailable | asyncio.TimeoutError)
    return DataPlaneError(f"installing {what} failed: {e}", unavailable)


def read_node(reading: CounterReading, plane: str, agg: AggregatorHandle) -> None:
    """One software node's counters (totals, drops, jobs) into ``reading``, labelled ``plane``; a
    node that does not answer (a remote one that is away) is named in ``unavailable`` instead."""
    try:
        c = agg.counters()
    except Exception as e:  # the others still answer
        reading.unavailable[plane] = str(e) or type(e).__name__
        return
    reading.values += [CounterValue(plane, "total", n, 0, int(c[n])) for n in ("rx", "tx")]
    reading.values += [CounterValue(plane, "drops", n, 0, int(c["drops"][n])) for n in protocol.DROP_REASONS]
    reading.values += job_counters(plane, c)


def reconcile_jobs(
    agg: AggregatorHandle, want: dict[int, Job], add: Callable[[Job], None]
) -> tuple[int, int]:
    """Makes ``agg`` hold exactly the jobs of ``want`` (by id): those it holds that are not wanted,
    or with other slots, K or result key (another job that had the id), are removed; the missing
    ones are added with ``add`` (each as its role there). For a remote aggregator that restarted
    (it came back empty) or was unreachable for a while (it may hold jobs removed meanwhile).
    Returns (installed, removed)."""
    have = agg.jobs()
    stale = [
        job_id
        for job_id, info in have.items()
        if job_id not in want
        or (info.slot_base, info.slot_count, info.k, info.key)
        != (want[job_id].slot_base, want[job_id].slot_count, want[job_id].k, want[job_id].key)
    ]
    for job_id in stale:
        agg.remove_job(job_id)
    missing = [job for job_id, job in want.items() if job_id not in have or job_id in stale]
    for job in missing:
        add(job)
    return len(missing), len(stale)


class SoftwareDataPlane:
    """Jobs on a software aggregator; each job names its workers' addresses (anti-spoofing). The
    aggregator is embedded (its C calls take about 0.1 ms and run right on the loop) or remote
    (blocking gRPC, up to its timeout: in a worker thread). ``label``: the data plane its counters
    are reported as (default the name). ``loss_notices=False`` for a software spine over P4 leaves:
    they take no loss notices (docs/PROTOCOL.md), which would count as bad_type drops there."""

    name = allocation.SOFTWARE

    def __init__(
        self,
        aggregator: AggregatorHandle,
        k: int = protocol.DEFAULT_SW_K,
        default_slots: int = protocol.DEFAULT_SW_SLOTS,
        advertised_ip: str | None = None,
        label: str | None = None,
        loss_notices: bool = True,
    ) -> None:
        from switchagg.aggregator_control import RemoteAggregator

        self.agg = aggregator
        self.loss_notices = loss_notices
        self.k, self.default_slots = k, default_slots
        self._ip = advertised_ip or aggregator.address[0]
        self._installed: set[int] = set()
        self.label = label or self.name
        self.remote = isinstance(aggregator, RemoteAggregator)
        self._lock = threading.Lock()  # a reconcile (in a thread) apart from an install or remove

    async def _off_loop(self, call: Callable[..., _T], *args: object) -> _T:
        return await asyncio.to_thread(call, *args) if self.remote else call(*args)

    @property
    def aggregator(self) -> tuple[str, int]:
        return (self._ip, self.agg.address[1])

    def aggregator_of(self, job: Job, rank: int) -> tuple[str, int]:
        return self.aggregator

    def pool_sizes(self) -> dict[str, int]:
        return {self.name: allocation.SW_POOL_SLOTS}

    def slot_pools(self, workers: tuple[WorkerAddr, ...]) -> tuple[str, ...]:
        return (self.name,)

    def worker_addr(self, rank: int, ip: str, udp_port: int) -> WorkerAddr:
        return WorkerAddr(rank, ip, udp_port)

    def _add(self, job: Job) -> None:
        addrs = [(w.ip, w.udp_port) for w in sorted(job.workers, key=lambda w: w.rank)]
        self.agg.add_job(
            job.job_id, job.n, job.slot_base, job.slot_count, job.k, job.generation, addrs,
            name=job.name, key=job.key, loss_notices=self.loss_notices,
        )  # fmt: skip

    def _install(self, job: Job) -> None:
        from switchagg.aggregator_control import ControlError

        with self._lock:
            try:
                if job.job_id in self._installed:  # a reinstall with a new generation
                    self._installed.discard(job.job_id)
                    self.agg.remove_job(job.job_id)
                self._add(job)
            except Exception as e:
                away = isinstance(e, ControlError) and e.code in _AWAY
                raise DataPlaneError(
                    f"the software aggregator {self.label} refused job {job.job_id}: {e}", away
                ) from e
            self._installed.add(job.job_id)

    def _remove(self, job: Job) -> None:
        with self._lock:
            if job.job_id in self._installed:
                self._installed.discard(job.job_id)
                self.agg.remove_job(job.job_id)

    async def install(self, job: Job) -> None:
        await self._off_loop(self._install, job)

    async def restore(self, jobs: list[Job]) -> None:
        for job in jobs:
            await self.install(job)

    async def remove(self, job: Job) -> None:
        await self._off_loop(self._remove, job)

    def reconcile(self, jobs: list[Job]) -> tuple[int, int]:
        """Makes the aggregator hold exactly ``jobs`` (blocking: call it off the loop for a remote
        one), with their generations; they count as installed from now on."""
        with self._lock:
            self._installed = {j.job_id for j in jobs}
            return reconcile_jobs(self.agg, {j.job_id: j for j in jobs}, self._add)

    async def counters(self) -> CounterReading:
        try:
            return CounterReading(await self._off_loop(self.counter_values))
        except Exception as e:
            if not self.remote:
                raise
            return CounterReading(unavailable={self.label: str(e) or type(e).__name__})

    def counter_values(self) -> list[CounterValue]:
        c = self.agg.counters()
        plane = self.label
        out = [CounterValue(plane, "total", name, 0, int(c[name])) for name in ("rx", "tx")]
        out += [
            CounterValue(plane, "drops", name, 0, int(c["drops"][name])) for name in protocol.DROP_REASONS
        ]
        out += [CounterValue(plane, "faults", name, 0, int(v)) for name, v in c["faults"].items()]
        out += job_counters(plane, c)
        return out


def spine_pool(name: str) -> str:
    """The slot pool of a software spine behind P4 leaves."""
    return f"{allocation.P4}-spine:{name}"


class P4DataPlane:
    """Jobs on the P4 switches: a job runs on the switch all its workers are cabled to, and every
    change writes that switch's whole desired state through its supervisor; the other switches
    are not touched. A job across leaves runs on them and on their spine: a P4 switch, or a
    software spine (``software_spines``: each with its aggregator, embedded or remote), where
    the spine's job is installed as on any software aggregator (SoftwareDataPlane)."""

    name = allocation.P4

    def __init__(
        self,
        topologies: list[Topology],
        default_slots: int = 64,
        software_spines: list[tuple[SoftwareSpine, AggregatorHandle]] | None = None,
    ) -> None:
        if not topologies:
            raise ValueError("the P4 data plane needs at least one switch")
        self.topologies = {t.name: t for t in topologies}
        self.supervisors: dict[str, SwitchSupervisor] = {}
        self.k = protocol.P4_K
        self.default_slots = default_slots
        self._jobs: dict[int, Job] = {}
        # Rails (docs/CONTROLLER.md, Rails): the shards of striped jobs this plane's switches carry,
        # by switch and job id; each is an ordinary one-switch job there (reducers.StripedDataPlane).
        self._rails: dict[str, dict[int, Job]] = {}
        self.software_spines = {spine.name: spine for spine, _ in software_spines or []}
        self.spine_planes = {  # over P4 leaves: no loss notices
            spine.name: SoftwareDataPlane(
                agg, k=self.k, label=f"{self.name}:{spine.name}", loss_notices=False
            )
            for spine, agg in software_spines or []
        }

    def attach(self, supervisor: SwitchSupervisor) -> None:
        self.supervisors[supervisor.name] = supervisor

    def _host(self, ip: str) -> tuple[str, HostPort] | None:
        for name, t in self.topologies.items():
            host = t.host_by_ip(ip)
            if host is not None:
                return name, host
        return None

    def route(self, job: Job) -> tuple[str | None, list[str]]:
        """Where ``job`` runs: (None, [its switch]) when every worker is cabled to one switch, or
        (the spine, the leaves in topology order) when they sit behind leaves of one spine (two
        levels, docs/PROTOCOL.md: leaf l is rank l at the spine). The spine is a P4 switch or a
        software spine (``software_spine_of``)."""
        return self._route(job.workers, job.name)

    def _route(self, workers: tuple[WorkerAddr, ...], job_name: str) -> tuple[str | None, list[str]]:
        names = set()
        for w in workers:
            found = self._host(w.ip)
            if found is None:
                raise DataPlaneError(f"{w.ip} is not a host of any switch in the topology")
            names.add(found[0])
        if len(names) == 1:
            return None, [names.pop()]
        spines = {u.switch if (u := self.topologies[n].uplink) else None for n in names}
        if len(spines) != 1 or None in spines:
            raise DataPlaneError(
                f"job {job_name!r} has workers on switches {', '.join(sorted(names))}; a job runs on one "
                "switch, or on leaves with uplinks to one spine"
            )
        order = list(self.topologies)
        return spines.pop(), sorted(names, key=order.index)

    def switches_of(self, job: Job) -> list[str]:
        """Every P4 switch ``job`` is installed on (the spine first, if it is one)."""
        spine, switches = self.route(job)
        return ([spine] if spine and spine not in self.software_spines else []) + switches

    def software_spine_of(self, job: Job) -> str | None:
        """The software spine of a job across P4 leaves, if its spine is one."""
        spine, _ = self.route(job)
        return spine if spine in self.software_spines else None

    def software_spine_view(self, job: Job) -> Job:
        """The job as its software spine runs it: the leaves as ranks (their UDP sources)."""
        _, leaves = self.route(job)
        from switchagg_controller import p4_program

        return p4_program.spine_view(job, [self.topologies[s] for s in leaves])

    def switch_of(self, job: Job) -> str:
        """The one switch of a one-switch job; for a two-level job its spine."""
        spine, switches = self.route(job)
        return spine or switches[0]

    def bumped_by_restart(self, job: Job, switch: str) -> bool:
        """Whether ``switch`` losing its state needs a new generation for ``job``: for a job on that
        switch alone. A two-level job keeps its generation (its other switches hold rounds in
        flight, which a new generation would reset); the restarted switch's registers are zero,
        which the generation check already takes for a fresh slot."""
        spine, switches = self.route(job)
        return spine is None and switches == [switch]

    @property
    def aggregator(self) -> tuple[str, int]:
        t = next(iter(self.topologies.values()))
        return (t.aggregator_ip, t.udp_port)

    def aggregator_of(self, job: Job, rank: int) -> tuple[str, int]:
        """The aggregator of the switch rank ``rank`` is cabled to (its leaf, on two levels)."""
        w = next(w for w in job.workers if w.rank == rank)
        found = self._host(w.ip)
        if found is None:
            raise DataPlaneError(f"{w.ip} is not a host of any switch in the topology")
        t = self.topologies[found[0]]
        return (t.aggregator_ip, t.udp_port)

    def pool_sizes(self) -> dict[str, int]:
        # Slot ranges are unique across the switches; a software spine has a pool of its own.
        return {self.name: protocol.P4_NUM_SLOTS} | {
            spine_pool(name): allocation.SW_POOL_SLOTS for name in self.software_spines
        }

    def slot_pools(self, workers: tuple[WorkerAddr, ...]) -> tuple[str, ...]:
        spine, _ = self._route(workers, "")
        return (self.name, spine_pool(spine)) if spine in self.software_spines else (self.name,)

    def worker_addr(self, rank: int, ip: str, udp_port: int) -> WorkerAddr:
        found = self._host(ip)
        if found is None:
            raise DataPlaneError(f"{ip} is not a host of any switch in the topology")
        host = found[1]
        return WorkerAddr(rank, ip, udp_port, host.mac, host.port)

    def jobs_on(self, switch: str) -> list[Job]:
        jobs = sorted(self._jobs.values(), key=lambda j: j.job_id)
        return [j for j in jobs if switch in self.switches_of(j)]

    def desired(self, switch: str) -> SwitchState:
        """The switch's whole state: its one-switch jobs, the two-level jobs it is the spine of
        (the leaves as ranks) and those it is a leaf of (its local ranks, its uplink)."""
        from switchagg_controller import p4_program

        jobs, leaves = [], {}
        for job in self.jobs_on(switch):
            spine, switches = self.route(job)
            if spine is None:
                jobs.append(job)
            elif switch == spine:
                jobs.append(p4_program.spine_view(job, [self.topologies[s] for s in switches]))
            else:
                spine_at = self.software_spines.get(spine) or self.topologies[spine]
                view, role = p4_program.leaf_view(
                    job, self.topologies[switch], spine_at, switches.index(switch)
                )
                jobs.append(view)
                leaves[job.job_id] = role
        jobs += sorted(self._rails.get(switch, {}).values(), key=lambda j: j.job_id)
        return p4_program.desired_state(self.topologies[switch], jobs, leaves)

    # -- rails: shards of striped jobs on these switches ---------------------------------------

    def rail_view(self, job: Job, shard: int, switch: str) -> Job:
        """Shard ``shard`` of striped ``job`` as switch ``switch`` runs it: a one-switch job with the
        shard's slots and key, every rank pinned by its address and port on that rail (MAC and
        switch port from the switch's hosts)."""
        s = job.shards[shard]
        topology = self.topologies.get(switch)
        if topology is None:
            raise DataPlaneError(f"rail {s.node}: no switch {switch!r} in the topology")
        ranks = sorted(job.workers, key=lambda w: w.rank)
        ips = s.ips or tuple(w.ip for w in ranks)
        workers = []
        for w, ip, port in zip(ranks, ips, s.ports, strict=True):
            host = topology.host_by_ip(ip)
            if host is None:
                raise DataPlaneError(
                    f"rank {w.rank} of job {job.name!r} joined shard {shard} from {ip}, which is not a host "
                    f"of switch {switch} (rail {s.node}): a worker joins each rail from its address there"
                )
            workers.append(WorkerAddr(w.rank, ip, port, host.mac, host.port))
        return Job(
            job.job_id, job.name, job.n, s.slot_base, s.slot_count, self.k, job.generation,
            tuple(workers), job.counter_index, s.key,
        )  # fmt: skip

    def rail_jobs(self, switch: str) -> list[Job]:
        return sorted(self._rails.get(switch, {}).values(), key=lambda j: j.job_id)

    async def install_rails(self, job_id: int, views: dict[str, Job], keep: bool = False) -> None:
        """Puts job ``job_id``'s rail views (by switch) on their switches, replacing the ones it had;
        on a failure the previous ones come back (``keep``: a restore, the views stay and the
        supervisors apply them when the switches connect)."""
        before = {sw: jobs[job_id] for sw, jobs in self._rails.items() if job_id in jobs}
        for sw in before:
            del self._rails[sw][job_id]
        for sw, view in views.items():
            self._rails.setdefault(sw, {})[job_id] = view
        touched = list(dict.fromkeys([*views, *before]))
        switch = touched[0] if touched else ""
        try:
            for switch in touched:
                await self._push(switch)
        except Exception as e:
            if keep:
                return
            for sw in views:
                self._rails[sw].pop(job_id, None)
            for sw, view in before.items():
                self._rails.setdefault(sw, {})[job_id] = view
            await self._push_quietly(touched[: touched.index(switch)])
            raise _install_failed(f"job {job_id} on rail switch {switch}", e) from e

    async def remove_rails(self, job_id: int) -> None:
        await self._push_quietly(
            [sw for sw, jobs in self._rails.items() if jobs.pop(job_id, None) is not None]
        )

    async def rail_counters(self, labels: dict[str, str], timeout: float = 5.0) -> CounterReading:
        """The job counters of the rail views on the switches of ``labels`` (switch -> data plane
        label); a switch that is away is named in ``unavailable``."""
        from switchagg_controller import p4_program
        from switchagg_controller.supervisor import read_counters

        supervisors = [self.supervisors[sw] for sw in labels if sw in self.supervisors]
        read = await read_counters(supervisors, list(p4_program.JOB_COUNTER_NAMES.values()), timeout)
        reading = CounterReading()
        for switch, values in read.items():
            if isinstance(values, Exception):
                reading.unavailable[labels[switch]] = str(values) or type(values).__name__
                continue
            reading.values += self._job_values(labels[switch], values, self.rail_jobs(switch), [])
        return reading

    @staticmethod
    def _job_values(
        plane: str, values: dict[str, dict[int, tuple[int, int]]], jobs: list[Job], leaf_jobs: list[Job]
    ) -> list[CounterValue]:
        from switchagg_controller import p4_program

        out = []
        for counter_names, counted in (
            (p4_program.JOB_COUNTER_NAMES, jobs),
            (p4_program.LEAF_COUNTER_NAMES, leaf_jobs),
        ):
            for name, counter in counter_names.items():
                for job in counted:
                    nbytes, packets = values[counter].get(job.counter_index, (0, 0))
                    out.append(CounterValue(plane, "job", name, job.job_id, packets, nbytes))
        return out

    def is_leaf_of(self, job: Job, switch: str) -> bool:
        spine, switches = self.route(job)
        return spine is not None and switch in switches

    def set_jobs(self, jobs: list[Job]) -> None:
        """Replaces (or adds) known jobs without pushing (reload, or new generations after a restart)."""
        self._jobs.update({j.job_id: j for j in jobs})

    async def _push(self, switch: str) -> None:
        supervisor = self.supervisors.get(switch)
        if supervisor is None:
            from switchagg_controller.supervisor import SwitchUnavailable

            raise SwitchUnavailable(f"switch {switch} has no supervisor")
        await supervisor.push()

    async def restore(self, jobs: list[Job]) -> None:
        self._jobs = {j.job_id: j for j in jobs}
        for job in jobs:
            if spine := self.software_spine_of(job):
                try:
                    await self.spine_planes[spine].install(self.software_spine_view(job))
                except DataPlaneError:  # noqa: PERF203 - a remote spine not up yet: reconciled when it is
                    pass
        for switch in {s for j in jobs for s in self.switches_of(j)}:
            try:
                await self._push(switch)
            except Exception:  # noqa: S110 - not connected yet; the supervisor applies it on connect
                pass

    async def install(self, job: Job) -> None:
        switches = self.switches_of(job)  # the spine first: a leaf's first partial must find the job
        soft_spine = self.software_spine_of(job)
        if soft_spine is not None:
            await self.spine_planes[soft_spine].install(self.software_spine_view(job))
        switch = switches[0]
        previous = self._jobs.get(job.job_id)
        self._jobs[job.job_id] = job
        try:
            for switch in switches:
                await self._push(switch)
        except Exception as e:
            # Not on the switch: forget it, so a later push does not install it.
            if previous is None:
                self._jobs.pop(job.job_id, None)
            else:
                self._jobs[job.job_id] = previous
            if soft_spine is not None:
                await self._off_software_spine(soft_spine, job)
            await self._push_quietly(switches[: switches.index(switch)])  # off the switches it reached
            raise _install_failed(f"job {job.job_id} on P4 switch {switch}", e) from e

    async def remove(self, job: Job) -> None:
        self._jobs.pop(job.job_id, None)
        await self._push_quietly(list(reversed(self.switches_of(job))))
        if spine := self.software_spine_of(job):
            await self._off_software_spine(spine, job)

    async def _push_quietly(self, switches: list[str]) -> None:
        """Pushes each switch's desired state; one that fails is left to its supervisor, which
        reapplies the desired state when the switch is back."""
        for switch in switches:
            try:
                await self._push(switch)
            except Exception:  # noqa: S110 - see above
                pass

    async def _off_software_spine(self, spine: str, job: Job) -> None:
        """Takes ``job`` off a software spine, or puts back the one it replaced (a failed reinstall)."""
        plane = self.spine_planes[spine]
        try:
            if job.job_id in self._jobs:
                await plane.install(self.software_spine_view(self._jobs[job.job_id]))
            else:
                await plane.remove(job)
        except Exception as e:  # a remote spine that is away: reconciled when it is back
            log.warning("software spine %s: job %d: %s", spine, job.job_id, e)

    def reconcile_software_spine(self, spine: str, jobs: list[Job]) -> tuple[int, int]:
        """Makes software spine ``spine`` hold exactly its part of ``jobs`` (the manager's P4 jobs),
        generations unchanged (a restarted spine, docs/PROTOCOL.md, Restarting a leaf: the leaves
        keep their rounds). Blocking for a remote spine: call it off the loop. (installed, removed)."""
        views = [self.software_spine_view(j) for j in jobs if self.software_spine_of(j) == spine]
        return self.spine_planes[spine].reconcile(views)

    def label(self, switch: str) -> str:
        """The data plane label of a switch's counters: "p4", or "p4:NAME" with several switches."""
        return self.name if len(self.supervisors) == 1 else f"{self.name}:{switch}"

    async def counters(self, timeout: float = 5.0) -> CounterReading:
        """Every switch's counters, read in parallel; a switch that is away (or slower than
        ``timeout``) is left out and named in ``unavailable``, the others answer."""
        from switchagg_controller import p4_program
        from switchagg_controller.supervisor import read_counters

        names = [
            p4_program.DROP_COUNTER,
            *p4_program.JOB_COUNTER_NAMES.values(),
            *p4_program.LEAF_COUNTER_NAMES.values(),
        ]
        reading = CounterReading()
        for spine in self.spine_planes.values():
            r = await spine.counters()
            reading.values += r.values
            reading.unavailable |= r.unavailable
        read = await read_counters(list(self.supervisors.values()), names, timeout)
        for switch, values in read.items():
            plane = self.label(switch)
            if isinstance(values, Exception):
                reading.unavailable[plane] = str(values) or type(values).__name__
                continue
            drops = values[p4_program.DROP_COUNTER]
            reading.values += [
                CounterValue(plane, "drops", name, 0, drops.get(i, (0, 0))[1], drops.get(i, (0, 0))[0])
                for i, name in enumerate(protocol.DROP_REASONS)
            ]
            jobs = self.jobs_on(switch)
            leaf_jobs = [j for j in jobs if self.is_leaf_of(j, switch)]
            reading.values += self._job_values(plane, values, jobs, leaf_jobs)
        return reading
