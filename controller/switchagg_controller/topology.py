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

Several switches, each reconciled on its own (host IPs are unique across them: a worker is
placed on the switch its address is cabled to):

switches:
  - name: s1
    address: unix:/run/s1/p4runtime.sock
    device_id: 0
    election_id: [0, 1]       # optional
    aggregator: {ip: 10.0.0.254, mac: "02:00:00:00:00:fe"}
    cpu_port: 255             # optional
    hosts:
      - {name: h1, port: 1, mac: "02:00:00:00:00:01", ip: 10.0.0.1}
  - name: s2
    ...

Two levels (docs/PROTOCOL.md, Two levels): a leaf names its spine switch and the ports of the
cable between them; a job whose workers sit behind several leaves of one spine is aggregated on
the leaves and the spine. A spine needs no hosts of its own.

    uplink: {switch: spine, port: 100, spine_port: 1}   # on a leaf: its port, the spine's port

The spine may be a software aggregator instead (mixed hierarchies: P4 leaves, a software spine),
listed under ``software_spines`` with the address the leaves send their partials to (``listen``,
where it serves, and the MAC of that address); the leaf's uplink then names it without a
``spine_port``. Like a two-level node (software_nodes.py), it is embedded in the controller, or runs
elsewhere and names its control service and secret (relative to this file):

software_spines:
  - {name: sspine, listen: 10.213.0.254:48879, mac: "02:5c:00:00:00:fe",
     control: unix:/run/sspine/control.sock, secret_file: sspine.secret}   # both optional
switches:
  - name: l0
    ...
    uplink: {switch: sspine, port: 100}
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

import yaml

from switchagg_controller.model import HostPort, Network, Remote, SoftwareSpine, Topology, Uplink

_MAC = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")


class TopologyError(ValueError):
    """A topology file is malformed; str() is 'file:line: field: problem'."""


class YamlNode:
    """A YAML node's value and line, so every check can point at its source."""

    def __init__(self, source: str, node: yaml.Node, path: str) -> None:
        self.source, self.node, self.path = source, node, path
        self.line = node.start_mark.line + 1

    def fail(self, message: str) -> TopologyError:
        where = f"{self.path}: " if self.path else ""
        return TopologyError(f"{self.source}:{self.line}: {where}{message}")

    def mapping(self, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, YamlNode]:
        if not isinstance(self.node, yaml.MappingNode):
            raise self.fail("expected a mapping")
        out: dict[str, YamlNode] = {}
        for key_node, value_node in self.node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            sub = f"{self.path}.{key}" if self.path else str(key)
            if key not in required + optional:
                known = ", ".join(required + optional)
                raise YamlNode(self.source, key_node, sub).fail(f"unknown field (known: {known})")
            if key in out:
                raise YamlNode(self.source, key_node, sub).fail("given twice")
            out[key] = YamlNode(self.source, value_node, sub)
        for key in required:
            if key not in out:
                raise self.fail(f"missing field {key!r}")
        return out

    def sequence(self) -> list[YamlNode]:
        if not isinstance(self.node, yaml.SequenceNode):
            raise self.fail("expected a list")
        return [YamlNode(self.source, n, f"{self.path}[{i}]") for i, n in enumerate(self.node.value)]

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


def _switch_address(node: YamlNode) -> str:
    value = node.text()
    if value.startswith("unix:") and len(value) > len("unix:"):
        return value  # a Unix socket path (gRPC's "unix:/path" form)
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise node.fail(f"{value!r} is not a host:port or unix:/path address")
    return value


def _election(node: YamlNode) -> tuple[int, int]:
    parts = node.sequence()
    if len(parts) != 2:
        raise node.fail("expected [high, low]")
    election = (parts[0].integer(0, 2**64 - 1), parts[1].integer(0, 2**64 - 1))
    if election == (0, 0):
        raise node.fail("the election id must be non-zero")
    return election


