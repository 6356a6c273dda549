"""Plain data shared by the controller's parts: topology, jobs, and switch entries.

The P4-specific mapping from these to table entries lives in p4_program.py; p4rt.py applies
TableEntry and MulticastGroup objects (through finsy) without knowing what they mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MatchValue = int | bytes | tuple[int, int]  # exact/ternary value, or (value, mask) / (value, prefix_len)


@dataclass(frozen=True)
class HostPort:
    """A host cabled to a switch port."""

    name: str
    port: int
    mac: str  # "02:00:00:00:00:01"
    ip: str  # "10.0.0.1"


@dataclass(frozen=True)
class Uplink:
    """A leaf switch's cable to its spine (two-level aggregation, docs/PROTOCOL.md): a P4 switch,
    or a software spine (then ``spine_port`` is None: its port is no table entry of ours)."""

    switch: str  # the spine's name in the topology
    port: int  # the leaf's port towards the spine
    spine_port: int | None  # the spine switch's port towards the leaf


@dataclass(frozen=True)
class Remote:
    """A software aggregator the controller does not run: a switchagg-aggregator with a control
    service (switchagg.aggregator_control), reached at ``control`` with the secret in ``secret_file``."""

    control: str  # HOST:PORT or unix:PATH
    secret_file: Path


@dataclass(frozen=True)
class SoftwareSpine:
    """A software aggregator as the spine of P4 leaves: the leaves address their partials to
    ``aggregator_mac``/``aggregator_ip``:``udp_port`` (where it listens); embedded in the
    controller, or ``remote``."""

    name: str
    aggregator_ip: str
    udp_port: int
    aggregator_mac: str
    remote: Remote | None = None

    @property
    def listen(self) -> tuple[str, int]:
        return (self.aggregator_ip, self.udp_port)


@dataclass(frozen=True)
class Network:
    """A topology file's P4 switches and the software spines their leaves may name."""

    switches: list[Topology]
    software_spines: list[SoftwareSpine] = field(default_factory=list)


@dataclass(frozen=True)
class Topology:
    """One switch of the declarative input of switchagg-ctl, with the hosts cabled to it (see
    topology.py for the file format: one switch, or a list of them)."""

    switch_address: str  # gRPC "host:port" of the P4Runtime server
    device_id: int
    hosts: tuple[HostPort, ...]
    aggregator_ip: str  # the address workers send aggregation packets to
    aggregator_mac: str  # the source MAC the switch puts on results
    udp_port: int = 48879
    cpu_port: int = 255
    election_id: tuple[int, int] = (0, 1)  # (high, low); must be non-zero
    name: str = "s1"  # the switch's name in logs and in a topology of several switches
    uplink: Uplink | None = None  # a leaf: its spine; a job across leaves of one spine runs on all

    def host_by_ip(self, ip: str) -> HostPort | None:
        return next((h for h in self.hosts if h.ip == ip), None)


@dataclass(frozen=True)
class WorkerAddr:
    """Where one rank's packets come from and its results go to."""

    rank: int
    ip: str
    udp_port: int
    mac: str = ""  # filled from the topology for the P4 switch
    switch_port: int = -1  # ingress port on the P4 switch; -1 for the software aggregator


@dataclass(frozen=True)
class JobShard:
    """One shard of a job striped across reducers (docs/PROTOCOL.md, Striping): its node, its slot
    range there, its result key and each rank's UDP port for it (rank order), and each rank's IP
    for it where a worker has one per rail (() : the job's workers' IPs)."""

    node: str
    slot_base: int
    slot_count: int
    key: int
    ports: tuple[int, ...]
    ips: tuple[str, ...] = ()


@dataclass(frozen=True)
class Job:
    """One aggregation job as installed on a data plane."""

    job_id: int  # 16-bit id in the packet header
    name: str
    n: int  # world size
    slot_base: int
    slot_count: int
    k: int
    generation: int  # non-zero, changes on every (re)installation
    workers: tuple[WorkerAddr, ...] = field(default_factory=tuple)
    counter_index: int = 0  # index into the P4 per-job counter arrays
    # The result key (docs/PROTOCOL.md): random, non-zero, 32 bits, set when the controller creates
    # the job and kept for its whole life (new generations, controller restarts); every RESULT of
    # its data plane carries it, and the workers (told it by Join) drop any other. 0: unkeyed.
    key: int = 0
    # A job striped across reducers: one entry per shard, in shard order (workers, slot_base,
    # slot_count and key above are shard 0's); () for a job on one aggregation node (per level).
    shards: tuple[JobShard, ...] = ()


@dataclass(frozen=True)
class TableEntry:
    """A P4Runtime table entry by P4Info names, e.g. table="MyIngress.job_table"."""

    table: str
    match: tuple[tuple[str, MatchValue], ...]  # (field name, value), e.g. (("hdr.agg.job", 7),)
    action: str
    params: tuple[tuple[str, int | bytes], ...] = ()
    priority: int = 0

    @property
    def key(self) -> tuple[str, tuple[tuple[str, MatchValue], ...], int]:
        return (self.table, self.match, self.priority)


@dataclass(frozen=True)
class MulticastGroup:
    group_id: int
    replicas: tuple[tuple[int, int], ...]  # (egress port, instance); instance = rank for jobs


@dataclass
class SwitchState:
    """Everything the controller wants on the switch; applied as a whole, idempotently."""

    entries: list[TableEntry] = field(default_factory=list)
    groups: list[MulticastGroup] = field(default_factory=list)
