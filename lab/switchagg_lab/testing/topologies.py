"""Topology files the controller tests share: a spine and two P4 leaves with their uplinks, and
two levels of software aggregators on loopback addresses."""

LEAVES = """\
switches:
  - name: spine
    address: unix:/run/sp.sock
    device_id: 0
    aggregator: {ip: 10.0.9.254, mac: "02:00:00:00:09:fe"}
    hosts: []
  - name: l0
    address: unix:/run/l0.sock
    device_id: 0
    aggregator: {ip: 10.0.0.254, mac: "02:00:00:00:00:fe"}
    uplink: {switch: spine, port: 100, spine_port: 1}
    hosts:
      - {name: h0, port: 1, mac: "02:00:00:00:00:01", ip: 10.0.0.1}
  - name: l1
    address: unix:/run/l1.sock
    device_id: 0
    aggregator: {ip: 10.0.1.254, mac: "02:00:00:00:01:fe"}
    uplink: {switch: spine, port: 100, spine_port: 2}
    hosts:
      - {name: h1, port: 1, mac: "02:00:00:00:01:01", ip: 10.0.1.1}
"""

# Two levels on loopback: the spine and two leaves as embedded aggregators, two workers per leaf.
LOOPBACK_TWO_LEVEL = """
spine: {listen: 127.0.0.254:0}
leaves:
  - {name: rack0, listen: 127.0.1.254:0, subnets: [127.0.1.0/24]}
  - {name: rack1, listen: 127.0.2.254:0, subnets: [127.0.2.0/24]}
"""
LOOPBACK_WORKER_IPS = ["127.0.1.1", "127.0.1.2", "127.0.2.1", "127.0.2.2"]
