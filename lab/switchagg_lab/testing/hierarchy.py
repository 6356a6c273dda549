"""Running a two-level job: worker processes, leaves and a spine as ``switchagg-aggregator``
processes (docs/PROTOCOL.md, Two levels), on loopback or in namespaces (switchagg_lab.testbed.racks)."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from switchagg.aggregator import new_key
from switchagg.aggregator_cli import NO_KEY
from switchagg_lab.testing.local import WORKER, _read_address

AGGREGATOR = [sys.executable, "-m", "switchagg.aggregator_cli"]
_START_S = 30.0  # an aggregator prints its listening line within this (generous: only against a hang)
_STOP_S = 30.0

Address = tuple[str, int]


def _spec(job: int, n: int, slots: int, k: int, addrs: Sequence[Address | None], key: int) -> str:
    ranks = ",".join("-" if a is None else f"{a[0]}:{a[1]}" for a in addrs)
    return f"{job}:{n}:0:{slots}:{k}:1:{key or NO_KEY}@{ranks}"  # 0: unkeyed, by name


@dataclass
class Node:
    """One aggregator process (a leaf or the spine); ``restart()`` kills it and starts it again
    with the same command, so it comes back with empty slots on the same address."""

    name: str
    argv: list[str]
    counters_file: Path
    proc: subprocess.Popen[str] | None = None
    killed: int = 0
    logs: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.counters_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready and "listening on" in self.proc.stdout.readline():
                return
            if self.proc.poll() is not None:
                break
        self.proc.kill()
        _, err = self.proc.communicate(timeout=_STOP_S)
        raise RuntimeError(f"{self.name} did not start: {err.strip()[-1500:]}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        out, err = self.proc.communicate(timeout=_STOP_S)
        self.logs.append(out + err)
        self.killed += 1

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> dict[str, Any]:
        """SIGTERM, then its final counters (job ids as strings, as JSON has them)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=_STOP_S)
        self.logs.append(out + err)
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {err.strip()[-1500:]}")
        result: dict[str, Any] = json.loads(self.counters_file.read_text())
        return result


@dataclass
class Layout:
    """Where everything listens: rank r talks to ``leaf_addrs[rack_of[r]]``; the spine sees leaf l
    at ``leaf_views[l]``; ``launcher(name)`` prefixes a process's command (``ip netns exec NS``)."""

    rack_of: list[int]
    leaf_binds: list[Address]
    leaf_addrs: list[Address]
    leaf_views: list[Address]
    spine: Address
    worker_bind: Callable[[int], Address] = lambda rank: ("127.0.0.1", 0)
    launcher: Callable[[str], list[str]] = lambda name: []

    @classmethod
    def loopback(cls, racks: list[int], ports: list[int]) -> Layout:
        """Everything on 127.0.0.1; ``ports``: one per leaf, then the spine's."""
        leaves = [("127.0.0.1", p) for p in ports[:-1]]
        rack_of = [rack for rack, count in enumerate(racks) for _ in range(count)]
        return cls(rack_of, leaves, leaves, leaves, ("127.0.0.1", ports[-1]))


@dataclass
class Outcome:
    workers: list[subprocess.CompletedProcess[str]]
    leaves: list[dict[str, Any]]  # final counters of each leaf (its last incarnation)
    spine: dict[str, Any]
    nodes: dict[str, Node]


def run_hierarchy(
    layout: Layout,
    job: int,
    tensors: list[tuple[str, int]],
    out: Path,
    *,
    slots: int,
    k: int,
    wait: float = 180.0,
    node_args: Callable[[str], list[str]] = lambda name: [],
    during: Callable[[dict[str, Node]], None] | None = None,
    key: int | None = None,
    **cfg: Any,
) -> Outcome:
    """Starts the workers (job ranks in rack order), the spine and the leaves, lets the workers run
    and waits for all (bounded by ``wait``); ``during(nodes)`` runs once they started (e.g. to
    restart a leaf); ``node_args(name)`` adds aggregator options (e.g. fault injection); ``cfg``
    adds worker config keys (switchagg_lab.testing.worker); ``key``: the job's result key on every
    node and worker (None: a fresh random one; 0: unkeyed)."""
    if key is None:
        key = new_key()
    n, racks = len(layout.rack_of), max(layout.rack_of) + 1
    procs: list[subprocess.Popen[str]] = []
    nodes: dict[str, Node] = {}
    try:
        for rank in range(n):
            c = {
                "job": job, "rank": rank, "n": n, "aggregator": list(layout.leaf_addrs[layout.rack_of[rank]]),
                "bind": list(layout.worker_bind(rank)), "slots": slots, "k": k, "tensors": tensors,
                "out": str(out), "announce": True, "key": key, **cfg,
            }  # fmt: skip
            argv = [*layout.launcher(f"h{rank}"), *WORKER, json.dumps(c)]
            procs.append(
                subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        deadline = time.monotonic() + 60
        addrs = [_read_address(p, deadline) for p in procs]

        def node(name: str, bind: Address, spec: str, extra: list[str]) -> Node:
            argv = [*layout.launcher(name), *AGGREGATOR, "--host", bind[0], "--port", str(bind[1])]
            argv += ["--job", spec, *extra, *node_args(name)]
            path = out / f"{name}.counters.json"
            return Node(name, [*argv, "--counters-json", str(path)], path)

        nodes["spine"] = node("spine", layout.spine, _spec(job, racks, slots, k, layout.leaf_views, key), [])
        for leaf in range(racks):
            mine = [a if layout.rack_of[r] == leaf else None for r, a in enumerate(addrs)]
            up = f"{job}:{leaf}@{layout.spine[0]}:{layout.spine[1]}"
            nodes[f"l{leaf}"] = node(
                f"l{leaf}", layout.leaf_binds[leaf], _spec(job, n, slots, k, mine, key), ["--leaf", up]
            )
        for nd in nodes.values():
            nd.start()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        if during is not None:
            during(nodes)
        done = []
        deadline = time.monotonic() + wait
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
        leaves = [nodes[f"l{leaf}"].stop() for leaf in range(racks)]
        return Outcome(done, leaves, nodes["spine"].stop(), nodes)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
        for nd in nodes.values():
            if nd.proc is not None and nd.proc.poll() is None:
                nd.proc.kill()
                nd.proc.communicate(timeout=30)