def _hosts(node: YamlNode, ips: dict[str, str], allow_none: bool = False) -> tuple[HostPort, ...]:
    """The hosts of one switch: names, ports and MACs unique on it, IPs across every switch
    (``ips``: those of the switches so far), since a worker is placed by its address."""
    hosts = []
    seen: dict[tuple[str, Any], str] = {}
    for host_node in node.sequence():
        fields = host_node.mapping(("name", "port", "mac", "ip"))
        host = HostPort(
            name=fields["name"].text(),
            port=fields["port"].integer(0, 510),
            mac=fields["mac"].mac(),
            ip=fields["ip"].ipv4(),
        )
        for attr in ("name", "port", "mac"):
            key = (attr, getattr(host, attr))
            if key in seen:
                raise fields[attr].fail(f"{getattr(host, attr)!r} is already used by host {seen[key]!r}")
            seen[key] = host.name
        if host.ip in ips:
            raise fields["ip"].fail(f"{host.ip!r} is already used by host {ips[host.ip]!r}")
        ips[host.ip] = host.name
        hosts.append(host)
    if not hosts and not allow_none:
        raise node.fail("at least one host is needed")
    return tuple(hosts)


def _topology(
    name: str,
    switch: dict[str, YamlNode],
    agg_node: YamlNode,
    hosts_node: YamlNode,
    cpu_node: YamlNode | None,
    ips: dict[str, str],
    uplink: Uplink | None = None,
    allow_no_hosts: bool = False,
) -> Topology:
    agg = agg_node.mapping(("ip", "mac"), ("udp_port",))
    return Topology(
        switch_address=_switch_address(switch["address"]),
        device_id=switch["device_id"].integer(0, 2**64 - 1),
        hosts=_hosts(hosts_node, ips, allow_no_hosts),
        aggregator_ip=agg["ip"].ipv4(),
        aggregator_mac=agg["mac"].mac(),
        udp_port=agg["udp_port"].integer(1, 65535) if "udp_port" in agg else 48879,
        cpu_port=cpu_node.integer(0, 511) if cpu_node is not None else 255,
        election_id=_election(switch["election_id"]) if "election_id" in switch else (0, 1),
        name=name,
        uplink=uplink,
    )


def parse_address(node: YamlNode) -> tuple[str, int]:
    host, sep, port = node.text().rpartition(":")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise node.fail(f"{node.text()!r} is not an IPv4:port address") from None
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:  # 0: a free port
        raise node.fail(f"{node.text()!r} is not an IPv4:port address")
    return (host, int(port))


REMOTE_KEYS = ("control", "secret_file")


def parse_remote(f: dict[str, YamlNode], base: Path) -> Remote | None:
    """A software aggregator run elsewhere (both keys), or None (embedded in the controller)."""
    if "control" not in f and "secret_file" not in f:
        return None
    for key in REMOTE_KEYS:
        if key not in f:
            other = next(k for k in REMOTE_KEYS if k != key)
            raise f[other].fail(f"{other} needs {key} too (a node run elsewhere names both)")
    if f["listen"].text().endswith(":0"):
        raise f["listen"].fail("a node run elsewhere needs its real port, not 0")
    return Remote(f["control"].text(), base / f["secret_file"].text())


def _software_spines(node: YamlNode, base: Path) -> tuple[list[SoftwareSpine], dict[str, YamlNode]]:
    out: list[SoftwareSpine] = []
    nodes: dict[str, YamlNode] = {}
    for item in node.sequence():
        f = item.mapping(("name", "listen", "mac"), REMOTE_KEYS)
        name = f["name"].text()
        if not name or name in nodes:
            raise f["name"].fail(f"{name!r} is empty or names another software spine too")
        ip, port = parse_address(f["listen"])
        if port == 0:
            raise f["listen"].fail("the leaves need the spine's real port, not 0")
        out.append(SoftwareSpine(name, ip, port, f["mac"].mac(), parse_remote(f, base)))
        nodes[name] = item
    return out, nodes


def _uplink(node: YamlNode, software_spines: set[str]) -> Uplink:
    """A leaf's uplink: to a P4 spine (its port there too), or to a software spine (no port)."""
    target = node.mapping(("switch", "port"), ("spine_port",))["switch"].text()
    if target in software_spines:
        f = node.mapping(("switch", "port"))
        return Uplink(target, f["port"].integer(0, 510), None)
    f = node.mapping(("switch", "port", "spine_port"))
    return Uplink(target, f["port"].integer(0, 510), f["spine_port"].integer(0, 510))


