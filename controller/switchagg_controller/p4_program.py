"""The mapping from topology and jobs to p4/switchagg.p4's tables: the only module that knows P4 names.

Everything returned here is plain model data; p4rt.py writes it to the switch (through finsy).
Matches and parameters are ints (MACs and IPv4 addresses as their integer value); the client
encodes them to the bit widths in the P4Info.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from switchagg import protocol

from .model import Job, MulticastGroup, SoftwareSpine, SwitchState, TableEntry, Topology, WorkerAddr

_extracted = contextlib.ExitStack()  # artifacts taken out of a zipped install, for the process
atexit.register(_extracted.close)


def _artifact(name: str) -> Path:
    """p4c's output, package data: controller/switchagg_controller/p4/ links to p4/build (the one
    copy, what p4c writes), a wheel carries the files themselves."""
    resource = resources.files("switchagg_controller") / "p4" / name
    if isinstance(resource, Path):
        return resource
    return _extracted.enter_context(resources.as_file(resource))


BMV2_JSON = _artifact("switchagg.json")
P4INFO = _artifact("switchagg.p4info.txtpb")
P4_SOURCE = Path(__file__).resolve().parents[2] / "p4" / "switchagg.p4"  # the source tree only (tests)

# Table and action names, as in the P4Info.
L2_TABLE = "MyIngress.l2_forward"
AGGREGATOR_TABLE = "MyIngress.aggregator"
JOB_TABLE = "MyIngress.job_table"
WORKER_TABLE = "MyIngress.worker_table"
RESULT_TABLE = "MyEgress.result_dst"

# Counter arrays. DROP_COUNTER is indexed by protocol.DROP_INDEX, the job counters by Job.counter_index.
DROP_COUNTER = "MyIngress.drops"
JOB_COUNTER_NAMES = {name: f"MyIngress.{name}" for name in protocol.JOB_COUNTERS}
LEAF_COUNTER_NAMES = {
    name: f"MyIngress.{name}" for name in protocol.LEAF_COUNTERS
}  # a leaf's job counts these too
MAX_JOBS = 64  # size of the per-job counter arrays (MAX_JOBS in the P4 source)

# Register arrays (read with simple_switch_CLI; P4Runtime cannot read bmv2 registers).
REGISTERS = (
    "MyIngress.set_gen",
    "MyIngress.set_inc",
    "MyIngress.bitmap",
    "MyIngress.count",
    "MyIngress.max_exp",
    "MyIngress.values",
    "MyIngress.round_call",
    "MyIngress.round_total",
    "MyIngress.round_offset",
    "MyIngress.round_flags",
    "MyIngress.poison",
    "MyIngress.final",
)

BROADCAST_MAC = "ff:ff:ff:ff:ff:ff"
BROADCAST_GROUP = 1  # L2 flood to every host port
JOB_GROUP_BASE = 0x100  # a job's result group is JOB_GROUP_BASE + its counter index


class ProgramError(ValueError):
    """A job or topology cannot be expressed on the P4 switch; the message says why."""


def mac_int(mac: str) -> int:
    parts = mac.split(":")
    if len(parts) != 6 or not all(len(p) == 2 for p in parts):
        raise ProgramError(f"bad MAC address {mac!r}")
    try:
        return int("".join(parts), 16)
    except ValueError:
        raise ProgramError(f"bad MAC address {mac!r}") from None


def ip_int(ip: str) -> int:
    try:
        return int(ipaddress.IPv4Address(ip))
    except ValueError:
        raise ProgramError(f"bad IPv4 address {ip!r}") from None


@dataclass(frozen=True)
class LeafRole:
    """A job aggregated on this switch as leaf ``index`` of two levels (docs/PROTOCOL.md, Two
    levels): the job's ``workers`` are its local ranks only; partials leave on ``up_port`` to the
    spine's address, whose RESULTs alone are accepted from there."""

    index: int  # this leaf's rank at the spine
    up_port: int
    spine_mac: str
    spine_ip: str
    spine_udp_port: int = protocol.UDP_PORT


def leaf_view(job: Job, leaf: Topology, spine: Topology | SoftwareSpine, index: int) -> tuple[Job, LeafRole]:
    """Leaf ``index`` of a two-level job: its local ranks, and its uplink to the spine's aggregator
    (a P4 switch's, or a software spine's)."""
    if leaf.uplink is None or leaf.uplink.switch != spine.name:
        raise ProgramError(f"switch {leaf.name} has no uplink to {spine.name}")
    local = tuple(w for w in job.workers if leaf.host_by_ip(w.ip) is not None)
    role = LeafRole(index, leaf.uplink.port, spine.aggregator_mac, spine.aggregator_ip, spine.udp_port)
    return replace(job, workers=local), role


