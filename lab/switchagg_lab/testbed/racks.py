"""Several racks on one host, for two-level aggregation (docs/PROTOCOL.md, Two levels).

Rack l has ``racks[l]`` worker namespaces ``<prefix>h<i>`` (global index i, ``eth0`` with IPv4
10.212.<l+1>.<j+1>/24) cabled to ports of its leaf namespace ``<prefix>l<l>``, whose bridge
``br0`` holds the leaf's worker-side address 10.212.<l+1>.254. Each leaf's uplink ``up0``
(10.212.0.<l+1>/24) is cabled to port ``u<l>`` of the spine namespace ``<prefix>sp``, whose bridge
holds 10.212.0.254. Leaves forward IP between their two sides and the spine routes to every rack,
so worker-to-worker traffic (gloo, rendezvous) crosses the uplinks as aggregation does. Worker
links and uplinks are capped separately (an uplink below the worker links is the oversubscribed
fabric hierarchical aggregation is for).

Nothing is routed outside the namespaces. Testbeds are named by the pid of the process that built
them; the next one sweeps those whose process is gone. One given a ``prefix`` (switchagg-testbed
up --racks) lives until ``remove(prefix)``.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass

from switchagg import protocol
from switchagg_lab.testbed import netns
from switchagg_lab.testbed.netns import Endpoint, sh

SPINE_IP = "10.212.0.254"
_PREFIX = re.compile(r"^sar(\d+)x\d+(sp|l\d+|h\d+)$")
NAMES = r"(sp|l\d+|h\d+)"  # a racks testbed's namespaces after its prefix
_counter = itertools.count(1)
MAX_RACKS = 8


def remove(prefix: str) -> list[str]:
    """Removes every namespace and leftover link of the racks testbed ``prefix``."""
    return netns.remove_matching(re.compile(rf"^{re.escape(prefix)}{NAMES}$"))


def rack_ip(rack: int, host: int) -> str:
    """Host ``host`` (254: the leaf) in rack ``rack``'s subnet."""
    return f"10.212.{rack + 1}.{host}"


@dataclass(frozen=True)
class Leaf:
    index: int
    ns: str
    worker_ip: str  # what its workers send to
    uplink: Endpoint  # its ``up0``: the address the spine sees, and where uplink loss is injected

    @property
    def address(self) -> tuple[str, int]:
        return (self.worker_ip, protocol.UDP_PORT)

    @property
    def spine_view(self) -> tuple[str, int]:
        return (self.uplink.ip, protocol.UDP_PORT)


