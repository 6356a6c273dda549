"""The reducer pool: software aggregators that a job is striped across (docs/PROTOCOL.md,
Striping; docs/CONTROLLER.md, The reducer pool).

The file (``switchagg-ctl serve --reducers FILE``) lists the pool's nodes; a node with only
``listen`` is embedded (the controller runs it), one that also names ``control`` and
``secret_file`` (relative to the file) is a ``switchagg-aggregator --control`` elsewhere, e.g. on a
reducer host of its own:

reducers:
  - {name: r0, listen: 10.202.0.1:48879, control: 'unix:/run/r0.sock', secret_file: r.secret}
  - {name: r1, listen: 10.202.0.2:48879, advertise: 10.202.0.2}

A node with ``switch`` instead of ``listen`` is a P4 switch of the topology file (``serve
--topology``) used as a rail: a worker has one interface per rail and joins each shard from its
address there (JoinRequest.shard_ips); the shard is an ordinary one-switch job on that switch
(P4DataPlane.rail_view), its slots taken from the switches' common P4 pool:

reducers:
  - {name: rail0, switch: a}
  - {name: rail1, switch: b}

A job that asks for M shards gets M nodes of the pool (those with the most free slots, in file
order), one slot range on each (the same base on all), and shard s of every tensor is summed on
its s-th node, with each rank pinned to its own socket for that shard and a result key of the
shard's own (switchagg.striping.shard_key).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import yaml

from switchagg import protocol
from switchagg.striping import shard_key
from switchagg_controller import allocation
from switchagg_controller.model import Job, JobShard, Remote, WorkerAddr
from switchagg_controller.planes import (
    CounterReading,
    DataPlaneError,
    read_node,
    reconcile_jobs,
)
from switchagg_controller.topology import (
    REMOTE_KEYS,
    TopologyError,
    YamlNode,
    parse_address,
    parse_remote,
    read_config,
)

if TYPE_CHECKING:
    from switchagg.aggregator import AggregatorHandle
    from switchagg_controller.planes import P4DataPlane

STRIPED = "striped"
_T = TypeVar("_T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReducerSpec:
    name: str
    listen: tuple[str, int]
    advertise: str = ""  # the IP told to workers ("": the listen IP)
    remote: Remote | None = None  # None: embedded in the controller
    switch: str = ""  # a P4 switch of the topology, as a rail ("": a software reducer)


def parse_reducers(text: str, source: str = "<reducers>", base: Path | None = None) -> list[ReducerSpec]:
    base = base if base is not None else Path()
    try:
        root_node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise TopologyError(f"{source}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if root_node is None:
        raise TopologyError(f"{source}:1: the file is empty")
    top = YamlNode(source, root_node, "").mapping(("reducers",))
    out: list[ReducerSpec] = []
    for node in top["reducers"].sequence():
        f = node.mapping(("name",), ("listen", "switch", "advertise", *REMOTE_KEYS))
        name = f["name"].text()
        if "switch" in f:  # a rail: a P4 switch of the topology file
            if set(f) != {"name", "switch"}:
                raise node.fail(f"reducer {name!r} names a switch (a rail): it takes no other key")
            switch = f["switch"].text()
            for other in out:
                if other.name == name or other.switch == switch:
                    raise node.fail(f"reducer {name!r} (switch {switch}) repeats reducer {other.name!r}")
            out.append(ReducerSpec(name, ("", 0), switch=switch))
            continue
        if "listen" not in f:
            raise node.fail(f"reducer {name!r} needs listen (a software reducer) or switch (a rail)")
        listen = parse_address(f["listen"])
        for other in out:
            if other.name == name or (other.listen == listen and listen[1] != 0):  # 0: a free port each
                raise node.fail(f"reducer {name!r} ({listen[0]}:{listen[1]}) repeats reducer {other.name!r}")
        advertise = f["advertise"].ipv4() if "advertise" in f else ""
        out.append(ReducerSpec(name, listen, advertise, parse_remote(f, base)))
    if not out:
        raise top["reducers"].fail("at least one reducer is needed")
    return out


def load_reducers(path: str | Path) -> list[ReducerSpec]:
    return parse_reducers(*read_config(path, "reducer pool file"), base=Path(path).parent)


def pool_key(node: str) -> str:
    return f"{STRIPED}:{node}"


def shard_workers(job: Job, shard: JobShard) -> list[tuple[str, int]]:
    """Each rank's address for ``shard``, in rank order: its IP for the shard (the job's worker IP
    unless it joined with one per shard), the shard's port."""
    ranks = sorted(job.workers, key=lambda w: w.rank)
    ips = shard.ips or tuple(w.ip for w in ranks)
    return list(zip(ips, shard.ports, strict=True))


