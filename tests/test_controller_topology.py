"""Topology files: a good one parses, and every malformed one names the line and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchagg_controller.topology import TopologyError, load_topology, parse_topology
from switchagg_lab.testing.topologies import LEAVES

GOOD = """\
switch:
  address: 127.0.0.1:9559
  device_id: 0
  election_id: [0, 5]
aggregator:
  ip: 10.0.0.254
  mac: 02:00:00:00:00:FE
hosts:
  - name: h1
    port: 1
    mac: 02:00:00:00:00:01
    ip: 10.0.0.1
  - {name: h2, port: 2, mac: "12:34:56:00:00:02", ip: 10.0.0.2}
"""


def test_good_file(tmp_path: Path) -> None:
    path = tmp_path / "topology.yaml"
    path.write_text(GOOD)
    t = load_topology(path)
    assert t.switch_address == "127.0.0.1:9559" and t.device_id == 0 and t.election_id == (0, 5)
    assert t.aggregator_mac == "02:00:00:00:00:fe" and t.udp_port == 48879 and t.cpu_port == 255
    assert [(h.name, h.port, h.mac, h.ip) for h in t.hosts] == [
        ("h1", 1, "02:00:00:00:00:01", "10.0.0.1"),
        ("h2", 2, "12:34:56:00:00:02", "10.0.0.2"),  # not read as a YAML 1.1 base-60 number
    ]
    assert t.host_by_ip("10.0.0.2") is t.hosts[1]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("mac: 02:00:00:00:00:01", "mac: zz", "topology.yaml:11: hosts[0].mac: 'zz' is not a MAC address"),
        (
            "ip: 10.0.0.2}",
            "ip: 10.0.0.256}",
            "topology.yaml:13: hosts[1].ip: '10.0.0.256' is not an IPv4 address",
        ),
        ("port: 1\n", "port: 600\n", "topology.yaml:10: hosts[0].port: '600' is not an integer in 0..510"),
        ("port: 1\n", "port: one\n", "topology.yaml:10: hosts[0].port: 'one' is not an integer"),
        ("  device_id: 0\n", "", "topology.yaml:2: switch: missing field 'device_id'"),
        (
            "  device_id: 0\n",
            "  device_id: 0\n  colour: red\n",
            "topology.yaml:4: switch.colour: unknown field",
        ),
        (
            "address: 127.0.0.1:9559",
            "address: localhost",
            "topology.yaml:2: switch.address: 'localhost' is not a host:port or unix:/path address",
        ),
        (
            "election_id: [0, 5]",
            "election_id: [0, 0]",
            "topology.yaml:4: switch.election_id: the election id must",
        ),
        (
            "name: h2, port: 2",
            "name: h2, port: 1",
            "topology.yaml:13: hosts[1].port: 1 is already used by host 'h1'",
        ),
        (
            "ip: 10.0.0.2}",
            "ip: 10.0.0.1}",
            "topology.yaml:13: hosts[1].ip: '10.0.0.1' is already used by host 'h1'",
        ),
        ("  ip: 10.0.0.254\n", "  ip: [1, 2]\n", "topology.yaml:6: aggregator.ip: expected a single value"),
        ("  - {name", "  - {name: [", "topology.yaml:13: not valid YAML"),
    ],
)
def test_malformed_files_name_line_and_field(old: str, new: str, message: str) -> None:
    assert old in GOOD
    with pytest.raises(TopologyError) as e:
        parse_topology(GOOD.replace(old, new, 1), "topology.yaml")
    assert str(e.value).startswith(message), str(e.value)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="t.yaml:1: the file is empty"):
        parse_topology("", "t.yaml")
    with pytest.raises(TopologyError, match="t.yaml:1: missing field 'switch'"):
        parse_topology("hosts: []\n", "t.yaml")
    doc = "switch: {address: 'a:1', device_id: 0}\naggregator: {ip: 1.2.3.4, mac: '02:00:00:00:00:01'}\n"
    doc += "hosts: 3\n"
    with pytest.raises(TopologyError, match="t.yaml:3: hosts: expected a list"):
        parse_topology(doc, "t.yaml")
    with pytest.raises(TopologyError, match="cannot read the topology file"):
        load_topology(tmp_path / "absent.yaml")


def test_cli_reports_the_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "topology.yaml"
    path.write_text(GOOD.replace("mac: 02:00:00:00:00:01", "mac: zz"))
    r = subprocess.run(
        [sys.executable, "-m", "switchagg_controller.cli", "push", "--topology", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1
    assert "topology.yaml:11: hosts[0].mac: 'zz' is not a MAC address" in r.stderr


def test_the_example_topology_parses() -> None:
    example = Path(__file__).resolve().parents[1] / "controller" / "topology.example.yaml"
    t = load_topology(example)
    assert [h.name for h in t.hosts] == ["h1", "h2"] and t.election_id == (0, 1)


def test_a_dumped_topology_parses_back_to_itself() -> None:
    from switchagg_controller.model import HostPort, Topology
    from switchagg_controller.topology import dump_topology

    t = Topology(
        switch_address="unix:/run/x/p4runtime.sock",
        device_id=3,
        hosts=(
            HostPort("h0", 1, "02:5a:00:00:00:01", "10.201.0.1"),
            HostPort("h1", 2, "02:5a:00:00:00:02", "10.201.0.2"),
        ),
        aggregator_ip="10.201.0.254",
        aggregator_mac="02:5a:00:00:00:fe",
        udp_port=48000,
        cpu_port=192,
        election_id=(1, 7),
    )
    assert parse_topology(dump_topology(t)) == t


SEVERAL = """\
switches:
  - name: s1
    address: unix:/run/s1.sock
    device_id: 0
    aggregator: {ip: 10.0.0.254, mac: "02:00:00:00:00:fe"}
    hosts:
      - {name: h1, port: 1, mac: "02:00:00:00:00:01", ip: 10.0.0.1}
  - name: s2
    address: unix:/run/s2.sock
    device_id: 0
    election_id: [0, 3]
    aggregator: {ip: 10.0.1.254, mac: "02:00:00:00:00:fe", udp_port: 48000}
    cpu_port: 192
    hosts:
      - {name: h1, port: 1, mac: "02:00:00:00:00:01", ip: 10.0.1.1}