def _spines(switches: list[YamlNode]) -> set[str]:
    """The switches some leaf names as its spine (they may have no hosts)."""
    out = set()
    for node in switches:
        if isinstance(node.node, yaml.MappingNode):
            for k, v in node.node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == "uplink" and isinstance(v, yaml.MappingNode):
                    out |= {
                        str(b.value)
                        for a, b in v.value
                        if isinstance(a, yaml.ScalarNode) and a.value == "switch"
                    }
    return out


def _check_uplinks(out: list[Topology], nodes: dict[str, YamlNode], software_spines: set[str]) -> None:
    """Two levels exactly: a leaf's spine exists, is no leaf itself, and its ports are free."""
    by_name = {t.name: t for t in out}
    used: dict[tuple[str, int], str] = {(t.name, h.port): f"host {h.name!r}" for t in out for h in t.hosts}
    for t in out:
        if t.uplink is None:
            continue
        where = nodes[t.name]
        if t.uplink.switch in software_spines:
            key = (t.name, t.uplink.port)
            if key in used:
                raise where.fail(f"port {key[1]} of {key[0]!r} is {used[key]} already")
            used[key] = f"the uplink of {t.name!r}"
            continue
        spine = by_name.get(t.uplink.switch)
        if spine is None or spine is t:
            raise where.fail(f"{t.uplink.switch!r} is not another switch of the topology")
        if spine.uplink is not None:
            raise where.fail(f"{spine.name!r} is a leaf itself (two levels only)")
        assert t.uplink.spine_port is not None  # _uplink requires it for a P4 spine
        for key in ((t.name, t.uplink.port), (spine.name, t.uplink.spine_port)):
            if key in used:
                raise where.fail(f"port {key[1]} of {key[0]!r} is {used[key]} already")
            used[key] = f"the uplink of {t.name!r}"


def parse_topologies(text: str, source: str = "<topology>") -> list[Topology]:
    """Every switch of a topology file: the one-switch form, or ``switches:`` (a list)."""
    return parse_network(text, source).switches


