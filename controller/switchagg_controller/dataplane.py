"""The places a job can run: the P4 switches and the software aggregator.

The job manager only calls install/remove; how a job reaches the data plane (P4Runtime writes
of the whole desired state, or add_job on the C aggregator) is hidden here. Everything runs on
the controller's event loop: the software aggregator's C calls (add_job, remove_job, counters)
take about 0.1 ms and are called directly; the P4 switches are awaited.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from switchagg import protocol
from switchagg_controller import allocation
from switchagg_controller.model import HostPort, Job, SwitchState, Topology, WorkerAddr

if TYPE_CHECKING:
    from switchagg.aggregator import Counters, SoftwareAggregator
    from switchagg_controller.supervisor import SwitchSupervisor


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


class SoftwareDataPlane:
    """Jobs on a SoftwareAggregator; each job names its workers' addresses (anti-spoofing)."""

    name = allocation.SOFTWARE

    def __init__(
        self,
        aggregator: SoftwareAggregator,
        k: int = protocol.DEFAULT_SW_K,
        default_slots: int = protocol.DEFAULT_SW_SLOTS,
        advertised_ip: str | None = None,
    ) -> None:
        self.agg = aggregator
        self.k, self.default_slots = k, default_slots
        self._ip = advertised_ip or aggregator.address[0]
        self._installed: set[int] = set()

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

    async def install(self, job: Job) -> None:
        addrs = [(w.ip, w.udp_port) for w in sorted(job.workers, key=lambda w: w.rank)]
        if job.job_id in self._installed:  # a reinstall with a new generation
            self.agg.remove_job(job.job_id)
            self._installed.discard(job.job_id)
        try:
            self.agg.add_job(
                job.job_id,
                job.n,
                job.slot_base,
                job.slot_count,
                job.k,
                job.generation,
                addrs,
                name=job.name,
            )
        except Exception as e:
            raise DataPlaneError(f"the software aggregator refused job {job.job_id}: {e}") from e
        self._installed.add(job.job_id)

    async def restore(self, jobs: list[Job]) -> None:
        for job in jobs:
            await self.install(job)

    async def remove(self, job: Job) -> None:
        if job.job_id in self._installed:
            self._installed.discard(job.job_id)
            self.agg.remove_job(job.job_id)

    async def counters(self) -> CounterReading:
        return CounterReading(self.counter_values())

    def counter_values(self) -> list[CounterValue]:
        c = self.agg.counters()
        out = [CounterValue(self.name, "total", name, 0, int(c[name])) for name in ("rx", "tx")]
        out += [
            CounterValue(self.name, "drops", name, 0, int(c["drops"][name])) for name in protocol.DROP_REASONS
        ]
        out += [CounterValue(self.name, "faults", name, 0, int(v)) for name, v in c["faults"].items()]
        out += job_counters(self.name, c)
        return out