"""


def test_several_switches() -> None:
    from switchagg_controller.topology import dump_topologies, parse_topologies

    s1, s2 = parse_topologies(SEVERAL, "net.yaml")
    assert (s1.name, s1.switch_address, s1.election_id, s1.udp_port) == (
        "s1",
        "unix:/run/s1.sock",
        (0, 1),
        48879,
    )
    assert (s2.name, s2.election_id, s2.udp_port, s2.cpu_port) == ("s2", (0, 3), 48000, 192)
    assert s2.host_by_ip("10.0.1.1") is s2.hosts[0] and s1.host_by_ip("10.0.1.1") is None
    assert parse_topologies(dump_topologies([s1, s2])) == [s1, s2]
    assert parse_topologies(GOOD) == [parse_topology(GOOD)]  # the one-switch form still reads
    with pytest.raises(TopologyError, match="net.yaml:1: 2 switches where one is expected"):
        parse_topology(SEVERAL, "net.yaml")


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("ip: 10.0.1.1}", "ip: 10.0.0.1}",
         "net.yaml:15: switches[1].hosts[0].ip: '10.0.0.1' is already used by host 'h1'"),
        ("  - name: s2", "  - name: s1",
         "net.yaml:8: switches[1].name: 's1' is empty or names another switch too"),
        ("unix:/run/s2.sock", "unix:/run/s1.sock",
         "net.yaml:9: switches[1].address: unix:/run/s1.sock device 0 is switch 's1' too"),
        ("    cpu_port: 192\n", "    cpu_port: 192\n    colour: red\n",
         "net.yaml:14: switches[1].colour: unknown field "
         "(known: name, address, device_id, aggregator, hosts, election_id, cpu_port, uplink)"),
        ("    device_id: 0\n    election_id", "    election_id",
         "net.yaml:8: switches[1]: missing field 'device_id'"),
    ],
)  # fmt: skip
def test_bad_lists_of_switches(old: str, new: str, message: str) -> None:
    from switchagg_controller.topology import parse_topologies

    assert old in SEVERAL
    with pytest.raises(TopologyError) as e:
        parse_topologies(SEVERAL.replace(old, new, 1), "net.yaml")
    assert str(e.value) == message


def test_leaves_with_uplinks_to_a_spine_without_hosts() -> None:
    from switchagg_controller.model import Uplink
    from switchagg_controller.topology import dump_topologies, parse_topologies

    spine, l0, l1 = parse_topologies(LEAVES, "net.yaml")
    assert spine.hosts == () and spine.uplink is None
    assert l0.uplink == Uplink("spine", 100, 1) and l1.uplink == Uplink("spine", 100, 2)
    assert parse_topologies(dump_topologies([spine, l0, l1])) == [spine, l0, l1]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("{switch: spine, port: 100, spine_port: 2}", "{switch: nope, port: 100, spine_port: 2}",
         "net.yaml:18: switches[2].uplink: 'nope' is not another switch of the topology"),
        ("{switch: spine, port: 100, spine_port: 2}", "{switch: l1, port: 100, spine_port: 2}",
         "net.yaml:18: switches[2].uplink: 'l1' is not another switch of the topology"),
        ("{switch: spine, port: 100, spine_port: 2}", "{switch: l0, port: 100, spine_port: 2}",
         "net.yaml:18: switches[2].uplink: 'l0' is a leaf itself (two levels only)"),
        ("{switch: spine, port: 100, spine_port: 2}", "{switch: spine, port: 100, spine_port: 1}",
         "net.yaml:18: switches[2].uplink: port 1 of 'spine' is the uplink of 'l0' already"),
        ("{switch: spine, port: 100, spine_port: 2}", "{switch: spine, port: 1, spine_port: 2}",
         "net.yaml:18: switches[2].uplink: port 1 of 'l1' is host 'h1' already"),
        ("{switch: spine, port: 100, spine_port: 2}", "{switch: spine, port: 100}",
         "net.yaml:18: switches[2].uplink: missing field 'spine_port'"),
    ],
)  # fmt: skip
def test_bad_uplinks(old: str, new: str, message: str) -> None:
    from switchagg_controller.topology import parse_topologies

    assert old in LEAVES
    with pytest.raises(TopologyError) as e:
        parse_topologies(LEAVES.replace(old, new, 1), "net.yaml")
    assert str(e.value) == message


def test_a_switch_without_hosts_must_be_a_spine() -> None:
    from switchagg_controller.topology import parse_topologies

    text = LEAVES.replace("    uplink: {switch: spine, port: 100, spine_port: 1}\n", "").replace(
        "    uplink: {switch: spine, port: 100, spine_port: 2}\n", ""
    )
    with pytest.raises(TopologyError, match="switches\\[0\\].hosts: at least one host is needed"):
        parse_topologies(text, "net.yaml")
