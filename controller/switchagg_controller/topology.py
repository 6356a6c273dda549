"""The declarative topology file (YAML) -> model.Topology, with errors that name line and field.

switch:
  address: 127.0.0.1:9559     # P4Runtime gRPC server
  device_id: 0
  election_id: [0, 1]         # optional, (high, low), non-zero
aggregator:
  ip: 10.0.0.254              # where workers send aggregation packets
  mac: 02:00:00:00:00:fe      # source MAC of results
  udp_port: 48879             # optional
cpu_port: 255                 # optional
hosts:
  - {name: h1, port: 1, mac: "02:00:00:00:00:01", ip: 10.0.0.1}
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

import yaml

from switchagg_controller.model import HostPort, Topology

_MAC = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")


class TopologyError(ValueError):
    """A topology file is malformed; str() is 'file:line: field: problem'."""


class _Node:
    """A YAML node's value and line, so every check can point at its source."""

    def __init__(self, source: str, node: yaml.Node, path: str) -> None:
        self.source, self.node, self.path = source, node, path
        self.line = node.start_mark.line + 1

    def fail(self, message: str) -> TopologyError:
        where = f"{self.path}: " if self.path else ""
        return TopologyError(f"{self.source}:{self.line}: {where}{message}")

    def mapping(self, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, _Node]:
        if not isinstance(self.node, yaml.MappingNode):
            raise self.fail("expected a mapping")
        out: dict[str, _Node] = {}
        for key_node, value_node in self.node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            sub = f"{self.path}.{key}" if self.path else str(key)
            if key not in required + optional:
                known = ", ".join(required + optional)
                raise _Node(self.source, key_node, sub).fail(f"unknown field (known: {known})")
            if key in out:
                raise _Node(self.source, key_node, sub).fail("given twice")
            out[key] = _Node(self.source, value_node, sub)
        for key in required:
            if key not in out:
                raise self.fail(f"missing field {key!r}")
        return out

    def sequence(self) -> list[_Node]:
        if not isinstance(self.node, yaml.SequenceNode):
            raise self.fail("expected a list")
        return [_Node(self.source, n, f"{self.path}[{i}]") for i, n in enumerate(self.node.value)]

    def scalar(self) -> Any:
        if not isinstance(self.node, yaml.ScalarNode):
            raise self.fail("expected a single value")
        return yaml.safe_load(yaml.serialize(self.node))

    def text(self) -> str:
        if not isinstance(self.node, yaml.ScalarNode):
            raise self.fail("expected a single value")
        return str(self.node.value)

    def integer(self, lo: int, hi: int) -> int:
        value = self.scalar()
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise self.fail(f"{self.text()!r} is not an integer in {lo}..{hi}")
        return value

    def mac(self) -> str:
        value = self.text()
        if not _MAC.match(value):
            raise self.fail(f"{value!r} is not a MAC address")
        return value.lower()

    def ipv4(self) -> str:
        value = self.text()
        try:
            return str(ipaddress.IPv4Address(value))
        except ValueError:
            raise self.fail(f"{value!r} is not an IPv4 address") from None


def _switch_address(node: _Node) -> str:
    value = node.text()
    if value.startswith("unix:") and len(value) > len("unix:"):
        return value  # a Unix socket path (gRPC's "unix:/path" form)
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise node.fail(f"{value!r} is not a host:port or unix:/path address")
    return value


def parse_topology(text: str, source: str = "<topology>") -> Topology:
    try:
        root_node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        raise TopologyError(f"{source}:{line}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if root_node is None:
        raise TopologyError(f"{source}:1: the file is empty")
    root = _Node(source, root_node, "").mapping(("switch", "aggregator", "hosts"), ("cpu_port",))
    switch = root["switch"].mapping(("address", "device_id"), ("election_id",))
    election = (0, 1)
    if "election_id" in switch:
        parts = switch["election_id"].sequence()
        if len(parts) != 2:
            raise switch["election_id"].fail("expected [high, low]")
        election = (parts[0].integer(0, 2**64 - 1), parts[1].integer(0, 2**64 - 1))
        if election == (0, 0):
            raise switch["election_id"].fail("the election id must be non-zero")
    agg = root["aggregator"].mapping(("ip", "mac"), ("udp_port",))
    hosts = []
    seen: dict[tuple[str, Any], str] = {}
    for node in root["hosts"].sequence():
        fields = node.mapping(("name", "port", "mac", "ip"))
        host = HostPort(
            name=fields["name"].text(),
            port=fields["port"].integer(0, 510),
            mac=fields["mac"].mac(),
            ip=fields["ip"].ipv4(),
        )
        for attr in ("name", "port", "mac", "ip"):
            key = (attr, getattr(host, attr))
            if key in seen:
                raise fields[attr].fail(f"{getattr(host, attr)!r} is already used by host {seen[key]!r}")
            seen[key] = host.name
        hosts.append(host)
    if not hosts:
        raise root["hosts"].fail("at least one host is needed")
    return Topology(
        switch_address=_switch_address(switch["address"]),
        device_id=switch["device_id"].integer(0, 2**64 - 1),
        hosts=tuple(hosts),
        aggregator_ip=agg["ip"].ipv4(),
        aggregator_mac=agg["mac"].mac(),
        udp_port=agg["udp_port"].integer(1, 65535) if "udp_port" in agg else 48879,
        cpu_port=root["cpu_port"].integer(0, 511) if "cpu_port" in root else 255,
        election_id=election,
    )


def load_topology(path: str | Path) -> Topology:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TopologyError(f"{p}: cannot read the topology file: {e.strerror}") from None
    return parse_topology(text, p.name)


def dump_topology(t: Topology) -> str:
    """The YAML text of ``t``; ``parse_topology(dump_topology(t)) == t``."""
    doc = {
        "switch": {"address": t.switch_address, "device_id": t.device_id, "election_id": list(t.election_id)},
        "aggregator": {"ip": t.aggregator_ip, "mac": t.aggregator_mac, "udp_port": t.udp_port},
        "cpu_port": t.cpu_port,
        "hosts": [{"name": h.name, "port": h.port, "mac": h.mac, "ip": h.ip} for h in t.hosts],
    }
    text: str = yaml.safe_dump(doc, sort_keys=False)
    return text
