"""Running allreduce worker processes in the endpoint namespaces and checking their sums."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from bmv2_testbed import AGG_IP, Endpoint
from bmv2_worker import inputs

from switchagg import protocol
from switchagg_controller.model import Job

WORKER = str(Path(__file__).parent / "bmv2_worker.py")


def start_job(
    job: Job, endpoints: list[Endpoint], tensors: list[tuple[str, int]], out: Path, seed: int = 0
) -> list[subprocess.Popen[str]]:
    procs = []
    for w, e in zip(job.workers, endpoints, strict=True):
        cfg = {
            "job": job.job_id,
            "rank": w.rank,
            "n": job.n,
            "aggregator": AGG_IP,
            "slot_base": job.slot_base,
            "slots": job.slot_count,
            "bind": e.ip,
            "port": w.udp_port,
            "tensors": tensors,
            "seed": seed,
            "out": str(out),
        }
        procs.append(
            e.popen([sys.executable, WORKER, json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    return procs


def finish(procs: list[subprocess.Popen[str]], timeout: float = 300) -> None:
    """Waits for every worker (bounded) and fails with their stderr if one failed."""
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate(timeout=30)
            errors.append(f"a rank hung and was killed: {err.strip()[-1500:]}")
            continue
        if p.returncode != 0:
            errors.append(f"rank exited {p.returncode}: {err.strip()[-1500:]}")
    assert not errors, "\n".join(errors)


def check_results(job: Job, tensors: list[tuple[str, int]], out: Path, seed: int = 0) -> list[dict[str, int]]:
    """Asserts every rank holds the exact int32 sum (float32: within the documented bound); returns stats."""
    stats = []
    for i, (dtype, size) in enumerate(tensors):
        xs = [inputs(job.job_id, r, size, dtype, seed + i) for r in range(job.n)]
        for r in range(job.n):
            got = np.load(out / f"job{job.job_id}_rank{r}.npz")[f"t{i}"]
            if dtype == "int32":
                want = np.sum([x.astype(np.int64) for x in xs], axis=0).astype(np.int32)  # wraps like int32
                assert np.array_equal(got, want), f"job {job.job_id} rank {r} tensor {i}: int32 sum differs"
            else:
                exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
                bound = _float_bound(xs, job.n)
                bad = np.abs(got.astype(np.float64) - exact) > bound
                assert not bad.any(), (
                    f"job {job.job_id} rank {r} tensor {i}: {int(bad.sum())} elements off bound"
                )
    for r in range(job.n):
        stats.append(json.loads(str(np.load(out / f"job{job.job_id}_rank{r}.npz")["stats"])))
    return stats


def _float_bound(xs: list[np.ndarray], n: int) -> np.ndarray:
    k = protocol.P4_K
    peak = np.max([np.abs(x) for x in xs], axis=0)
    blocks = (peak.size + k - 1) // k
    padded = np.zeros(blocks * k, np.float32)
    padded[: peak.size] = peak
    e = np.frexp(padded.reshape(blocks, k).max(axis=1))[1]
    return np.repeat([protocol.error_bound(n, int(x)) for x in e], k)[: peak.size]
