"""The two-level data plane: a job's slots on the spine and on every leaf its workers use, each an
embedded or remote software aggregator (two_level_spec.py says which; software_nodes.py opens them)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from switchagg import protocol
from switchagg_controller import allocation
from switchagg_controller.model import Job, WorkerAddr
from switchagg_controller.planes import (
    CounterReading,
    CounterValue,
    DataPlaneError,
    read_node,
    reconcile_jobs,
)
from switchagg_controller.two_level_spec import SPINE, TwoLevelSpec

if TYPE_CHECKING:
    from switchagg.aggregator import AggregatorHandle

_T = TypeVar("_T")
log = logging.getLogger(__name__)


def pool_key(node: str) -> str:
    return f"{allocation.TWO_LEVEL}:{node}"


class TwoLevelDataPlane:
    """Jobs on software leaves and a software spine. A job takes one slot range free on the spine
    and on every leaf it crosses; on each leaf it is installed with the job's total n, the local
    ranks' addresses, upstream = the spine, leaf_index = the leaf's position among the job's
    leaves; on the spine with n = that many leaves and rank l = leaf l's address.

    The async methods are what the job manager awaits on the controller's loop. Embedded nodes
    are called directly (each C call about 0.1 ms); with a remote node among them, a change or a
    counter read is a blocking gRPC call (up to its 2 s timeout), so it runs in a worker thread
    (asyncio.to_thread), and ``_lock`` keeps such a change apart from a reconcile.
    """

    name = allocation.TWO_LEVEL

    def __init__(
        self,
        spec: TwoLevelSpec,
        spine: AggregatorHandle,
        leaves: list[AggregatorHandle],
        k: int = protocol.DEFAULT_SW_K,
        default_slots: int = protocol.DEFAULT_SW_SLOTS,
    ) -> None:
        if len(leaves) != len(spec.leaves):
            raise ValueError(f"{len(spec.leaves)} leaves in the spec, {len(leaves)} aggregators")
        self.spec, self.spine, self.leaves = spec, spine, leaves
        self.k, self.default_slots = k, default_slots
        self._installed: set[int] = set()
        self._lock = threading.Lock()
        from switchagg.aggregator_control import RemoteAggregator

        self.remote = any(isinstance(a, RemoteAggregator) for a in (spine, *leaves))

    @property
    def aggregator(self) -> tuple[str, int]:
        return self.spine.address

    def _leaf_of(self, ip: str) -> int:
        leaf = self.spec.leaf_of(ip)
        if leaf is None:
            raise DataPlaneError(f"{ip} is behind no leaf of the two-level topology")
        return leaf

    def crosses(self, job: Job, node: int) -> bool:
        """Whether ``job`` runs on node ``node`` (0 the spine, l+1 leaf l)."""
        return node == 0 or node - 1 in self.job_leaves(job.workers)

    def job_leaves(self, workers: tuple[WorkerAddr, ...]) -> list[int]:
        """The leaves a job crosses, in topology order: position l is rank l at the spine."""
        return sorted({self._leaf_of(w.ip) for w in workers})

    def aggregator_of(self, job: Job, rank: int) -> tuple[str, int]:
        w = next(w for w in job.workers if w.rank == rank)
        leaf = self._leaf_of(w.ip)
        host, port = self.leaves[leaf].address
        return (self.spec.leaves[leaf].advertise or host, port)

    def worker_addr(self, rank: int, ip: str, udp_port: int) -> WorkerAddr:
        self._leaf_of(ip)  # a worker behind no leaf: the job goes to the next data plane
        return WorkerAddr(rank, ip, udp_port)

    def pool_sizes(self) -> dict[str, int]:
        names = [SPINE, *(leaf.name for leaf in self.spec.leaves)]
        return {pool_key(n): allocation.SW_POOL_SLOTS for n in names}

    def slot_pools(self, workers: tuple[WorkerAddr, ...]) -> tuple[str, ...]:
        return (pool_key(SPINE), *(pool_key(self.spec.leaves[i].name) for i in self.job_leaves(workers)))

    def _nodes(self, job: Job) -> list[AggregatorHandle]:
        return [self.spine, *(self.leaves[i] for i in self.job_leaves(job.workers))]

    def _node(self, node: int) -> AggregatorHandle:
        return self.spine if node == 0 else self.leaves[node - 1]

    def _add_on(self, job: Job, node: int) -> None:
        """Installs ``job`` on node ``node`` (0 the spine, l+1 leaf l) as that node's role in it."""
        leaves = self.job_leaves(job.workers)
        if node == 0:  # the spine: rank l is leaf l's address
            views = [self.leaves[i].address for i in leaves]
            self.spine.add_job(
                job.job_id, len(leaves), job.slot_base, job.slot_count, job.k, job.generation, views,
                name=job.name, key=job.key,
            )  # fmt: skip
            return
        i = node - 1
        ranks = sorted(job.workers, key=lambda w: w.rank)
        addrs = [(w.ip, w.udp_port) if self.spec.leaf_of(w.ip) == i else None for w in ranks]
        self.leaves[i].add_job(
            job.job_id, job.n, job.slot_base, job.slot_count, job.k, job.generation, addrs,
            name=job.name, upstream=self.spine.address, leaf_index=leaves.index(i), key=job.key,
        )  # fmt: skip

    async def _off_loop(self, call: Callable[..., _T], *args: object) -> _T:
        """``call(*args)``: in a worker thread when a remote node may block, else right here."""
        return await asyncio.to_thread(call, *args) if self.remote else call(*args)

    async def install(self, job: Job) -> None:
        await self._off_loop(self._install, job)

    async def remove(self, job: Job) -> None:
        await self._off_loop(self._remove, job)

    async def restore(self, jobs: list[Job]) -> None:
        for job in jobs:
            await self.install(job)

    async def counters(self) -> CounterReading:
        """Every node's counters; a remote node that does not answer is named in ``unavailable``."""
        return await self._off_loop(self._counters)

    def _install(self, job: Job) -> None:
        with self._lock:
            if job.job_id in self._installed:  # a reinstall with a new generation
                self._remove_locked(job)
            done: list[AggregatorHandle] = []
            try:
                # The spine first: a leaf's first partial must find its job there.
                for node in (0, *(i + 1 for i in self.job_leaves(job.workers))):
                    self._add_on(job, node)
                    done.append(self._node(node))
            except Exception as e:
                for agg in done:
                    agg.remove_job(job.job_id)
                raise DataPlaneError(
                    f"the two-level software data plane refused job {job.job_id}: {e}"
                ) from e
            self._installed.add(job.job_id)

    def _remove_locked(self, job: Job) -> None:
        self._installed.discard(job.job_id)
        for agg in self._nodes(job):
            try:
                agg.remove_job(job.job_id)
            except Exception as e:  # a remote node that is unreachable: reconcile() clears it later
                log.warning("removing job %d from a two-level node failed: %s", job.job_id, e)

    def _remove(self, job: Job) -> None:
        with self._lock:
            if job.job_id in self._installed:
                self._remove_locked(job)

    def reconcile(self, node: int, jobs: list[Job]) -> tuple[int, int]:
        """Makes node ``node`` hold exactly its part of ``jobs`` (the manager's two-level jobs):
        for a remote node that restarted (it came back empty) or was unreachable for a while (it
        may hold jobs removed meanwhile). Jobs keep their generation: the restarted node's empty
        slots are rebuilt by the workers' resends while the other nodes keep their state
        (docs/PROTOCOL.md, Restarting a leaf). Returns (installed, removed)."""
        with self._lock:
            want = {j.job_id: j for j in jobs if j.job_id in self._installed and self.crosses(j, node)}
            return reconcile_jobs(self._node(node), want, lambda job: self._add_on(job, node))

    def _counters(self) -> CounterReading:
        reading = CounterReading()
        named = [
            (SPINE, self.spine),
            *((s.name, a) for s, a in zip(self.spec.leaves, self.leaves, strict=True)),
        ]
        for node, agg in named:
            read_node(reading, f"{self.name}:{node}", agg)
        return reading

    def counter_values(self) -> list[CounterValue]:
        """The counters, here and now (tests; the job manager awaits ``counters``)."""
        return self._counters().values
