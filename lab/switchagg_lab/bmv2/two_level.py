"""A two-level job on bmv2 leaves (switchagg_lab.testbed.p4racks): the leaves' and the bmv2 spine's
table state, the software spine's process, and the worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from switchagg import protocol
from switchagg_controller import p4_program
from switchagg_controller.model import Job, WorkerAddr
from switchagg_lab.testbed.p4racks import SPINE_IP, SPINE_MAC, UPLINK_PORT, P4Racks, leaf_ip, leaf_mac
from switchagg_lab.testing.hierarchy import Node
from switchagg_lab.testing.kit import wait_all
from switchagg_lab.testing.local import WORKER

JOB = 1
COUNTER_INDEX = 0
WORKER_PORT = 40000  # every worker binds this UDP port (one worker per namespace)


@dataclass
class TwoLevelJob:
    """Job JOB over every worker of ``bed``: installed on each leaf as leaf ``rack``, and on the
    spine (bmv2, or a switchagg-aggregator process in the spine namespace) with the leaves as ranks."""

    bed: P4Racks
    slots: int
    generation: int = 1
    sessions: dict[str, Any] = field(default_factory=dict)
    spine_node: Node | None = None
    _stack: ExitStack = field(default_factory=ExitStack)

    @property
    def n(self) -> int:
        return len(self.bed.workers)

    def leaf_job(self, rack: int) -> tuple[Job, p4_program.LeafRole]:
        local = tuple(
            WorkerAddr(w.index, w.ip, WORKER_PORT, w.mac, w.port) for w in self.bed.rack_workers(rack)
        )
        job = Job(
            JOB, "two-level", self.n, 0, self.slots, protocol.P4_K, self.generation, local, COUNTER_INDEX
        )
        return job, p4_program.LeafRole(rack, UPLINK_PORT, SPINE_MAC, SPINE_IP, protocol.UDP_PORT)

    def spine_job(self) -> Job:
        leaves = tuple(
            WorkerAddr(r, leaf_ip(r), protocol.UDP_PORT, leaf_mac(r), r + 1)
            for r in range(len(self.bed.racks))
        )
        return Job(JOB, "two-level", len(leaves), 0, self.slots, protocol.P4_K, self.generation, leaves)

    def _session(self, name: str, address: str) -> Any:
        from switchagg_controller.switch_session import SwitchSession

        s = SwitchSession(address, 0, p4_program.P4INFO, p4_program.BMV2_JSON, force_pipeline=True)
        s.open()
        self.sessions[name] = s
        return s

    def install_leaf(self, rack: int) -> None:
        """(Re)connects to leaf ``rack`` and writes its whole state (after a restart: into an empty
        switch)."""
        old = self.sessions.pop(f"l{rack}", None)
        if old is not None:
            old.close()
        job, role = self.leaf_job(rack)
        state = p4_program.desired_state(self.bed.leaf_topology(rack), [job], {JOB: role})
        self._session(f"l{rack}", self.bed.leaves[rack].grpc_address).apply(state)

    def start(self, out: Path) -> None:
        for rack in range(len(self.bed.racks)):
            self.install_leaf(rack)
        if self.bed.spine is not None:
            state = p4_program.desired_state(self.bed.spine_topology(), [self.spine_job()])
            self._session("spine", self.bed.spine.grpc_address).apply(state)
        else:
            ranks = ",".join(f"{leaf_ip(r)}:{protocol.UDP_PORT}" for r in range(len(self.bed.racks)))
            # Unkeyed, as the P4 leaves' job (p4_program.desired_state's default key).
            spec = f"{JOB}:{len(self.bed.racks)}:0:{self.slots}:{protocol.P4_K}:{self.generation}"
            spec += f":unkeyed@{ranks}"
            argv = ["ip", "netns", "exec", self.bed.spine_ns]
            argv += [sys.executable, "-m", "switchagg.aggregator_cli"]
            argv += ["--host", SPINE_IP, "--port", str(protocol.UDP_PORT), "--job", spec]
            path = out / "spine.counters.json"
            self.spine_node = Node("spine", [*argv, "--counters-json", str(path)], path)
            self.spine_node.start()

    def counters(self, name: str) -> dict[str, int]:
        """Job JOB's counters on the P4 switch ``name`` ("l0", "l1", "spine"): packets."""
        names = dict(p4_program.JOB_COUNTER_NAMES)
        if name != "spine":
            names |= p4_program.LEAF_COUNTER_NAMES
        s = self.sessions[name]
        return {k: min(s.read_counter(c, COUNTER_INDEX)[COUNTER_INDEX]) for k, c in names.items()}

    def drops(self, name: str) -> dict[str, int]:
        raw = self.sessions[name].read_counter(p4_program.DROP_COUNTER)
        return {r: min(raw.get(i, (0, 0))) for r, i in protocol.DROP_INDEX.items()}

    def stop_spine(self) -> dict[str, Any]:
        """The software spine's final counters (it must exit cleanly)."""
        assert self.spine_node is not None
        result = self.spine_node.stop()
        self.spine_node = None
        return result

    def close(self) -> None:
        if (
            self.spine_node is not None
            and self.spine_node.proc is not None
            and self.spine_node.proc.poll() is None
        ):
            self.spine_node.proc.kill()
            self.spine_node.proc.communicate(timeout=30)
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()


def start_workers(
    bed: P4Racks, slots: int, tensors: list[tuple[str, int]], out: Path, **cfg: Any
) -> list[subprocess.Popen[str]]:
    """Every worker of ``bed`` as job rank = its index, sending to its rack's leaf."""
    procs = []
    for w, rack in zip(bed.workers, bed.rack_of, strict=True):
        c = {
            "job": JOB, "rank": w.index, "n": len(bed.workers),
            "aggregator": [leaf_ip(rack), protocol.UDP_PORT], "slot_base": 0, "slots": slots,
            "k": protocol.P4_K, "bind": [w.ip, WORKER_PORT],
            "tensors": tensors, "out": str(out), "key": 0, **cfg,  # unkeyed, as the spine's spec
        }  # fmt: skip
        procs.append(w.popen([*WORKER, json.dumps(c)], stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def wait_workers(
    procs: list[subprocess.Popen[str]], timeout: float = 300
) -> list[subprocess.CompletedProcess[str]]:
    """Every worker's outcome (bounded: a hung one is killed and reported as such)."""
    return wait_all(procs, timeout)
