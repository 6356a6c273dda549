"""Running a job of worker processes against a software aggregator on this host."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from switchagg.aggregator import AggregatorHandle, new_key

WORKER = [sys.executable, "-m", "switchagg_lab.testing.worker"]


def _read_address(p: subprocess.Popen[str], deadline: float) -> tuple[str, int]:
    assert p.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout], [], [], 0.2)
        if ready:
            line = p.stdout.readline()
            if not line:
                break
            ip, port = json.loads(line)["address"]
            return str(ip), int(port)
        if p.poll() is not None:
            break
    p.kill()
    _, err = p.communicate(timeout=30)
    raise RuntimeError(f"a worker did not announce its address: {err.strip()[-1500:]}")


def run_job(
    agg: AggregatorHandle,
    job: int,
    n: int,
    tensors: list[tuple[str, int]],
    out: Path,
    *,
    slots: int,
    k: int,
    generation: int = 1,
    key: int | None = None,
    wait: float = 120.0,
    per_rank: dict[int, dict[str, Any]] | None = None,
    before_go: Callable[[list[tuple[str, int]]], None] | None = None,
    launcher: Callable[[int], list[str]] | None = None,
    **cfg: Any,
) -> list[subprocess.CompletedProcess[str]]:
    """Starts n workers, installs the job on ``agg`` with the addresses they bound, lets them run
    and waits for all (bounded by ``wait`` seconds: a hang fails instead of blocking); ``cfg`` and
    ``per_rank`` add worker config keys (switchagg_lab.testing.worker); ``before_go(addresses)`` runs
    between installing the job and letting the workers start; ``launcher(rank)`` prefixes rank's
    command line (e.g. ``ip netns exec NS``). ``key``: the job's result key, installed and given to
    every worker (None: a fresh random one; 0: unkeyed)."""
    if key is None:
        key = new_key()
    procs = []
    for rank in range(n):
        c = {
            "job": job,
            "rank": rank,
            "n": n,
            "aggregator": list(agg.address),
            "slots": slots,
            "k": k,
            "tensors": tensors,
            "out": str(out),
            "announce": True,
            "key": key,
            **cfg,
            **(per_rank or {}).get(rank, {}),
        }
        procs.append(
            subprocess.Popen(
                [*(launcher(rank) if launcher else []), *WORKER, json.dumps(c)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        deadline = time.monotonic() + 60
        addrs = [_read_address(p, deadline) for p in procs]
        agg.add_job(job, n, 0, slots, k, generation, addrs, key=key)
        if before_go is not None:
            before_go(addrs)
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        done = []
        deadline = time.monotonic() + wait
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
        return done
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