class Racks(netns.Bed):
    """Workers in racks behind leaves, leaves behind a spine; use as a context manager."""

    def __init__(
        self,
        racks: list[int],
        *,
        worker_mbit: float | None = None,
        uplink_mbit: float | None = None,
        mtu: int = 9000,
        prefix: str | None = None,
    ) -> None:
        if not 1 <= len(racks) <= MAX_RACKS or not all(1 <= n <= 32 for n in racks):
            raise ValueError(f"1..{MAX_RACKS} racks of 1..32 workers, not {racks}")
        self.racks = racks
        self.worker_mbit, self.uplink_mbit, self.mtu = worker_mbit, uplink_mbit, mtu
        self.owned = prefix is None  # named by this process: swept once it is gone
        self.prefix = prefix if prefix is not None else f"sar{os.getpid()}x{next(_counter)}"
        self.spine_ns = f"{self.prefix}sp"
        self.workers: list[Endpoint] = []
        self.rack_of: list[int] = []
        for rack, count in enumerate(racks):
            for j in range(count):
                i = len(self.workers)
                mac = f"02:5b:00:00:{rack + 1:02x}:{j + 1:02x}"
                peer = (f"{self.prefix}l{rack}", f"p{j + 1}")  # its leaf's bridge port (see start)
                self.workers.append(
                    Endpoint(i, f"{self.prefix}h{i}", mac, rack_ip(rack, j + 1), j + 1, peer=peer)
                )
                self.rack_of.append(rack)
        self.leaves = [
            Leaf(
                rack,
                f"{self.prefix}l{rack}",
                rack_ip(rack, 254),
                Endpoint(
                    rack,
                    f"{self.prefix}l{rack}",
                    f"02:5b:00:00:00:{rack + 1:02x}",
                    f"10.212.0.{rack + 1}",
                    0,
                    ifname="up0",
                    peer=(self.spine_ns, f"u{rack}"),
                ),
            )  # fmt: skip
            for rack in range(len(racks))
        ]
        self._made: list[str] = []

    def _ns(self, name: str) -> None:
        hosts = [(SPINE_IP, "spine")] + [(w.ip, f"h{w.index}") for w in self.workers]
        netns.add_netns(name, netns.hosts_text(hosts))  # torch looks its peers up
        self._made.append(name)

    def _bridge(self, ns: str, ip: str) -> None:
        sh("ip", "link", "add", "br0", "type", "bridge", ns=ns)
        sh("ip", "link", "set", "br0", "mtu", str(self.mtu), "up", ns=ns)
        sh("ip", "addr", "add", f"{ip}/24", "dev", "br0", ns=ns)

    def _cap(self, ns_a: str, if_a: str, ns_b: str, if_b: str, mbit: float | None) -> None:
        if mbit is not None:
            netns.cap_rate(ns_a, if_a, mbit)
            netns.cap_rate(ns_b, if_b, mbit)

    @property
    def endpoints(self) -> list[Endpoint]:
        """The workers (as Testbed.endpoints: what switchagg-testbed run starts commands in)."""
        return self.workers

    @property
    def n(self) -> int:
        return len(self.workers)

    def built(self) -> bool:
        return self.spine_ns in netns.namespaces()

    def link_stats(self) -> list[dict[str, dict[str, int]]]:
        """Per worker, then per leaf uplink: what the link's two qdiscs sent and dropped (``up`` =
        towards the leaf, or the spine)."""
        workers = [
            {
                "up": netns.link_stats(w.ns, w.ifname),
                "down": netns.link_stats(self.leaves[r].ns, f"p{w.port}"),
            }
            for w, r in zip(self.workers, self.rack_of, strict=True)
        ]
        uplinks = [
            {
                "up": netns.link_stats(leaf.ns, "up0"),
                "down": netns.link_stats(self.spine_ns, f"u{leaf.index}"),
            }
            for leaf in self.leaves
        ]
        return workers + uplinks

    def start(self) -> None:
        if self.owned:
            netns.sweep_dead_owners(_PREFIX)
        elif self.built():
            raise netns.TestbedError(f"testbed {self.prefix} exists already")
        self._ns(self.spine_ns)
        self._bridge(self.spine_ns, SPINE_IP)
        for leaf in self.leaves:
            self._ns(leaf.ns)
            self._bridge(leaf.ns, leaf.worker_ip)
            sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=leaf.ns)
            port = f"u{leaf.index}"
            netns.veth(port, self.spine_ns, "up0", leaf.ns, self.mtu)
            sh("ip", "link", "set", port, "master", "br0", ns=self.spine_ns)
            sh("ip", "link", "set", "up0", "address", leaf.uplink.mac, ns=leaf.ns)
            sh("ip", "addr", "add", f"{leaf.uplink.ip}/24", "dev", "up0", ns=leaf.ns)
            sh("ip", "route", "add", "default", "via", SPINE_IP, ns=leaf.ns)
            sh("ip", "route", "add", f"10.212.{leaf.index + 1}.0/24", "via", leaf.uplink.ip, ns=self.spine_ns)
            self._cap(self.spine_ns, port, leaf.ns, "up0", self.uplink_mbit)
        for w, rack in zip(self.workers, self.rack_of, strict=True):
            leaf = self.leaves[rack]
            self._ns(w.ns)
            port = f"p{w.port}"
            netns.veth(port, leaf.ns, w.ifname, w.ns, self.mtu)
            sh("ip", "link", "set", port, "master", "br0", ns=leaf.ns)
            sh("ip", "link", "set", w.ifname, "address", w.mac, ns=w.ns)
            sh("ip", "addr", "add", f"{w.ip}/24", "dev", w.ifname, ns=w.ns)
            sh("ip", "route", "add", "default", "via", leaf.worker_ip, ns=w.ns)
            self._cap(leaf.ns, port, w.ns, w.ifname, self.worker_mbit)

    def rank_addresses(self, rack: int, ranks: list[tuple[str, int]]) -> list[tuple[str, int] | None]:
        """A leaf's view of the job: the addresses of its rack's ranks, None for the others."""
        return [a if self.rack_of[r] == rack else None for r, a in enumerate(ranks)]

    def close(self) -> None:
        for name in reversed(self._made):
            netns.del_netns(name)
        self._made.clear()