class StripedDataPlane:
    """Jobs striped across a pool of software reducers (embedded or remote) and P4 switches as
    rails. The job manager asks ``choose`` for a job's nodes, takes one range free on all of them,
    and installs; each shard is an ordinary job on its node (its own ports of the workers, its own
    key; on a rail its own job entry, counter index and multicast group, through ``p4``). Remote
    reducers block (gRPC), so with one among them their changes and counter reads run in a worker
    thread."""

    name = STRIPED

    def __init__(
        self,
        specs: list[ReducerSpec],
        nodes: list[AggregatorHandle | None],
        k: int = protocol.DEFAULT_SW_K,
        default_slots: int = protocol.DEFAULT_SW_SLOTS,
        p4: P4DataPlane | None = None,
    ) -> None:
        """``nodes``: each spec's aggregator, None for a rail (a spec with ``switch``), which ``p4``
        (the topology's switches) runs."""
        if len(specs) != len(nodes) or not specs:
            raise ValueError(f"{len(specs)} reducers in the pool, {len(nodes)} aggregators")
        for spec, node in zip(specs, nodes, strict=True):
            if (node is None) != bool(spec.switch):
                raise ValueError(f"reducer {spec.name}: a rail has no aggregator, a software reducer one")
            if spec.switch and (p4 is None or spec.switch not in p4.topologies):
                raise ValueError(f"rail {spec.name}: no P4 switch {spec.switch!r} in the topology")
        self.specs, self.nodes, self.p4 = specs, nodes, p4
        self.index = {s.name: i for i, s in enumerate(specs)}
        self.rails = {s.name: s.switch for s in specs if s.switch}
        self.k, self.default_slots = k, default_slots
        self._installed: dict[int, Job] = {}
        self._lock = threading.Lock()
        from switchagg.aggregator_control import RemoteAggregator

        self.remote = any(isinstance(a, RemoteAggregator) for a in nodes)

    # -- what the job manager asks --------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.specs)

    @property
    def has_rails(self) -> bool:
        return bool(self.rails)

    def _node(self, name: str) -> AggregatorHandle:
        node = self.nodes[self.index[name]]
        assert node is not None, f"{name} is a rail"
        return node

    def node_address(self, node: str) -> tuple[str, int]:
        """Where workers send a shard on ``node`` (a rail: its switch's aggregator address)."""
        if node in self.rails:
            assert self.p4 is not None
            t = self.p4.topologies[self.rails[node]]
            return (t.aggregator_ip, t.udp_port)
        i = self.index[node]
        host, port = self._node(node).address
        return (self.specs[i].advertise or host, port)

    @property
    def aggregator(self) -> tuple[str, int]:
        return self.node_address(self.specs[0].name)

    def aggregator_of(self, job: Job, rank: int) -> tuple[str, int]:
        return self.node_address(job.shards[0].node) if job.shards else self.aggregator

    def node_pool(self, node: str) -> str:
        """The slot pool of ``node``: its own, or on a rail the P4 switches' common one (ranges are
        unique across the switches, as for the P4 data plane's jobs)."""
        return allocation.P4 if node in self.rails else pool_key(node)

    def pool_sizes(self) -> dict[str, int]:
        return {pool_key(s.name): allocation.SW_POOL_SLOTS for s in self.specs if not s.switch}

    def slot_pools(self, workers: tuple[WorkerAddr, ...]) -> tuple[str, ...]:
        raise DataPlaneError("the reducer pool takes striped jobs only (a Join with shards > 0)")

    def job_pools(self, job: Job) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.node_pool(s.node) for s in job.shards))

    def worker_addr(self, rank: int, ip: str, udp_port: int) -> WorkerAddr:
        return WorkerAddr(rank, ip, udp_port)

    def shard_slots(self, shards: int) -> int:
        """The slots of each shard of an M-shard job: the job's window split over its shards (at
        least 2 each), so that a worker keeps as many packets in flight as on one aggregator; a
        window per shard would put M times as much into the worker's own link queue. A pool of
        rails only: the whole window on each (each rail is a link of its own)."""
        if len(self.rails) == self.size:
            return self.default_slots
        return max(2, -(-self.default_slots // shards))

    def choose(self, shards: int, free: Callable[[str], int]) -> list[str]:
        """The ``shards`` nodes a new job is striped across: those with the most free slots
        (``free(pool key)``), in pool order."""
        if not 1 <= shards <= self.size:
            raise DataPlaneError(
                f"a striped job takes 1..{self.size} shards of the reducer pool, not {shards}"
            )
        ranked = sorted(range(self.size), key=lambda i: -free(self.node_pool(self.specs[i].name)))
        return [self.specs[i].name for i in sorted(ranked[:shards])]

    @staticmethod
    def shards_of(
        nodes: list[str],
        base: int,
        count: int,
        key: int,
        ports: list[tuple[int, ...]],
        ips: list[tuple[str, ...]] | None = None,
    ) -> tuple[JobShard, ...]:
        """The shards of a job: node s gets shard s, with each rank's port ``ports[rank][s]`` (and
        IP ``ips[rank][s]``, where the workers joined with one per shard)."""
        return tuple(
            JobShard(
                node,
                base,
                count,
                shard_key(key, s),
                tuple(p[s] for p in ports),
                tuple(i[s] for i in ips) if ips else (),
            )  # fmt: skip
            for s, node in enumerate(nodes)
        )

    # -- installing -----------------------------------------------------------------------------

    def _add(self, job: Job, s: int) -> None:
        shard = job.shards[s]
        addrs = shard_workers(job, shard)
        self._node(shard.node).add_job(
            job.job_id, job.n, shard.slot_base, shard.slot_count, job.k, job.generation, addrs,
            name=job.name, key=shard.key,
        )  # fmt: skip

    async def _off_loop(self, call: Callable[..., _T], *args: object) -> _T:
        return await asyncio.to_thread(call, *args) if self.remote else call(*args)

    def _software(self, job: Job) -> list[int]:
        return [s for s, shard in enumerate(job.shards) if shard.node not in self.rails]

    def _install(self, job: Job) -> None:
        """The job's shards on software reducers (its rails: ``_install_rails``)."""
        with self._lock:
            if job.job_id in self._installed:  # a reinstall with a new generation
                self._remove_locked(self._installed[job.job_id])
            done: list[int] = []
            software = self._software(job)
            try:
                for s in software:
                    self._add(job, s)
                    done.append(s)
            except Exception as e:
                for s in done:
                    self._node(job.shards[s].node).remove_job(job.job_id)
                from switchagg.aggregator_control import ControlError

                away = (
                    isinstance(e, ControlError)
                    and e.code is not None
                    and e.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
                )
                failed = software[len(done)]
                raise DataPlaneError(
                    f"reducer {job.shards[failed].node} refused shard {failed} of job {job.job_id}: {e}", away
                ) from e
            self._installed[job.job_id] = job

    def _rail_views(self, job: Job) -> dict[str, Job]:
        """The job's rail shards as their switches run them, by switch."""
        if not self.rails:
            return {}
        assert self.p4 is not None
        return {
            self.rails[shard.node]: self.p4.rail_view(job, s, self.rails[shard.node])
            for s, shard in enumerate(job.shards)
            if shard.node in self.rails
        }

    def _remove_locked(self, job: Job) -> None:
        self._installed.pop(job.job_id, None)
        for s in self._software(job):
            node = job.shards[s].node
            try:
                self._node(node).remove_job(job.job_id)
            except Exception as e:  # a remote node that is away: reconcile() clears it later
                log.warning("removing job %d from reducer %s failed: %s", job.job_id, node, e)

    def _remove(self, job: Job) -> None:
        with self._lock:
            if job.job_id in self._installed:
                self._remove_locked(job)

    async def install(self, job: Job, keep: bool = False) -> None:
        unknown = [s.node for s in job.shards if s.node not in self.index]
        if not job.shards or unknown:
            raise DataPlaneError(f"job {job.job_id} names no shard or reducers not in the pool: {unknown}")
        views = self._rail_views(job)  # checks every rank's address on every rail first
        await self._off_loop(self._install, job)
        if views:
            assert self.p4 is not None
            try:
                await self.p4.install_rails(job.job_id, views, keep=keep)
            except DataPlaneError:
                await self._off_loop(self._remove, job)
                raise

    async def remove(self, job: Job) -> None:
        await self._off_loop(self._remove, job)
        if self.rails and any(s.node in self.rails for s in job.shards):
            assert self.p4 is not None
            await self.p4.remove_rails(job.job_id)

    async def restore(self, jobs: list[Job]) -> None:
        for job in jobs:
            try:
                await self.install(job, keep=True)
            except DataPlaneError as e:  # a remote reducer not up yet: reconciled when it is
                log.warning("%s", e)
                self._installed[job.job_id] = job

    def reconcile(self, node: int, jobs: list[Job]) -> tuple[int, int]:
        """Makes reducer ``node`` hold exactly its shards of ``jobs`` (a remote reducer that
        restarted or came back), generations unchanged. Returns (installed, removed)."""
        name = self.specs[node].name
        with self._lock:
            mine = {
                j.job_id: (j, next(i for i, s in enumerate(j.shards) if s.node == name))
                for j in jobs
                if j.job_id in self._installed and any(s.node == name for s in j.shards)
            }
            # reconcile_jobs compares slots, K and key: give it the shard's view of each job.
            want = {
                job_id: Job(
                    j.job_id,
                    j.name,
                    j.n,
                    j.shards[s].slot_base,
                    j.shards[s].slot_count,
                    j.k,
                    j.generation,
                    j.workers,
                    key=j.shards[s].key,
                )  # fmt: skip
                for job_id, (j, s) in mine.items()
            }
            return reconcile_jobs(
                self._node(name), want, lambda view: self._add(mine[view.job_id][0], mine[view.job_id][1])
            )

    # -- counters -------------------------------------------------------------------------------

    async def counters(self) -> CounterReading:
        reading = await self._off_loop(self._counters)
        if self.rails:  # a rail's job counters: its switch's counter arrays at the shard's index
            assert self.p4 is not None
            rails = await self.p4.rail_counters(
                {sw: f"{self.name}:{name}" for name, sw in self.rails.items()}
            )
            reading.values += rails.values
            reading.unavailable |= rails.unavailable
        return reading

    def _counters(self) -> CounterReading:
        reading = CounterReading()
        for spec, agg in zip(self.specs, self.nodes, strict=True):
            if agg is None:
                continue
            read_node(reading, f"{self.name}:{spec.name}", agg)
        return reading
