"""The controller's bmv2 tests: a topology file naming a switch of the shared testbed."""

from __future__ import annotations


def topology_yaml(address: str, hosts: int = 3) -> str:
    lines = [
        "switch:",
        f"  address: {address}",
        "  device_id: 0",
        "aggregator:",
        "  ip: 10.0.0.254",
        "  mac: 02:00:00:00:00:fe",
        "hosts:",
    ]
    for i in range(1, hosts + 1):
        lines.append(f"  - {{name: h{i}, port: {i}, mac: '02:00:00:00:00:{i:02x}', ip: 10.0.0.{i}}}")
    return "\n".join(lines) + "\n"
