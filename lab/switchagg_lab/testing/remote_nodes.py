"""Two levels of aggregators the controller does not run: a spine and two leaves, each a
separate `switchagg-aggregator --control` process on loopback, and the file naming them."""

from __future__ import annotations

from pathlib import Path

from switchagg_lab.testing.control import ControlledAggregator

NODE_SECRET = "node-secret-for-tests"


def remote_nodes(tmp: Path) -> list[ControlledAggregator]:
    """A spine and two leaves as `switchagg-aggregator --control` processes (not started yet)."""
    hosts = [("spine", "127.0.0.254"), ("rack0", "127.0.1.254"), ("rack1", "127.0.2.254")]
    return [ControlledAggregator(tmp, name, NODE_SECRET, host) for name, host in hosts]


def remote_nodes_spec(tmp: Path, nodes: list[ControlledAggregator]) -> Path:
    """The `--two-level` file naming ``nodes`` by their control services."""

    def node(a: ControlledAggregator) -> str:
        return f"listen: {a.host}:{a.port}, control: '{a.target}', secret_file: {a.secret_file.name}"

    spine, r0, r1 = nodes
    path = tmp / "two-level.yaml"
    path.write_text(
        f"spine: {{{node(spine)}}}\nleaves:\n"
        f"  - {{name: rack0, subnets: [127.0.1.0/24], {node(r0)}}}\n"
        f"  - {{name: rack1, subnets: [127.0.2.0/24], {node(r1)}}}\n"
    )
    return path