def spine_view(job: Job, leaves: list[Topology]) -> Job:
    """The spine's job: rank l is leaf l (its aggregator address, the UDP source of its partials,
    on the spine's port of its uplink: none for a software spine)."""
    ranks = []
    for index, leaf in enumerate(leaves):
        if leaf.uplink is None:
            raise ProgramError(f"switch {leaf.name} has no uplink")
        ranks.append(
            WorkerAddr(
                index,
                leaf.aggregator_ip,
                leaf.udp_port,
                leaf.aggregator_mac,
                -1 if leaf.uplink.spine_port is None else leaf.uplink.spine_port,
            )  # fmt: skip
        )
    return replace(job, n=len(leaves), workers=tuple(ranks))


def job_group(job: Job) -> int:
    return JOB_GROUP_BASE + job.counter_index


def l2_entries(topology: Topology) -> list[TableEntry]:
    """Unicast by destination MAC to each host's port, broadcast floods, and the aggregator address."""
    entries = [
        TableEntry(L2_TABLE, (("dst_mac", mac_int(h.mac)),), "MyIngress.l2_unicast", (("port", h.port),))
        for h in topology.hosts
    ]
    entries.append(
        TableEntry(
            L2_TABLE,
            (("dst_mac", mac_int(BROADCAST_MAC)),),
            "MyIngress.l2_broadcast",
            (("group", BROADCAST_GROUP),),
        )
    )
    entries.append(
        TableEntry(
            AGGREGATOR_TABLE,
            (("dst_ip", ip_int(topology.aggregator_ip)),),
            "MyIngress.to_aggregator",
            (("mac", mac_int(topology.aggregator_mac)),),
        )
    )
    return entries


def l2_groups(topology: Topology) -> list[MulticastGroup]:
    ports = sorted({h.port for h in topology.hosts})
    return [MulticastGroup(BROADCAST_GROUP, tuple((p, 0) for p in ports))] if ports else []


def _resolve_worker(w: WorkerAddr, topology: Topology) -> tuple[int, str]:
    """The (switch port, MAC) of a rank, taken from the topology where the job leaves them out."""
    host = topology.host_by_ip(w.ip)
    port, mac = w.switch_port, w.mac
    if port < 0 or not mac:
        if host is None:
            raise ProgramError(
                f"rank {w.rank}: {w.ip} is not a host in the topology, so its switch port is unknown"
            )
        port = host.port if port < 0 else port
        mac = mac or host.mac
    if not 0 <= port < 511:
        raise ProgramError(f"rank {w.rank}: switch port {port} is outside 0..510")
    return port, mac


def validate_job(job: Job, leaf: LeafRole | None = None) -> None:
    """Refuses jobs the P4 program cannot run, with the reason."""
    if not 0 <= job.job_id <= 0xFFFF:
        raise ProgramError(f"job id {job.job_id} is not a 16-bit number")
    if job.k != protocol.P4_K:
        raise ProgramError(
            f"job {job.job_id}: the P4 switch has K = {protocol.P4_K}, the job asks for {job.k}"
        )
    if not 1 <= job.n <= protocol.MAX_WORKERS:
        raise ProgramError(f"job {job.job_id}: {job.n} workers is outside 1..{protocol.MAX_WORKERS}")
    if job.slot_count < 1 or job.slot_base < 0 or job.slot_base + job.slot_count > protocol.P4_NUM_SLOTS:
        raise ProgramError(
            f"job {job.job_id}: slots {job.slot_base}+{job.slot_count} are outside the pool "
            f"0..{protocol.P4_NUM_SLOTS - 1}"
        )
    if not 1 <= job.generation <= 0xFFFF:
        raise ProgramError(f"job {job.job_id}: generation {job.generation} is not a non-zero 16-bit number")
    if not 0 <= job.key <= 0xFFFFFFFF:
        raise ProgramError(f"job {job.job_id}: result key {job.key} is not a 32-bit number")
    if not 0 <= job.counter_index < MAX_JOBS:
        raise ProgramError(
            f"job {job.job_id}: counter index {job.counter_index} is outside 0..{MAX_JOBS - 1}"
        )
    ranks = sorted(w.rank for w in job.workers)
    if leaf is None and ranks != list(range(job.n)):
        raise ProgramError(
            f"job {job.job_id}: needs exactly one address for each rank 0..{job.n - 1}, has {ranks}"
        )
    if leaf is not None:
        _validate_leaf(job, leaf, ranks)


