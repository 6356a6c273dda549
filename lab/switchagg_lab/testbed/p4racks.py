"""Racks of bmv2 leaves behind a spine (bmv2 or the software aggregator), for two-level aggregation
with the P4 leaf role (docs/PROTOCOL.md, Two levels).

Rack l has ``racks[l]`` worker namespaces ``<prefix>h<i>`` (global index i, ``eth0`` with IPv4
10.213.<l+1>.<j+1>/24) cabled to port j+1 of leaf l, a simple_switch_grpc in namespace
``<prefix>l<l>`` whose aggregator address is 10.213.<l+1>.254. The leaf's port UPLINK_PORT
(interface ``up0``) is cabled to port l+1 (interface ``u<l>``) of the spine namespace
``<prefix>sp``: there either a second simple_switch_grpc (aggregator address SPINE_IP) or a Linux
bridge holding SPINE_IP, for a software spine (``switchagg-aggregator``) in that namespace.

Only aggregation traffic crosses the uplinks (the leaves' L2 tables know their own rack). Loss is
injected with nftables on the egress hook of every veth end: the ingress hook runs after bmv2's
packet socket has taken its copy, egress runs before the frame is on the wire.
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path
from typing import Any

from switchagg import protocol
from switchagg_lab.testbed import netns
from switchagg_lab.testbed.bmv2 import Bmv2Switch
from switchagg_lab.testbed.netns import Endpoint, sh

SPINE_IP = "10.213.0.254"
SPINE_MAC = "02:5c:00:00:00:fe"
UPLINK_PORT = 100  # a leaf's port towards the spine
SPINES = ("bmv2", "soft")
_PREFIX = re.compile(r"^sap(\d+)x\d+(sp|l\d+|h\d+)$")
_counter = itertools.count(1)


def leaf_ip(rack: int) -> str:
    return f"10.213.{rack + 1}.254"


def leaf_mac(rack: int) -> str:
    return f"02:5c:00:00:{rack + 1:02x}:fe"


def _offload_off(ns: str, ifname: str) -> None:
    """Kernel checksum offload would hand bmv2 frames with unfinished checksums."""
    sh("ethtool", "-K", ifname, "tx", "off", "rx", "off", "sg", "off", ns=ns, check=False)


def egress_loss(ns: str, ifname: str, percent: int) -> None:
    """Drops ``percent``% of the aggregation packets leaving ``ifname`` (0: none). On an uplink
    both directions go to port 48879: partials to the spine's, results to the leaf's."""
    table = f"saloss_{ifname}"
    sh("nft", f"delete table netdev {table}", ns=ns, check=False)
    if percent == 0:
        return
    port = protocol.UDP_PORT
    rules = (
        f"table netdev {table} {{\n"
        f"  chain outbound {{\n    type filter hook egress device {ifname} priority 0;\n"
        "    policy accept;\n"
        f"    udp dport {port} numgen random mod 100 < {percent} counter drop\n  }}\n"
        "}\n"
    )
    sh("nft", "-f", "-", ns=ns, stdin=rules, timeout=30)


def egress_lost(ns: str, ifname: str) -> int:
    out = sh("nft", f"list table netdev saloss_{ifname}", ns=ns, check=False)
    return sum(int(n) for n in re.findall(r"counter packets (\d+)", out))


class P4Racks(netns.Bed):
    """bmv2 leaves with their workers, a bmv2 or software spine; use as a context manager."""

    def __init__(self, racks: list[int], workdir: Path, *, spine: str = "bmv2") -> None:
        if not 1 <= len(racks) <= 8 or not all(1 <= n <= 31 for n in racks):
            raise ValueError(f"1..8 racks of 1..31 workers, not {racks}")
        if spine not in SPINES:
            raise ValueError(f"the spine is one of {', '.join(SPINES)}, not {spine!r}")
        self.racks, self.spine_kind, self.workdir = racks, spine, workdir
        self.prefix = f"sap{os.getpid()}x{next(_counter)}"
        self.spine_ns = f"{self.prefix}sp"
        self.leaf_ns = [f"{self.prefix}l{rack}" for rack in range(len(racks))]
        self.workers: list[Endpoint] = []
        self.rack_of: list[int] = []
        for rack, count in enumerate(racks):
            for j in range(count):
                i = len(self.workers)
                mac = f"02:5c:00:00:{rack + 1:02x}:{j + 1:02x}"
                self.workers.append(
                    Endpoint(i, f"{self.prefix}h{i}", mac, f"10.213.{rack + 1}.{j + 1}", j + 1)
                )
                self.rack_of.append(rack)
        self.leaves = [
            Bmv2Switch(
                ns,
                [
                    *(
                        (w.port, f"p{w.port}")
                        for w, r in zip(self.workers, self.rack_of, strict=True)
                        if r == rack
                    ),
                    (UPLINK_PORT, "up0"),
                ],
                workdir / f"leaf{rack}",
            )  # fmt: skip
            for rack, ns in enumerate(self.leaf_ns)
        ]
        ports = [(rack + 1, f"u{rack}") for rack in range(len(racks))]
        self.spine = Bmv2Switch(self.spine_ns, ports, workdir / "spine") if spine == "bmv2" else None
        self._made: list[str] = []

    def _ns(self, name: str) -> None:
        netns.add_netns(name)
        self._made.append(name)

    def start(self) -> None:
        netns.sweep_dead_owners(_PREFIX)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._ns(self.spine_ns)
        if self.spine is None:  # a software spine behind a Linux bridge
            sh("ip", "link", "add", "br0", "type", "bridge", ns=self.spine_ns)
            sh("ip", "link", "set", "br0", "address", SPINE_MAC, "up", ns=self.spine_ns)
            sh("ip", "addr", "add", f"{SPINE_IP}/24", "dev", "br0", ns=self.spine_ns)
            _offload_off(self.spine_ns, "br0")
        for rack, ns in enumerate(self.leaf_ns):
            self._ns(ns)
            netns.veth(f"u{rack}", self.spine_ns, "up0", ns, 1500)
            _offload_off(ns, "up0")
            _offload_off(self.spine_ns, f"u{rack}")
            if self.spine is None:
                sh("ip", "link", "set", f"u{rack}", "master", "br0", ns=self.spine_ns)
                # the software spine answers the leaf at its aggregator address, one hop away
                sh("ip", "route", "add", f"{leaf_ip(rack)}/32", "dev", "br0", ns=self.spine_ns)
                neigh = [
                    "ip",
                    "neigh",
                    "replace",
                    leaf_ip(rack),
                    "lladdr",
                    leaf_mac(rack),
                    "nud",
                    "permanent",
                ]
                sh(*neigh, "dev", "br0", ns=self.spine_ns)
        for w, rack in zip(self.workers, self.rack_of, strict=True):
            self._ns(w.ns)
            netns.veth(f"p{w.port}", self.leaf_ns[rack], w.ifname, w.ns, 1500)
            sh("ip", "link", "set", w.ifname, "address", w.mac, ns=w.ns)
            sh("ip", "addr", "add", f"{w.ip}/24", "dev", w.ifname, ns=w.ns)
            _offload_off(w.ns, w.ifname)
            _offload_off(self.leaf_ns[rack], f"p{w.port}")
        for sw in [*self.leaves, *([self.spine] if self.spine else [])]:
            sw.start()

    def rack_workers(self, rack: int) -> list[Endpoint]:
        return [w for w, r in zip(self.workers, self.rack_of, strict=True) if r == rack]

    def leaf_topology(self, rack: int) -> Any:
        """The controller's view of leaf ``rack`` (switchagg_controller.model.Topology)."""
        from switchagg_controller.model import Topology

        return Topology(
            switch_address=self.leaves[rack].grpc_address,
            device_id=0,
            hosts=tuple(w.host() for w in self.rack_workers(rack)),
            aggregator_ip=leaf_ip(rack),
            aggregator_mac=leaf_mac(rack),
        )

    def spine_topology(self) -> Any:
        """The bmv2 spine's view: each leaf is a host on its port, at its aggregator address."""
        from switchagg_controller.model import HostPort, Topology

        if self.spine is None:
            raise netns.TestbedError("the spine is the software aggregator, not a switch")
        return Topology(
            switch_address=self.spine.grpc_address,
            device_id=0,
            hosts=tuple(HostPort(f"leaf{r}", r + 1, leaf_mac(r), leaf_ip(r)) for r in range(len(self.racks))),
            aggregator_ip=SPINE_IP,
            aggregator_mac=SPINE_MAC,
        )

    def uplink_ends(self) -> list[tuple[str, str]]:
        """(namespace, interface) of both ends of every uplink."""
        return [
            end for rack, ns in enumerate(self.leaf_ns) for end in ((ns, "up0"), (self.spine_ns, f"u{rack}"))
        ]

    def set_uplink_loss(self, percent: int) -> None:
        for ns, ifname in self.uplink_ends():
            egress_loss(ns, ifname, percent)

    def uplink_lost(self) -> list[int]:
        """Packets the loss rules dropped so far, per uplink end (leaf side, spine side, ...)."""
        return [egress_lost(ns, ifname) for ns, ifname in self.uplink_ends()]

    def close(self) -> None:
        for sw in [*self.leaves, *([self.spine] if self.spine else [])]:
            sw.stop()
        for name in reversed(self._made):
            netns.del_netns(name)
        self._made.clear()
