"""Two-level software aggregation: software leaves behind a software spine (docs/PROTOCOL.md, Two
levels; docs/CONTROLLER.md, Two levels in software).

The file (``switchagg-ctl serve --two-level FILE``) names one UDP address per role; the controller
runs one embedded software aggregator on each, and a worker belongs to the leaf whose subnets hold
its IP:

spine: {listen: 127.0.0.254:48879}
leaves:
  - {name: rack0, listen: 127.0.1.254:48879, subnets: [127.0.1.0/24]}
  - {name: rack1, listen: 127.0.2.254:48879, subnets: [127.0.2.0/24], advertise: 127.0.2.254}

``advertise`` (optional): the IP told to the leaf's workers (default: the listen IP).

A node may also run elsewhere: a ``switchagg-aggregator --control ...`` on another host (a leaf in
its rack), which the controller reaches through that aggregator's control service
(docs/PROTOCOL.md, The software aggregator) instead of running it. ``listen`` then says where it
serves (checked against what it reports), ``control`` how to reach it and ``secret_file`` (relative
to this file) its shared secret:

  - {name: rack2, listen: 10.0.3.254:48879, subnets: [10.0.3.0/24],
     control: 10.0.0.13:50061, secret_file: rack2.secret}
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import yaml

from switchagg import protocol
from switchagg_controller import allocation
from switchagg_controller.dataplane import (
    CounterReading,
    CounterValue,
    DataPlaneError,
    job_counters,
    reconcile_jobs,
)
from switchagg_controller.model import Job, Remote, WorkerAddr
from switchagg_controller.topology import REMOTE_KEYS, TopologyError, _address, _Node, _remote, read_config

if TYPE_CHECKING:
    from switchagg.aggregator import AggregatorHandle

Address = tuple[str, int]
_T = TypeVar("_T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeafSpec:
    name: str
    listen: Address
    subnets: tuple[ipaddress.IPv4Network, ...]
    advertise: str = ""  # "" = the listen IP
    remote: Remote | None = None  # None: embedded in the controller


@dataclass(frozen=True)
class TwoLevelSpec:
    spine: Address
    leaves: tuple[LeafSpec, ...]
    spine_remote: Remote | None = None

    def leaf_of(self, ip: str) -> int | None:
        """The index of the leaf whose subnets hold ``ip``."""
        addr = ipaddress.IPv4Address(ip)
        return next((i for i, leaf in enumerate(self.leaves) if any(addr in s for s in leaf.subnets)), None)


def parse_two_level(text: str, source: str = "<two-level>", base: Path | None = None) -> TwoLevelSpec:
    """``base``: the directory relative secret_file paths start from (default: the working one)."""
    base = base if base is not None else Path()
    try:
        root_node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise TopologyError(f"{source}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if root_node is None:
        raise TopologyError(f"{source}:1: the file is empty")
    top = _Node(source, root_node, "").mapping(("spine", "leaves"))
    spine_f = top["spine"].mapping(("listen",), REMOTE_KEYS)
    spine = _address(spine_f["listen"])
    spine_remote = _remote(spine_f, base)
    leaves: list[LeafSpec] = []
    seen: dict[str, str] = {}
    for node in top["leaves"].sequence():
        f = node.mapping(("name", "listen", "subnets"), ("advertise", *REMOTE_KEYS))
        name = f["name"].text()
        subnets = []
        for s in f["subnets"].sequence():
            try:
                subnets.append(ipaddress.IPv4Network(s.text()))
            except ValueError:
                raise s.fail(f"{s.text()!r} is not an IPv4 subnet (a.b.c.d/len)") from None
        if not subnets:
            raise f["subnets"].fail("at least one subnet is needed")
        leaf = LeafSpec(
            name,
            _address(f["listen"]),
            tuple(subnets),
            f["advertise"].ipv4() if "advertise" in f else "",
            _remote(f, base),
        )
        for key in (f"name {name}", f"listen {leaf.listen}"):
            if key in seen or (key.startswith("listen") and leaf.listen == spine):
                raise node.fail(f"{key} is used twice")
            seen[key] = name
        for other in leaves:
            if any(a.overlaps(b) for a in leaf.subnets for b in other.subnets):
                raise f["subnets"].fail(f"overlaps the subnets of leaf {other.name!r}")
        leaves.append(leaf)
    if not leaves:
        raise top["leaves"].fail("at least one leaf is needed")
    return TwoLevelSpec(spine, tuple(leaves), spine_remote)


def load_two_level(path: str | Path) -> TwoLevelSpec:
    return parse_two_level(*read_config(path, "two-level file"), base=Path(path).parent)


def pool_key(node: str) -> str:
    return f"{allocation.TWO_LEVEL}:{node}"


SPINE = "spine"


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
            plane = f"{self.name}:{node}"
            try:
                c = agg.counters()
            except Exception as e:  # a remote node that is away: the others still answer
                reading.unavailable[plane] = str(e) or type(e).__name__
                continue
            out = [CounterValue(plane, "total", n, 0, int(c[n])) for n in ("rx", "tx")]
            out += [CounterValue(plane, "drops", n, 0, int(c["drops"][n])) for n in protocol.DROP_REASONS]
            reading.values += out + job_counters(plane, c)
        return reading

    def counter_values(self) -> list[CounterValue]:
        """The counters, here and now (tests; the job manager awaits ``counters``)."""
        return self._counters().values


def _secret(remote: Remote) -> str:
    try:
        secret = remote.secret_file.read_text().strip()
    except OSError as e:
        raise TopologyError(
            f"{remote.secret_file}: cannot read the secret of {remote.control}: {e.strerror}"
        ) from None
    if not secret:
        raise TopologyError(f"{remote.secret_file}: the secret of {remote.control} is empty")
    return secret


def open_node(name: str, listen: Address, remote: Remote | None) -> tuple[AggregatorHandle, str | None]:
    """One software aggregator: embedded (started here), or remote (reached through its control
    service), with a warning when that one is not reachable yet (its jobs install once it is:
    NodeWatch). A remote one serving elsewhere than its ``listen`` is an error."""
    from switchagg.aggregator import SoftwareAggregator
    from switchagg.aggregator_control import ControlError, RemoteAggregator

    if remote is None:
        return SoftwareAggregator(*listen).start(), None
    agg = RemoteAggregator(remote.control, _secret(remote), timeout=2.0, address=listen)
    try:
        info = agg.info()
    except ControlError as e:
        return agg, f"the {name} aggregator is not reachable yet: {e}"
    if (info.ip, info.udp_port) != listen:
        agg.close()
        raise TopologyError(
            f"the {name} aggregator at {remote.control} serves on {info.ip}:{info.udp_port}, "
            f"not on its listen address {listen[0]}:{listen[1]}"
        )
    return agg, None


def open_all(roles: list[tuple[str, Address, Remote | None]]) -> tuple[list[AggregatorHandle], list[str]]:
    """``open_node`` for each (name, listen, remote), in order; on an error none stays open."""
    nodes: list[AggregatorHandle] = []
    warnings: list[str] = []
    try:
        for name, listen, remote in roles:
            agg, warning = open_node(name, listen, remote)
            nodes.append(agg)
            if warning:
                warnings.append(warning)
    except Exception:
        close_nodes(nodes)
        raise
    return nodes, warnings


def open_nodes(spec: TwoLevelSpec) -> tuple[list[AggregatorHandle], list[str]]:
    """The spine's and each leaf's aggregator, in that order (``open_node``), and the warnings."""
    return open_all(
        [(SPINE, spec.spine, spec.spine_remote), *((f.name, f.listen, f.remote) for f in spec.leaves)]
    )


def close_nodes(nodes: list[AggregatorHandle]) -> None:
    from switchagg.aggregator import SoftwareAggregator
    from switchagg.aggregator_control import RemoteAggregator

    for agg in nodes:
        if isinstance(agg, SoftwareAggregator):
            agg.stop()  # embedded: the controller's own
        elif isinstance(agg, RemoteAggregator):
            agg.close()  # remote: only our channel to it


class NodeWatch:
    """Watches the remote aggregators through their Info call: ``poll()`` returns the indices (0
    the spine, l+1 leaf l) of those that restarted (a new boot id: their jobs are gone) or are
    reachable again since the last poll (they may hold jobs removed meanwhile)."""

    def __init__(self, nodes: list[AggregatorHandle]) -> None:
        from switchagg.aggregator_control import RemoteAggregator

        self._remote = {i: a for i, a in enumerate(nodes) if isinstance(a, RemoteAggregator)}
        self._boot: dict[int, str] = {}
        self.up: dict[int, bool] = {i: False for i in self._remote}
        for i in self._remote:  # the ones reachable now are as open_nodes found them
            boot = self._boot_id(i)
            if boot is not None:
                self._boot[i] = boot

    def _boot_id(self, i: int) -> str | None:
        from switchagg.aggregator_control import ControlError

        try:
            boot = self._remote[i].info().boot_id
        except ControlError:
            self.up[i] = False
            return None
        self.up[i] = True
        return boot

    def poll(self) -> list[int]:
        """The remote nodes to reconcile: restarted (a new boot id), or reachable again."""
        changed = []
        for i in self._remote:
            was_up = self.up[i]
            boot = self._boot_id(i)
            if boot is None:
                continue
            if self._boot.get(i) != boot or not was_up:
                changed.append(i)
                self._boot[i] = boot
        return changed


WATCH_INTERVAL_S = 1.0


class NodeSupervisor:
    """Polls the remote aggregators (NodeWatch) and hands each one that restarted or came back
    to ``on_restart(node)``, which reconciles its jobs (TwoLevelDataPlane.reconcile). A task on the
    controller's loop; each poll is blocking gRPC, so it runs in a worker thread."""

    def __init__(
        self,
        watch: NodeWatch,
        on_restart: Callable[[int], Awaitable[None]],
        interval: float = WATCH_INTERVAL_S,
    ):
        self.watch, self.on_restart, self.interval = watch, on_restart, interval
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            for node in await asyncio.to_thread(self.watch.poll):
                try:
                    await self.on_restart(node)
                except Exception:  # keep watching: the next restart must still be handled
                    log.exception("reinstalling the jobs of two-level node %d failed", node)

    def start(self) -> NodeSupervisor:
        """Call it on the loop."""
        self._task = asyncio.create_task(self._run(), name="switchagg-node-watch")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
