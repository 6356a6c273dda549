"""The torch backend under stress: hundreds of iterations of delegated collectives (broadcast,
all_gather, all_gather_object, reduce_scatter, barrier) issued while a network allreduce is in
flight, plus network allreduces and DDP steps, on 4 ranks while two busy processes load both
cores. Before delegation was explicit this hung about once in 50 runs of far less (a GIL/gloo
queue-mutex deadlock, see switchagg/torch/backend.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from switchagg_lab.testing.torch_launch import finish, launch, read  # noqa: E402

N = 4
ITERATIONS = 200
LOAD_SECONDS = 240  # the load ends by itself even if the test process dies


def _load() -> list[subprocess.Popen[bytes]]:
    spin = f"import time\nend = time.monotonic() + {LOAD_SECONDS}\nwhile time.monotonic() < end: pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]


def _dump_stacks(pids: list[int]) -> str:
    """Native and Python stacks of hung ranks, when py-spy is installed (it is in the test extras)."""
    if shutil.which("py-spy") is None:
        return ""
    dumps = []
    for pid in pids:
        p = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True, text=True)
        dumps.append(p.stdout[-6000:] + p.stderr[-500:])
    return "\n====\n".join(dumps)


def test_delegated_collectives_network_allreduces_and_ddp_under_load(tmp_path: Path) -> None:
    load = _load()
    try:
        start = time.monotonic()
        workers = launch("stress", N, tmp_path, STRESS_ITERATIONS=str(ITERATIONS))
        results = finish(workers, on_hang=lambda: _dump_stacks([w.proc.pid for w in workers]))
        seconds = time.monotonic() - start
    finally:
        for p in load:
            p.kill()
            p.wait()
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
        r = read(tmp_path, rank)
        assert r["iterations"] == ITERATIONS
        assert r["wrong"] == [], r["wrong"]
        # 2 network allreduces per iteration, plus DDP's gradient buckets every 10th.
        assert r["network_allreduces"] >= 2 * ITERATIONS
    print(f"\n{N} ranks x {ITERATIONS} iterations under load: {seconds:.1f} s")
