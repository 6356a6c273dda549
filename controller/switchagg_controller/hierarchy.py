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
"""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from switchagg import protocol
from switchagg_controller import allocation
from switchagg_controller.dataplane import CounterValue, DataPlaneError, job_counters
from switchagg_controller.model import Job, WorkerAddr
from switchagg_controller.topology import TopologyError, _Node, read_config

if TYPE_CHECKING:
    from switchagg.aggregator import SoftwareAggregator

Address = tuple[str, int]


@dataclass(frozen=True)
class LeafSpec:
    name: str
    listen: Address
    subnets: tuple[ipaddress.IPv4Network, ...]
    advertise: str = ""  # "" = the listen IP


@dataclass(frozen=True)
class TwoLevelSpec:
    spine: Address
    leaves: tuple[LeafSpec, ...]

    def leaf_of(self, ip: str) -> int | None:
        """The index of the leaf whose subnets hold ``ip``."""
        addr = ipaddress.IPv4Address(ip)
        return next((i for i, leaf in enumerate(self.leaves) if any(addr in s for s in leaf.subnets)), None)


def _address(node: _Node) -> Address:
    host, sep, port = node.text().rpartition(":")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise node.fail(f"{node.text()!r} is not an IPv4:port address") from None
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:  # 0: a free port
        raise node.fail(f"{node.text()!r} is not an IPv4:port address")
    return (host, int(port))


def parse_two_level(text: str, source: str = "<two-level>") -> TwoLevelSpec:
    try:
        root_node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise TopologyError(f"{source}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if root_node is None:
        raise TopologyError(f"{source}:1: the file is empty")
    top = _Node(source, root_node, "").mapping(("spine", "leaves"))
    spine = _address(top["spine"].mapping(("listen",))["listen"])
    leaves: list[LeafSpec] = []
    seen: dict[str, str] = {}
    for node in top["leaves"].sequence():
        f = node.mapping(("name", "listen", "subnets"), ("advertise",))
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
            name, _address(f["listen"]), tuple(subnets), f["advertise"].ipv4() if "advertise" in f else ""
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
    return TwoLevelSpec(spine, tuple(leaves))


def load_two_level(path: str | Path) -> TwoLevelSpec:
    return parse_two_level(*read_config(path, "two-level file"))


def pool_key(node: str) -> str:
    return f"{allocation.TWO_LEVEL}:{node}"


SPINE = "spine"


class TwoLevelDataPlane:
    """Jobs on software leaves and a software spine. A job takes one slot range free on the spine
    and on every leaf it crosses; on each leaf it is installed with the job's total n, the local
    ranks' addresses, upstream = the spine, leaf_index = the leaf's position among the job's
    leaves; on the spine with n = that many leaves and rank l = leaf l's address."""

    name = allocation.TWO_LEVEL

    def __init__(
        self,
        spec: TwoLevelSpec,
        spine: SoftwareAggregator,
        leaves: list[SoftwareAggregator],
        k: int = protocol.DEFAULT_SW_K,
        default_slots: int = protocol.DEFAULT_SW_SLOTS,
    ) -> None:
        if len(leaves) != len(spec.leaves):
            raise ValueError(f"{len(spec.leaves)} leaves in the spec, {len(leaves)} aggregators")
        self.spec, self.spine, self.leaves = spec, spine, leaves
        self.k, self.default_slots = k, default_slots
        self._installed: set[int] = set()
        self._lock = threading.Lock()

    @property
    def aggregator(self) -> tuple[str, int]:
        return self.spine.address

    def _leaf_of(self, ip: str) -> int:
        leaf = self.spec.leaf_of(ip)
        if leaf is None:
            raise DataPlaneError(f"{ip} is behind no leaf of the two-level topology")
        return leaf

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

    def _nodes(self, job: Job) -> list[SoftwareAggregator]:
        return [self.spine, *(self.leaves[i] for i in self.job_leaves(job.workers))]

    def install(self, job: Job) -> None:
        leaves = self.job_leaves(job.workers)
        ranks = sorted(job.workers, key=lambda w: w.rank)
        with self._lock:
            if job.job_id in self._installed:  # a reinstall with a new generation
                self._remove_locked(job)
            done: list[SoftwareAggregator] = []
            try:
                # The spine first: a leaf's first partial must find its job there.
                views = [self.leaves[i].address for i in leaves]
                self.spine.add_job(
                    job.job_id, len(leaves), job.slot_base, job.slot_count, job.k, job.generation, views,
                    name=job.name,
                )  # fmt: skip
                done.append(self.spine)
                for position, i in enumerate(leaves):
                    addrs = [(w.ip, w.udp_port) if self.spec.leaf_of(w.ip) == i else None for w in ranks]
                    self.leaves[i].add_job(
                        job.job_id, job.n, job.slot_base, job.slot_count, job.k, job.generation, addrs,
                        name=job.name, upstream=self.spine.address, leaf_index=position,
                    )  # fmt: skip
                    done.append(self.leaves[i])
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
            agg.remove_job(job.job_id)

    def remove(self, job: Job) -> None:
        with self._lock:
            if job.job_id in self._installed:
                self._remove_locked(job)

    def restore(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.install(job)

    def counters(self) -> list[CounterValue]:
        out = []
        named = [
            (SPINE, self.spine),
            *((s.name, a) for s, a in zip(self.spec.leaves, self.leaves, strict=True)),
        ]
        for node, agg in named:
            plane = f"{self.name}:{node}"
            c = agg.counters()
            out += [CounterValue(plane, "total", n, 0, int(c[n])) for n in ("rx", "tx")]
            out += [CounterValue(plane, "drops", n, 0, int(c["drops"][n])) for n in protocol.DROP_REASONS]
            out += job_counters(plane, c)
        return out
