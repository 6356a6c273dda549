"""Workers with one interface per rail, each rail a bmv2 switch of its own (P4 switches as rails of a
striped job: docs/CONTROLLER.md, Rails).

Worker i is namespace ``<prefix>h<i>``; its interface ``eth<r>`` (IPv4 10.215.<r+1>.<i+1>/24) is
cabled to port i+1 of rail r, a simple_switch_grpc in namespace ``<prefix>s<r>`` whose aggregator
address is 10.215.<r+1>.254. The rails share nothing: each is an ordinary one-switch rack, and a
worker reaches rail r's aggregator through eth<r> (its own subnet).
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path
from typing import Any

from switchagg_lab.testbed import netns
from switchagg_lab.testbed.bmv2 import Bmv2Switch
from switchagg_lab.testbed.netns import Endpoint, sh
from switchagg_lab.testbed.p4racks import _offload_off

_PREFIX = re.compile(r"^sar(\d+)x\d+(s\d+|h\d+)$")
_counter = itertools.count(1)


def rail_ip(rail: int) -> str:
    """Rail ``rail``'s aggregator address."""
    return f"10.215.{rail + 1}.254"


def rail_mac(rail: int) -> str:
    return f"02:5d:00:00:{rail + 1:02x}:fe"


class P4Rails(netns.Bed):
    """``workers`` worker namespaces cabled to each of ``rails`` bmv2 switches; a context manager."""

    def __init__(self, workers: int, rails: int, workdir: Path) -> None:
        if not 1 <= workers <= 31 or not 1 <= rails <= 8:
            raise ValueError(f"1..31 workers on 1..8 rails, not {workers} on {rails}")
        self.workdir = workdir
        self.prefix = f"sar{os.getpid()}x{next(_counter)}"
        self.worker_ns = [f"{self.prefix}h{i}" for i in range(workers)]
        self.switch_ns = [f"{self.prefix}s{r}" for r in range(rails)]
        # endpoints[r][i]: worker i as rail r sees it
        self.endpoints = [
            [
                Endpoint(
                    i, ns, f"02:5d:00:{r + 1:02x}:00:{i + 1:02x}", f"10.215.{r + 1}.{i + 1}", i + 1, f"eth{r}"
                )
                for i, ns in enumerate(self.worker_ns)
            ]
            for r in range(rails)
        ]
        self.switches = [
            Bmv2Switch(ns, [(i + 1, f"p{i + 1}") for i in range(workers)], workdir / f"rail{r}")
            for r, ns in enumerate(self.switch_ns)
        ]
        self._made: list[str] = []

    @property
    def workers(self) -> list[Endpoint]:
        """Each worker as rail 0 sees it (its namespace, its rail-0 address)."""
        return self.endpoints[0]

    def addresses(self, worker: int) -> list[str]:
        """Worker ``worker``'s address on each rail, in rail order."""
        return [rail[worker].ip for rail in self.endpoints]

    def start(self) -> None:
        netns.sweep_dead_owners(_PREFIX)
        self.workdir.mkdir(parents=True, exist_ok=True)
        for ns in [*self.switch_ns, *self.worker_ns]:
            netns.add_netns(ns)
            self._made.append(ns)
        for r, rail in enumerate(self.endpoints):
            for e in rail:
                netns.veth(f"p{e.port}", self.switch_ns[r], e.ifname, e.ns, 1500)
                sh("ip", "link", "set", e.ifname, "address", e.mac, ns=e.ns)
                sh("ip", "addr", "add", f"{e.ip}/24", "dev", e.ifname, ns=e.ns)
                _offload_off(e.ns, e.ifname)
                _offload_off(self.switch_ns[r], f"p{e.port}")
        for sw in self.switches:
            sw.start()

    def topology(self, rail: int) -> Any:
        """Rail ``rail`` as the controller sees it (switchagg_controller.model.Topology), named rail<r>."""
        from switchagg_controller.model import Topology

        return Topology(
            switch_address=self.switches[rail].grpc_address,
            device_id=0,
            hosts=tuple(e.host() for e in self.endpoints[rail]),
            aggregator_ip=rail_ip(rail),
            aggregator_mac=rail_mac(rail),
            name=f"rail{rail}",
        )

    def close(self) -> None:
        for sw in self.switches:
            sw.stop()
        for name in reversed(self._made):
            netns.del_netns(name)
        self._made.clear()