def _validate_leaf(job: Job, leaf: LeafRole, ranks: list[int]) -> None:
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < job.n for r in ranks):
        raise ProgramError(
            f"job {job.job_id}: a leaf needs one address for each of its local ranks, "
            f"some of 0..{job.n - 1}, has {ranks}"
        )
    if not 0 <= leaf.index < protocol.MAX_WORKERS:
        raise ProgramError(
            f"job {job.job_id}: leaf index {leaf.index} is outside 0..{protocol.MAX_WORKERS - 1}"
        )
    if not 0 <= leaf.up_port < 511:
        raise ProgramError(f"job {job.job_id}: upstream port {leaf.up_port} is outside 0..510")
    if not 0 < leaf.spine_udp_port <= 0xFFFF:
        raise ProgramError(f"job {job.job_id}: bad spine UDP port {leaf.spine_udp_port}")


def _job_entry(job: Job, group: int, leaf: LeafRole | None) -> TableEntry:
    common = (
        ("mgrp", group),
        ("slot_base", job.slot_base),
        ("slot_count", job.slot_count),
        ("generation", job.generation),
        ("counter_index", job.counter_index),
    )
    if leaf is None:
        return TableEntry(
            JOB_TABLE, (("job", job.job_id),), "MyIngress.set_job", (("n", job.n), *common, ("key", job.key))
        )
    local = sorted(w.rank for w in job.workers)
    return TableEntry(
        JOB_TABLE,
        (("job", job.job_id),),
        "MyIngress.set_leaf_job",
        (
            ("n", job.n),
            ("m", len(local)),
            ("first_local", local[0]),
            ("leaf_index", leaf.index),
            *common,
            ("up_port", leaf.up_port),
            ("spine_mac", mac_int(leaf.spine_mac)),
            ("spine_ip", ip_int(leaf.spine_ip)),
            ("spine_udp_port", leaf.spine_udp_port),
            ("key", job.key),
        ),
    )


def job_state(
    job: Job, topology: Topology, leaf: LeafRole | None = None
) -> tuple[list[TableEntry], list[MulticastGroup]]:
    """The entries and the result multicast group of one job (as a leaf: of its local ranks)."""
    validate_job(job, leaf)
    group = job_group(job)
    entries = [_job_entry(job, group, leaf)]
    replicas = []
    for w in sorted(job.workers, key=lambda w: w.rank):
        port, mac = _resolve_worker(w, topology)
        if not 0 < w.udp_port <= 0xFFFF:
            raise ProgramError(f"job {job.job_id} rank {w.rank}: bad UDP port {w.udp_port}")
        entries.append(
            TableEntry(
                WORKER_TABLE,
                (("job", job.job_id), ("rank", w.rank)),
                "MyIngress.set_worker",
                (("port", port), ("ip", ip_int(w.ip)), ("udp_port", w.udp_port)),
            )
        )
        entries.append(
            TableEntry(
                RESULT_TABLE,
                (("job", job.job_id), ("rank", w.rank)),
                "MyEgress.set_result_dst",
                (("mac", mac_int(mac)), ("ip", ip_int(w.ip)), ("udp_port", w.udp_port)),
            )
        )
        replicas.append((port, w.rank))  # instance = rank: egress maps it to the rank's address
    return entries, [MulticastGroup(group, tuple(replicas))]


def desired_state(
    topology: Topology, jobs: list[Job] | tuple[Job, ...], leaves: Mapping[int, LeafRole] | None = None
) -> SwitchState:
    """The whole switch configuration for these jobs; refuses jobs that collide. ``leaves`` (by
    job id): the jobs this switch aggregates as a leaf of two levels."""
    leaves = leaves or {}
    if unknown := sorted(set(leaves) - {j.job_id for j in jobs}):
        raise ProgramError(f"leaf roles for jobs that are not installed: {unknown}")
    state = SwitchState(entries=l2_entries(topology), groups=l2_groups(topology))
    ids: set[int] = set()
    counters: set[int] = set()
    used: list[tuple[int, int, int]] = []
    for job in jobs:
        if job.job_id in ids:
            raise ProgramError(f"job id {job.job_id} is installed twice")
        if job.counter_index in counters:
            raise ProgramError(f"job {job.job_id}: counter index {job.counter_index} is used by another job")
        for base, count, other in used:
            if job.slot_base < base + count and base < job.slot_base + job.slot_count:
                raise ProgramError(f"job {job.job_id}: slots overlap those of job {other}")
        ids.add(job.job_id)
        counters.add(job.counter_index)
        used.append((job.slot_base, job.slot_count, job.job_id))
        entries, groups = job_state(job, topology, leaves.get(job.job_id))
        state.entries.extend(entries)
        state.groups.extend(groups)
    return state