class P4DataPlane:
    """Jobs on the P4 switches: a job runs on the switch all its workers are cabled to, and every
    change writes that switch's whole desired state through its supervisor; the other switches
    are not touched."""

    name = allocation.P4

    def __init__(self, topologies: list[Topology], default_slots: int = 64) -> None:
        if not topologies:
            raise ValueError("the P4 data plane needs at least one switch")
        self.topologies = {t.name: t for t in topologies}
        self.supervisors: dict[str, SwitchSupervisor] = {}
        self.k = protocol.P4_K
        self.default_slots = default_slots
        self._jobs: dict[int, Job] = {}

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
        levels, docs/PROTOCOL.md: leaf l is rank l at the spine)."""
        names = set()
        for w in job.workers:
            found = self._host(w.ip)
            if found is None:
                raise DataPlaneError(f"{w.ip} is not a host of any switch in the topology")
            names.add(found[0])
        if len(names) == 1:
            return None, [names.pop()]
        spines = {u.switch if (u := self.topologies[n].uplink) else None for n in names}
        if len(spines) != 1 or None in spines:
            raise DataPlaneError(
                f"job {job.name!r} has workers on switches {', '.join(sorted(names))}; a job runs on one "
                "switch, or on leaves with uplinks to one spine"
            )
        order = list(self.topologies)
        return spines.pop(), sorted(names, key=order.index)

    def switches_of(self, job: Job) -> list[str]:
        """Every switch ``job`` is installed on (the spine first)."""
        spine, switches = self.route(job)
        return ([spine] if spine else []) + switches

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
        return {self.name: protocol.P4_NUM_SLOTS}  # slot ranges are unique across the switches

    def slot_pools(self, workers: tuple[WorkerAddr, ...]) -> tuple[str, ...]:
        return (self.name,)

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
                view, role = p4_program.leaf_view(
                    job, self.topologies[switch], self.topologies[spine], switches.index(switch)
                )
                jobs.append(view)
                leaves[job.job_id] = role
        return p4_program.desired_state(self.topologies[switch], jobs, leaves)

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
        for switch in {s for j in jobs for s in self.switches_of(j)}:
            try:
                await self._push(switch)
            except Exception:  # noqa: S110 - not connected yet; the supervisor applies it on connect
                pass

    async def install(self, job: Job) -> None:
        switches = self.switches_of(job)  # the spine first: a leaf's first partial must find the job
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
            for other in switches[: switches.index(switch)]:  # take it off the switches it reached
                try:
                    await self._push(other)
                except Exception:  # noqa: S110 - the supervisor reapplies the desired state when back
                    pass
            from switchagg_controller.supervisor import SwitchUnavailable

            unavailable = isinstance(e, SwitchUnavailable | asyncio.TimeoutError)
            raise DataPlaneError(
                f"installing job {job.job_id} on P4 switch {switch} failed: {e}", unavailable
            ) from e

    async def remove(self, job: Job) -> None:
        self._jobs.pop(job.job_id, None)
        for switch in reversed(self.switches_of(job)):
            try:
                await self._push(switch)
            except Exception:  # noqa: S110 - the supervisor reapplies the desired state when the switch is back
                pass

    def label(self, switch: str) -> str:
        """The data plane label of a switch's counters: "p4", or "p4:NAME" with several switches."""
        return self.name if len(self.supervisors) == 1 else f"{self.name}:{switch}"

    async def counters(self, timeout: float = 5.0) -> CounterReading:
        """Every switch's counters, read in parallel; a switch that is away (or slower than
        ``timeout``) is left out and named in ``unavailable``, the others answer."""
        from switchagg_controller import p4_program

        names = [
            p4_program.DROP_COUNTER,
            *p4_program.JOB_COUNTER_NAMES.values(),
            *p4_program.LEAF_COUNTER_NAMES.values(),
        ]
        supervisors = list(self.supervisors.values())

        async def one(s: SwitchSupervisor) -> dict[str, dict[int, tuple[int, int]]] | Exception:
            try:
                return await asyncio.wait_for(s.read_counters(names), timeout)
            except Exception as e:
                return e

        reading = CounterReading()
        for s, values in zip(supervisors, await asyncio.gather(*map(one, supervisors)), strict=True):
            plane = self.label(s.name)
            if isinstance(values, Exception):
                reading.unavailable[plane] = str(values) or type(values).__name__
                continue
            drops = values[p4_program.DROP_COUNTER]
            reading.values += [
                CounterValue(plane, "drops", name, 0, drops.get(i, (0, 0))[1], drops.get(i, (0, 0))[0])
                for i, name in enumerate(protocol.DROP_REASONS)
            ]
            jobs = self.jobs_on(s.name)
            leaf_jobs = [j for j in jobs if self.is_leaf_of(j, s.name)]
            for counter_names, counted in (
                (p4_program.JOB_COUNTER_NAMES, jobs),
                (p4_program.LEAF_COUNTER_NAMES, leaf_jobs),
            ):
                for name, counter in counter_names.items():
                    for job in counted:
                        nbytes, packets = values[counter].get(job.counter_index, (0, 0))
                        reading.values.append(CounterValue(plane, "job", name, job.job_id, packets, nbytes))
        return reading
