"""Running allreduce worker processes in the endpoint namespaces and checking their sums."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from switchagg import protocol
from switchagg_controller.model import Job
from switchagg_lab.testbed import AGG_IP, Endpoint
from switchagg_lab.testing import checks
from switchagg_lab.testing.kit import wait_all
from switchagg_lab.testing.local import WORKER


def start_job(
    job: Job, endpoints: list[Endpoint], tensors: list[tuple[str, int]], out: Path, seed: int = 0
) -> list[subprocess.Popen[str]]:
    procs = []
    for w, e in zip(job.workers, endpoints, strict=True):
        cfg = {
            "job": job.job_id,
            "rank": w.rank,
            "n": job.n,
            "aggregator": [AGG_IP, protocol.UDP_PORT],
            "slot_base": job.slot_base,
            "slots": job.slot_count,
            "k": protocol.P4_K,
            "bind": [e.ip, w.udp_port],
            "tensors": tensors,
            "seed": seed,
            "out": str(out),
            "key": job.key,  # the one installed on the switch (0, UNKEYED, unless the job has one)
        }
        procs.append(e.popen([*WORKER, json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def finish(procs: list[subprocess.Popen[str]], timeout: float = 300) -> None:
    """Waits for every worker (bounded) and fails with their stderr if one failed."""
    errors = [
        f"rank exited {d.returncode}: {d.stderr.strip()[-1500:]}"
        for d in wait_all(procs, timeout)
        if d.returncode
    ]
    assert not errors, "\n".join(errors)


def check_results(job: Job, tensors: list[tuple[str, int]], out: Path, seed: int = 0) -> list[dict[str, int]]:
    """Asserts every rank holds the exact int32 sum (float32: within the documented bound); returns stats."""
    return checks.check_results(job.job_id, job.n, protocol.P4_K, tensors, out, seed)
