"""The worker program of the controller tests: ``python -m switchagg_lab.testing.job_worker CONFIG``.

Joins a job through the job service, allreduces int32 tensors whose exact sum it knows, and
prints one JSON report as its last stdout line. CONFIG (JSON) keys, with their defaults:

  service, secret, name, n     the job service and the job to join
  rank=None  ip="127.0.0.1"    the rank asked for (None: any), the address to bind
  timeout=10  join_timeout=60  the session's no-progress timeout, the join's
  length=1000  seed=0          iteration i sums (arange(length) * (seed+i+1) + 7*rank - 3)
  iterations=1                 int32 allreduces at most
  stdin=False                  step by stdin: print {"job_id", "k"} once joined, then do one
                               allreduce per line read (printing {"sum": x[0], "hello_rounds"}), until EOF
  progress=None                a file that holds the number of allreduces done so far
  stop=None                    a file that ends the run: empty, at the next iteration; a number,
                               at that iteration (one no rank began yet: stop_together)
  float_round=False            one float32 allreduce of (rank+1)/2 after the int32 ones
  float_size=0                 then one float32 allreduce of checks.inputs(0, rank, float_size,
                               "float32", seed), checked against the protocol's bound
                               (report "float_excess": the largest |error| - bound, <= 0 is good)
  ips=None                     a worker with one interface per rail: its address on each, one
                               socket bound per rail (shard s through rail s)
  leave=False                  leave the job explicitly (report "removed") before the session closes
  catch=False                  a SwitchaggError ends the run with "error" in the report (exit 0)

The report: rank, job_id, slot_base, slot_count, k, data_plane, ok, wrong (exact sums or not),
error, int_sum and int_head (the last int32 result), float_head, float_excess, removed, and a
striped job's shards ([node, aggregator_ip, udp_port] each) and local addresses.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from switchagg import Session, SwitchaggError, jobclient

PROGRAM = [sys.executable, "-m", "switchagg_lab.testing.job_worker"]


def tensor(length: int, multiplier: int, rank: int) -> np.ndarray:
    return (np.arange(length, dtype=np.int64) * multiplier + 7 * rank - 3).astype(np.int32)


def expected(length: int, multiplier: int, n: int) -> np.ndarray:
    base = np.arange(length, dtype=np.int64)
    return (base * multiplier * n + 7 * n * (n - 1) // 2 - 3 * n).astype(np.int32)


def _stopped(stop: Path | None, iteration: int) -> bool:
    if stop is None or not stop.exists():
        return False
    at = stop.read_text().strip()
    return not at or iteration >= int(at)


def _steps(cfg: dict[str, Any], s: Session) -> Any:
    """The iterations to run: a range, or one per stdin line."""
    if not cfg.get("stdin"):
        yield from range(cfg.get("iterations", 1))
        return
    print(json.dumps({"job_id": s.assignment.job_id, "k": s.assignment.k}), flush=True)
    for i, _ in enumerate(sys.stdin):
        yield i


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    n, length, seed = cfg["n"], cfg.get("length", 1000), cfg.get("seed", 0)
    progress = Path(cfg["progress"]) if cfg.get("progress") else None
    stop = Path(cfg["stop"]) if cfg.get("stop") else None
    report: dict[str, Any] = {"ok": 0, "wrong": 0, "error": None, "removed": None}
    bind: Any = [(ip, 0) for ip in cfg["ips"]] if cfg.get("ips") else (cfg.get("ip", "127.0.0.1"), 0)
    with Session.from_job_service(
        cfg["service"], cfg["secret"], cfg["name"], n, rank=cfg.get("rank"), bind=bind,
        timeout=cfg.get("timeout", 10.0), join_timeout=cfg.get("join_timeout", 60.0),
    ) as s:  # fmt: skip
        a = s.assignment
        report.update(rank=a.rank, job_id=a.job_id, slot_base=a.slot_base, slot_count=a.slot_count, k=a.k,
                      data_plane=a.data_plane, local=s.local_addresses,
                      shards=[[sh.node, sh.aggregator_ip, sh.udp_port] for sh in a.shards])  # fmt: skip
        try:
            for it in _steps(cfg, s):
                if _stopped(stop, it):
                    break
                x = tensor(length, seed + it + 1, a.rank)
                s.allreduce(x)
                exact = np.array_equal(x, expected(length, seed + it + 1, n))
                report["ok" if exact else "wrong"] += 1
                report.update(int_sum=int(x.astype(np.int64).sum()), int_head=x[:4].tolist())
                if cfg.get("stdin"):
                    print(
                        json.dumps({"sum": int(x[0]), "hello_rounds": s.stats()["hello_rounds"]}), flush=True
                    )
                if progress is not None:
                    progress.write_text(str(it + 1))
            if cfg.get("float_round"):
                y = np.ones(length, dtype=np.float32) * (a.rank + 1) * 0.5
                s.allreduce(y)
                report["float_head"] = y[:4].tolist()
            if cfg.get("float_size"):
                report["float_excess"] = _float_round(s, n, cfg["float_size"], seed)
        except SwitchaggError as e:  # e.g. the switch restarted mid-round: a clear error, no sum
            if not cfg.get("catch"):
                raise
            report["error"] = f"{type(e).__name__}: {e}"
        report["retransmits"] = [st["retransmits"] for st in s.shard_stats()]  # per shard
        if cfg.get("leave"):
            report["removed"] = jobclient.leave(cfg["service"], cfg["secret"], a)
    return report


def _float_round(s: Session, n: int, size: int, seed: int) -> float:
    """One float32 allreduce of seeded inputs; the largest |result - exact sum| - protocol bound."""
    from switchagg_lab.testing.checks import float_bound, inputs

    xs = [inputs(0, r, size, "float32", seed) for r in range(n)]
    y = xs[s.rank].copy()
    s.allreduce(y)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    return float(np.max(np.abs(y.astype(np.float64) - exact) - float_bound(xs, s.k)))


def progress_of(files: Sequence[Path]) -> list[int]:
    """The allreduces each worker finished so far (0 for a file not there or read mid-write)."""
    done = []
    for f in files:
        try:
            done.append(int(f.read_text() or 0))
        except (OSError, ValueError):
            done.append(0)
    return done


def stop_together(stop: Path, progress: Sequence[Path]) -> None:
    """Ends the workers' run at one iteration none of them began yet. (An empty stop file ends
    each at its next check: one that finished an allreduce first may begin the next one while
    its peers stop, and then waits for its session timeout.) Peers are at most one allreduce
    apart, and a progress file read mid-write counts 0: two past the most seen is safe."""
    part = stop.with_name(stop.name + ".part")
    part.write_text(str(max(progress_of(progress)) + 2))
    os.replace(part, stop)  # whole: a worker never reads half of it


def main(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    print(json.dumps(run(json.loads(args[0]))), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