def parse_network(text: str, source: str = "<topology>", base: Path | None = None) -> Network:
    """The switches of a topology file and its software spines. ``base``: the directory relative
    secret_file paths start from (default: the working one)."""
    try:
        root_node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        raise TopologyError(f"{source}:{line}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if root_node is None:
        raise TopologyError(f"{source}:1: the file is empty")
    root = YamlNode(source, root_node, "")
    ips: dict[str, str] = {}
    is_list = isinstance(root_node, yaml.MappingNode) and any(
        isinstance(k, yaml.ScalarNode) and k.value == "switches" for k, _ in root_node.value
    )
    if not is_list:
        top = root.mapping(("switch", "aggregator", "hosts"), ("cpu_port",))
        switch = top["switch"].mapping(("address", "device_id"), ("election_id",))
        return Network([_topology("s1", switch, top["aggregator"], top["hosts"], top.get("cpu_port"), ips)])
    fields_top = root.mapping(("switches",), ("software_spines",))
    switches_node = fields_top["switches"]
    software, software_nodes = (
        _software_spines(fields_top["software_spines"], base if base is not None else Path())
        if "software_spines" in fields_top
        else ([], {})
    )
    soft_names = {s.name for s in software}
    out: list[Topology] = []
    names: dict[str, int] = {}
    endpoints: dict[tuple[str, int], str] = {}
    nodes = switches_node.sequence()
    spines = _spines(nodes)
    uplink_nodes: dict[str, YamlNode] = {}
    for node in nodes:
        fields = node.mapping(
            ("name", "address", "device_id", "aggregator", "hosts"), ("election_id", "cpu_port", "uplink")
        )
        name = fields["name"].text()
        if not name or name in names:
            raise fields["name"].fail(f"{name!r} is empty or names another switch too")
        names[name] = len(out)
        if name in soft_names:
            raise fields["name"].fail(f"{name!r} names a software spine too")
        uplink = _uplink(fields["uplink"], soft_names) if "uplink" in fields else None
        uplink_nodes[name] = fields.get("uplink", node)
        t = _topology(
            name, fields, fields["aggregator"], fields["hosts"], fields.get("cpu_port"), ips, uplink,
            allow_no_hosts=name in spines,
        )  # fmt: skip
        endpoint = (t.switch_address, t.device_id)
        if endpoint in endpoints:
            raise fields["address"].fail(
                f"{t.switch_address} device {t.device_id} is switch {endpoints[endpoint]!r} too"
            )
        endpoints[endpoint] = name
        out.append(t)
    if not out:
        raise switches_node.fail("at least one switch is needed")
    _check_uplinks(out, uplink_nodes, soft_names)
    named = {t.uplink.switch for t in out if t.uplink is not None}
    for spine in software:
        if spine.name not in named:
            raise software_nodes[spine.name].fail(f"software spine {spine.name!r} is no leaf's uplink")
    return Network(out, software)


def parse_topology(text: str, source: str = "<topology>") -> Topology:
    """The switch of a one-switch topology file (a file with several switches is refused)."""
    switches = parse_topologies(text, source)
    if len(switches) != 1:
        raise TopologyError(f"{source}:1: {len(switches)} switches where one is expected")
    return switches[0]


def read_config(path: str | Path, what: str) -> tuple[str, str]:
    """A configuration file's text and the name its errors cite, or a TopologyError."""
    p = Path(path)
    try:
        return p.read_text(), p.name
    except OSError as e:
        raise TopologyError(f"{p}: cannot read the {what}: {e.strerror}") from None


def load_topologies(path: str | Path) -> list[Topology]:
    return parse_topologies(*read_config(path, "topology file"))


def load_network(path: str | Path) -> Network:
    return parse_network(*read_config(path, "topology file"), base=Path(path).parent)


def load_topology(path: str | Path) -> Topology:
    return parse_topology(*read_config(path, "topology file"))


def _hosts_doc(t: Topology) -> list[dict[str, Any]]:
    return [{"name": h.name, "port": h.port, "mac": h.mac, "ip": h.ip} for h in t.hosts]


def _software_spine_doc(s: SoftwareSpine) -> dict[str, Any]:
    remote = {"control": s.remote.control, "secret_file": str(s.remote.secret_file)} if s.remote else {}
    return {"name": s.name, "listen": f"{s.aggregator_ip}:{s.udp_port}", "mac": s.aggregator_mac, **remote}


def dump_topologies(switches: list[Topology], software_spines: list[SoftwareSpine] | None = None) -> str:
    """The YAML text of several switches (and software spines); ``parse_topologies(dump_topologies(ts))
    == ts``, and ``parse_network`` reads the software spines back (absolute secret_file paths)."""
    spines = {"software_spines": [_software_spine_doc(s) for s in software_spines]} if software_spines else {}
    doc = {
        **spines,
        "switches": [
            {
                "name": t.name,
                "address": t.switch_address,
                "device_id": t.device_id,
                "election_id": list(t.election_id),
                "aggregator": {"ip": t.aggregator_ip, "mac": t.aggregator_mac, "udp_port": t.udp_port},
                "cpu_port": t.cpu_port,
                "hosts": _hosts_doc(t),
                **(
                    {
                        "uplink": {
                            "switch": t.uplink.switch,
                            "port": t.uplink.port,
                            **(
                                {"spine_port": t.uplink.spine_port} if t.uplink.spine_port is not None else {}
                            ),
                        }
                    }
                    if t.uplink
                    else {}
                ),
            }
            for t in switches
        ],
    }
    text: str = yaml.safe_dump(doc, sort_keys=False)
    return text


def dump_topology(t: Topology) -> str:
    """The YAML text of ``t`` (one-switch form); ``parse_topology(dump_topology(t)) == t``."""
    doc = {
        "switch": {"address": t.switch_address, "device_id": t.device_id, "election_id": list(t.election_id)},
        "aggregator": {"ip": t.aggregator_ip, "mac": t.aggregator_mac, "udp_port": t.udp_port},
        "cpu_port": t.cpu_port,
        "hosts": _hosts_doc(t),
    }
    text: str = yaml.safe_dump(doc, sort_keys=False)
    return text
