"""A rack on one host: ``n`` worker namespaces, each cabled by a veth pair to a port of one switch
namespace, every link optionally capped in both directions.

Endpoint i lives in namespace ``<prefix>h<i>`` with ``eth0`` (MAC 02:5a:00:00:00:<i+1>, IPv4
10.201.0.<i+1>/24), cabled to interface ``p<i+1>`` (switch port i+1) of namespace ``<prefix>sw``.
The switch is one of:

* ``bmv2``: simple_switch_grpc owns the ports; it forwards L2 and aggregates (docs/PROTOCOL.md).
* ``soft``: a Linux bridge ``br0`` joins the ports and holds the aggregator's address, so the
  software aggregator (or a job service with one) runs in the switch namespace and worker-to-worker
  traffic (rendezvous, gloo) crosses the same capped links as aggregation does.

Nothing is routed outside the namespaces. Testbeds named by a pid (the default, for tests) are swept
by the next one when that process is gone; a named testbed (``switchagg-testbed``) lives until
``remove(prefix)``.
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path
from typing import Any

from switchagg_lab.testbed import netns
from switchagg_lab.testbed.bmv2 import Bmv2Switch
from switchagg_lab.testbed.netns import Endpoint, TestbedError, sh

AGG_IP = "10.201.0.254"
AGG_MAC = "02:5a:00:00:00:fe"
SUBNET = "10.201.0."
DATA_PLANES = ("bmv2", "soft")
MAX_ENDPOINTS = 32
_TEST_PREFIX = re.compile(r"^sab(\d+)x\d+(sw|h\d+|r\d+)$")  # sab<pid>x<n>...: owned by a (test) process
MAX_REDUCERS = 16
REDUCER_HOST = 101  # reducer host i is <subnet>.(101 + i): above any worker (at most 32)
_counter = itertools.count(1)


def remove(prefix: str) -> list[str]:
    """Removes every namespace and leftover link of the testbed ``prefix`` (and so its processes)."""
    return netns.remove_matching(re.compile(rf"^{re.escape(prefix)}(sw|h\d+|r\d+)$"))


class Testbed(netns.Bed):
    """``n`` endpoints around one switch; use as a context manager (or start()/close())."""

    def __init__(
        self,
        n: int,
        workdir: Path,
        *,
        data_plane: str = "bmv2",
        rate_mbit: float | None = None,
        mtu: int | None = None,
        prefix: str | None = None,
        device_id: int = 0,
        static_arp: bool = False,
        subnet: str = SUBNET,
        reducers: int = 0,
    ) -> None:
        """``subnet`` ("10.201.0."): the endpoints' /24 and the aggregator's address in it (.254);
        testbeds of one controller (several switches) need subnets of their own.

        ``reducers`` (soft only): that many reducer hosts beside the workers, each a namespace
        ``<prefix>r<i>`` at ``<subnet>.(101+i)`` cabled to a bridge port like a worker and capped at
        the same rate (the Reduction Server case: software aggregators behind links of their own)."""
        if reducers and data_plane != "soft":
            raise ValueError("reducer hosts join the software data plane's bridge (data_plane='soft')")
        if not 0 <= reducers <= MAX_REDUCERS:
            raise ValueError(f"a testbed has 0..{MAX_REDUCERS} reducer hosts, not {reducers}")
        if not 1 <= n <= MAX_ENDPOINTS:
            raise ValueError(f"a testbed has 1..{MAX_ENDPOINTS} endpoints, not {n}")
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data plane must be one of {', '.join(DATA_PLANES)}, not {data_plane!r}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"a link rate must be positive, not {rate_mbit} Mbit/s")
        self.n = n
        self.data_plane = data_plane
        self.rate_mbit = rate_mbit
        # bmv2 handles standard frames; the software path takes jumbo frames as data-centre links do.
        self.mtu = mtu or (1500 if data_plane == "bmv2" else 9000)
        self.owned = prefix is None
        self.prefix = prefix or f"sab{os.getpid()}x{next(_counter)}"
        self.switch_ns = f"{self.prefix}sw"
        self.workdir = workdir
        self.device_id = device_id
        self.static_arp = static_arp
        if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}\.", subnet):
            raise ValueError(f"a testbed subnet looks like '10.201.0.', not {subnet!r}")
        self.subnet, self.agg_ip = subnet, f"{subnet}254"
        # The soft switch's ports are a bridge's: loss toward the switch is dropped there (Endpoint.set_loss).
        soft = data_plane == "soft"
        self.endpoints = [
            Endpoint(
                i, f"{self.prefix}h{i}", f"02:5a:00:00:00:{i + 1:02x}", f"{subnet}{i + 1}", i + 1,
                peer=(self.switch_ns, f"p{i + 1}") if soft else None,
            )
            for i in range(n)
        ]  # fmt: skip
        self.reducer_hosts = [
            Endpoint(
                i, f"{self.prefix}r{i}", f"02:5a:00:00:01:{i + 1:02x}", f"{subnet}{REDUCER_HOST + i}", 64 + i,
                peer=(self.switch_ns, f"p{64 + i}"),
            )
            for i in range(reducers)
        ]  # fmt: skip
        self.switch: Bmv2Switch | None = None
        if data_plane == "bmv2":
            ports = [(e.port, self.switch_port(e)) for e in self.endpoints]
            self.switch = Bmv2Switch(self.switch_ns, ports, workdir, device_id, detach=not self.owned)
        self._made: list[str] = []

    @staticmethod
    def switch_port(e: Endpoint) -> str:
        return f"p{e.port}"

    # -- the switch (bmv2 data plane) ------------------------------------------------------

    def _bmv2(self) -> Bmv2Switch:
        if self.switch is None:
            raise TestbedError(f"the {self.data_plane} testbed has no bmv2 switch")
        return self.switch

    @property
    def grpc_socket(self) -> Path:
        return self._bmv2().grpc_socket

    @property
    def grpc_address(self) -> str:
        return self._bmv2().grpc_address

    def registers(self, name: str, indices: list[int]) -> list[int]:
        return self._bmv2().registers(name, indices)

    def topology(self) -> Any:
        """The controller's view of this rack (switchagg_controller.model.Topology)."""
        from switchagg_controller.model import Topology

        return Topology(
            switch_address=self.grpc_address,
            device_id=self.device_id,
            hosts=tuple(e.host() for e in self.endpoints),
            aggregator_ip=self.agg_ip,
            aggregator_mac=AGG_MAC,
        )

    # -- building and tearing down ---------------------------------------------------------

    def built(self) -> bool:
        return self.switch_ns in netns.namespaces()

    def _add_ns(self, name: str) -> None:
        netns.add_netns(name, self._hosts())
        self._made.append(name)

    def _hosts(self) -> str:
        """/etc/hosts inside the namespaces: names for every address (torch looks its peers up)."""
        names = [(self.agg_ip, "switch")] + [(e.ip, f"h{e.index}") for e in self.endpoints]
        return netns.hosts_text(names + [(e.ip, f"r{e.index}") for e in self.reducer_hosts])

    def start(self) -> None:
        """Builds the namespaces and links, then starts bmv2 (bmv2 data plane)."""
        if self.owned:
            netns.sweep_dead_owners(_TEST_PREFIX)
        elif self.built():
            raise TestbedError(f"testbed {self.prefix} exists already")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._add_ns(self.switch_ns)
        if self.data_plane == "soft":
            sh("ip", "link", "add", "br0", "type", "bridge", ns=self.switch_ns)
            sh("ip", "link", "set", "br0", "address", AGG_MAC, "mtu", str(self.mtu), "up", ns=self.switch_ns)
            sh("ip", "addr", "add", f"{self.agg_ip}/24", "dev", "br0", ns=self.switch_ns)
        for e in self.endpoints + self.reducer_hosts:
            self._add_ns(e.ns)
            sw_if = self.switch_port(e)
            netns.veth(sw_if, self.switch_ns, e.ifname, e.ns, self.mtu)
            sh("ip", "link", "set", e.ifname, "address", e.mac, ns=e.ns)
            sh("ip", "addr", "add", f"{e.ip}/24", "dev", e.ifname, ns=e.ns)
            if self.data_plane == "bmv2":
                # Kernel checksum offload would hand bmv2 frames with unfinished checksums.
                for ns, ifname in ((e.ns, e.ifname), (self.switch_ns, sw_if)):
                    sh("ethtool", "-K", ifname, "tx", "off", "rx", "off", "sg", "off", ns=ns, check=False)
            else:
                sh("ip", "link", "set", sw_if, "master", "br0", ns=self.switch_ns)
            if self.rate_mbit is not None:
                netns.cap_rate(e.ns, e.ifname, self.rate_mbit)
                netns.cap_rate(self.switch_ns, sw_if, self.rate_mbit)
            if self.static_arp:  # otherwise the switch itself answers ARP for the aggregator
                neigh = ["ip", "neigh", "replace", self.agg_ip, "lladdr", AGG_MAC, "nud", "permanent"]
                sh(*neigh, "dev", e.ifname, ns=e.ns)
        if self.switch is not None:
            self.switch.start()

    def link_stats(self) -> list[dict[str, dict[str, int]]]:
        """Per endpoint, what its link's two qdiscs sent and dropped (``up`` = towards the switch)."""
        return [
            {
                "up": netns.link_stats(e.ns, e.ifname),
                "down": netns.link_stats(self.switch_ns, self.switch_port(e)),
            }
            for e in self.endpoints
        ]

    def close(self) -> None:
        if self.switch is not None:
            self.switch.stop()
        for name in reversed(self._made):
            netns.del_netns(name)
        self._made.clear()
