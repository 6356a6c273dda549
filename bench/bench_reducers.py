"""Reducer hosts against the ring and the switch (issue 25), on one emulated rack: n workers and M_max
reducer hosts, each in a namespace of its own behind a link capped at R both ways
(switchagg_lab.testbed, ``Testbed(reducers=...)``), the job service with the reducers as its pool and
its own aggregator in the switch namespace. Same run, same links, one after the other:

* gloo: torch's ring allreduce; each worker moves 2(n-1)/n * S each way.
* switchagg striped across M reducer hosts (M = 1, 2, 4, 8): each worker sends S and receives S,
  each reducer receives and sends n*S/M; bound max(S/R, n*S/(M*R)).
* switchagg on the switch (SWITCHAGG_SHARDS=0): the aggregator in the switch namespace has no link
  of its own (an in-network switch); bound S/R.

Per point it prints the time (the slowest rank's, median of --reps), gloo's time over it, the
fraction of its bound, retransmissions and the host's CPU load; writes bench/results/reducers.json
and reducers.png. The workers are bench/bench_testbed.py's (run as a program). Needs root,
iproute2 and torch. Bounded: every run has a timeout.

    python bench/bench_reducers.py                         # n=8, 200 Mbit/s, 64 MB, M = 1 2 4 8
    python bench/bench_reducers.py --size 16 --reps 1 --shards 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from switchagg.cli_util import parse_rate

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORKER = ROOT / "bench" / "bench_testbed.py"
MB = 1 << 20


def load_average() -> list[float]:
    return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]


def run_ranks(
    bed: Any, workdir: Path, argv: list[str], extra_env: dict[str, str], timeout: float, port: int
) -> list[dict[str, Any]]:
    from switchagg_lab.testbed.testbed_controller import worker_env

    procs = []
    for e in bed.endpoints:
        env = {
            **os.environ,
            **worker_env(bed.endpoints, e.index, workdir, port),
            "TORCH_CPP_LOG_LEVEL": "ERROR",
        }
        procs.append(e.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**env, **extra_env}))
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"a rank failed ({p.returncode}): {err.strip()[-2000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"a rank did not finish within {timeout:.0f} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    return outs


def measure(
    bed: Any, workdir: Path, backend: str, shards: int, args: argparse.Namespace, port: int
) -> dict[str, Any]:
    argv = [sys.executable, str(WORKER), "--worker", "--backend", backend, "--size", str(args.size)]
    argv += ["--reps", str(args.reps)]
    env = {"SWITCHAGG_SHARDS": str(shards), "SWITCHAGG_JOB_NAME": f"bench-{backend}-{shards}-{port}"}
    bound = args.size * MB * 8 / (args.rate * 1e6)
    load = load_average()
    reports = run_ranks(bed, workdir, argv, env, 180 + 30 * bound * args.reps * bed.n, port)
    slowest = [max(r["times"][i] for r in reports) for i in range(args.reps)]
    return {
        "seconds": statistics.median(slowest),
        "all_seconds": slowest,
        "max_error": max(r["max_error"] for r in reports),
        "cpu_busy": reports[0]["cpu_busy"],
        "load_before": load,
        "retransmits": sum(r.get("retransmits", 0) for r in reports),
        "sent": sum(r.get("sent", 0) for r in reports),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in result["points"] if p["system"] == "reducers"]
    ms = [p["shards"] for p in pts]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(ms, [p["seconds"] for p in pts], "s-", label="switchagg, M reducer hosts")
    ax.plot(ms, [p["bound_s"] for p in pts], "k--", label="bound max(S/R, nS/(MR))")
    for p in result["points"]:
        if p["system"] == "gloo":
            ax.axhline(p["seconds"], color="tab:orange", label=f"gloo ring ({p['seconds']:.1f} s)")
            ax.axhline(p["bound_s"], color="tab:orange", ls=":", label="ring bound 2(n-1)/n S/R")
        if p["system"] == "switch":
            ax.axhline(
                p["seconds"],
                color="tab:green",
                ls="-.",
                label=f"switchagg on the switch ({p['seconds']:.1f} s)",
            )
    h = result["host"]
    ax.set_title(
        f"n={h['n']} workers, {h['size_mb']} MB float32, links {h['rate_mbit']:g} Mbit/s", fontsize=9
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("reducer hosts M")
    ax.set_ylabel("allreduce time (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bench(args: argparse.Namespace) -> int:
    from switchagg_lab.testbed import Testbed, tools
    from switchagg_lab.testbed.reducer_hosts import start_reducer_service
    from switchagg_lab.testbed.testbed_controller import service_address  # noqa: F401 (the workers' env)

    reason = tools.missing_for(["ip", "tc"], "bench_reducers")
    if reason:
        print(reason, file=sys.stderr)
        return 2
    n, size, rate = args.workers, args.size, args.rate
    bound = size * MB * 8 / (rate * 1e6)
    points: list[dict[str, Any]] = []
    ports = iter(range(29600, 30000))
    print(f"n={n}, {size} MB float32, links {rate:g} Mbit/s: S/R = {bound:.2f} s; load {load_average()}")
    print(
        f"{'system':<16} {'seconds':>8} {'gloo/x':>7} {'bound s':>8} {'of bound':>8} {'resent':>7} {'cpu':>5}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp) / "bed"
        with Testbed(n, workdir, data_plane="soft", rate_mbit=rate, reducers=max(args.shards)) as bed:
            pids = start_reducer_service(bed, workdir, sw_k=args.k, sw_slots=args.slots)
            try:
                runs = [("gloo", "gloo", 0), ("switch", "switchagg", 0)]
                runs += [("reducers", "switchagg", m) for m in args.shards]
                gloo_s = None
                for system, backend, m in runs:
                    r = measure(bed, workdir, backend, m, args, next(ports))
                    if system == "gloo":
                        b = 2 * (n - 1) / n * bound
                        gloo_s = r["seconds"]
                    elif system == "switch":
                        b = bound
                    else:
                        b = max(bound, n * bound / m)
                    assert gloo_s is not None
                    label = f"reducers M={m}" if system == "reducers" else system
                    secs = r["seconds"]
                    p = {"system": system, "shards": m, "bound_s": b, "of_bound": b / secs,
                         "speedup_vs_gloo": gloo_s / secs, "of_s_over_r": bound / secs, **r}  # fmt: skip
                    points.append(p)
                    print(
                        f"{label:<16} {secs:8.2f} {p['speedup_vs_gloo']:6.2f}x {b:8.2f} {p['of_bound']:7.0%} "
                        f"{r['retransmits']:7d} {r['cpu_busy']:5.0%}  (load {r['load_before'][0]:.1f})",
                        flush=True,
                    )
            finally:
                for pid in pids.values():
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
    result = {
        "host": {
            "cpus": os.cpu_count(),
            "n": n,
            "size_mb": size,
            "rate_mbit": rate,
            "k": args.k,
            "slots": args.slots,
            "reps": args.reps,
            "load_after": load_average(),
        },  # fmt: skip
        "points": points,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rate", type=parse_rate, default=200.0, help="link rate: Mbit/s, or 1gbit, 200mbit")
    p.add_argument("--size", type=int, default=64, help="MB of float32")
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4, 8], help="reducer hosts M to try")
    p.add_argument("--reps", type=int, default=2, help="timed allreduces per point (median)")
    p.add_argument("--k", type=int, help="elements per packet (default: the most one frame carries)")
    p.add_argument(
        "--slots", type=int, default=8, help="slots per job (a striped job's: split over its shards)"
    )
    p.add_argument("--out", default=str(RESULTS / "reducers.json"))
    return bench(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
