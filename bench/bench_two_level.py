"""Two-level aggregation against the ring and against one flat aggregator, on racks whose uplinks
are capped below the worker links (switchagg_lab.testbed.racks: R racks x W workers, one leaf
namespace per rack, a spine; worker links capped at --rate, uplinks at --uplink-rate,
both ways, by tbf). Same run, same links:

* two-level: a software leaf per rack sums its workers and sends one partial over the uplink;
  the spine sums the leaves (docs/PROTOCOL.md, Two levels). An uplink carries S each way.
* flat: every worker sends to one software aggregator on the spine (one level); an uplink carries
  W * S each way.
* gloo: torch's ring allreduce over the same links, routed through leaves and spine; the ring
  crosses each uplink once per direction, with 2(n-1)/n * S.

Per point it prints the three times (the slowest rank's per allreduce, median over --reps) and
the uplink bound S/U. Every switchagg result is checked (int32-exact inputs are not needed:
float32 within the documented bound, the same bits on every rank). Writes
bench/results/two_level.json. Needs root, iproute2 and torch. Bounded: every run has a timeout.
    python bench/bench_two_level.py --racks 2 --per-rack 4 --sizes 16 64
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

import numpy as np

from switchagg.cli_util import add_renamed, parse_rate

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MB = 1 << 20
JOB = 1


def _slowest(out: Path, n: int, reps: int) -> list[float]:
    from switchagg_lab.testing.checks import result_file

    per_rank = [np.load(result_file(out, JOB, r))["seconds"][1:] for r in range(n)]  # [0]: warm-up
    return [max(float(t[i]) for t in per_rank) for i in range(reps)]


def _switchagg(
    bed: Any, out: Path, size_mb: int, reps: int, k: int, slots: int, flat: bool
) -> tuple[list[float], int]:
    """-> (the slowest rank's seconds per timed allreduce, retransmissions of all ranks)."""
    from switchagg import protocol
    from switchagg.aggregator import SoftwareAggregator
    from switchagg_lab.testbed.netns import in_netns
    from switchagg_lab.testbed.racks import SPINE_IP
    from switchagg_lab.testing.checks import check_results
    from switchagg_lab.testing.hierarchy import Layout, run_hierarchy
    from switchagg_lab.testing.local import run_job

    out.mkdir(parents=True)
    n = len(bed.workers)
    tensors = [("float32", size_mb * MB // 4)] * (reps + 1)
    wait = 300 + 30 * size_mb * reps
    if flat:
        with in_netns(bed.spine_ns):
            agg = SoftwareAggregator(host=SPINE_IP, port=protocol.UDP_PORT).start()
        try:
            procs = run_job(
                agg, JOB, n, tensors, out, slots=slots, k=k, wait=wait, timeout=60.0,
                per_rank={r: {"bind": [w.ip, 0]} for r, w in enumerate(bed.workers)},
                launcher=lambda r: ["ip", "netns", "exec", bed.workers[r].ns],
            )  # fmt: skip
        finally:
            agg.stop()
    else:
        ns = {f"h{w.index}": w.ns for w in bed.workers} | {f"l{lf.index}": lf.ns for lf in bed.leaves}
        ns["spine"] = bed.spine_ns
        layout = Layout(
            rack_of=bed.rack_of,
            leaf_binds=[("0.0.0.0", protocol.UDP_PORT)] * len(bed.leaves),
            leaf_addrs=[lf.address for lf in bed.leaves],
            leaf_views=[lf.spine_view for lf in bed.leaves],
            spine=(SPINE_IP, protocol.UDP_PORT),
            worker_bind=lambda rank: (bed.workers[rank].ip, 0),
            launcher=lambda name: ["ip", "netns", "exec", ns[name]],
        )
        procs = run_hierarchy(layout, JOB, tensors, out, slots=slots, k=k, wait=wait, timeout=60.0).workers
    bad = [p.stderr[-1500:] for p in procs if p.returncode != 0]
    if bad:
        raise RuntimeError(f"a switchagg rank failed: {bad}")
    stats = check_results(JOB, n, k, tensors, out)
    return _slowest(out, n, reps), sum(s["retransmits"] for s in stats)


_port = iter(range(29600, 30600))


def _gloo(bed: Any, size_mb: int, reps: int) -> list[float]:
    """bench_testbed.py's rank (torch.distributed, gloo) in every worker namespace."""
    n, port = len(bed.workers), next(_port)
    argv = [sys.executable, str(ROOT / "bench" / "bench_testbed.py"), "--worker", "--backend", "gloo"]
    argv += ["--size", str(size_mb), "--reps", str(reps)]
    procs = []
    for w in bed.workers:
        env = {
            **os.environ, "RANK": str(w.index), "WORLD_SIZE": str(n), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": bed.workers[0].ip, "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": w.ifname, "TORCH_CPP_LOG_LEVEL": "ERROR",
        }  # fmt: skip
        procs.append(w.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
    deadline = time.monotonic() + 300 + 30 * size_mb * reps
    reports = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"a gloo rank failed ({p.returncode}): {e.strip()[-1500:]}")
            reports.append(json.loads(o.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    return [max(r["times"][i] for r in reports) for i in range(reps)]


def bench(args: argparse.Namespace) -> int:
    from switchagg_lab.testbed import tools
    from switchagg_lab.testbed.racks import Racks

    reason = tools.missing_for(["ip", "tc"], "bench_two_level")
    if reason:
        print(reason, file=sys.stderr)
        return 2
    racks = [args.per_rack] * args.racks
    n = sum(racks)
    points = []
    print(f"{args.racks} racks x {args.per_rack} workers, worker links {args.worker_mbit:g} Mbit/s, "
          f"uplinks {args.uplink_mbit:g} Mbit/s")  # fmt: skip
    print(
        f"{'size':>6} {'two-level s':>11} {'flat s':>8} {'gloo s':>8} {'S/U s':>7} "
        f"{'gloo/2lvl':>9} {'flat/2lvl':>9}"
    )
    with (
        tempfile.TemporaryDirectory() as tmp,
        Racks(racks, worker_mbit=args.worker_mbit, uplink_mbit=args.uplink_mbit) as bed,
    ):
        for size in args.sizes:
            d = Path(tmp) / f"s{size}"
            two_runs, two_resent = _switchagg(bed, d / "two", size, args.reps, args.k, args.slots, flat=False)
            flat_runs, flat_resent = _switchagg(
                bed, d / "flat", size, args.reps, args.k, args.slots, flat=True
            )
            gloo_runs = _gloo(bed, size, args.reps)
            two, flat, gloo = (statistics.median(r) for r in (two_runs, flat_runs, gloo_runs))
            bound = size * MB * 8 / (args.uplink_mbit * 1e6)
            p = {
                "size_mb": size, "two_level_s": two, "flat_s": flat, "gloo_s": gloo, "uplink_bound_s": bound,
                "ring_uplink_bound_s": 2 * (n - 1) / n * bound, "runs_two_level": two_runs,
                "runs_flat": flat_runs, "runs_gloo": gloo_runs, "retransmits_two_level": two_resent,
                "retransmits_flat": flat_resent,
            }  # fmt: skip
            points.append(p)
            print(
                f"{size:4d}MB {two:11.2f} {flat:8.2f} {gloo:8.2f} {bound:7.2f} {gloo / two:8.2f}x "
                f"{flat / two:8.2f}x  (resent: two-level {two_resent}, flat {flat_resent})",
                flush=True,
            )
    result = {
        "host": {"cpus": os.cpu_count()},
        "racks": racks, "worker_mbit": args.worker_mbit, "uplink_mbit": args.uplink_mbit,
        "k": args.k, "slots": args.slots, "reps": args.reps, "points": points,
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--racks", type=int, default=2)
    p.add_argument("--per-rack", type=int, default=4, help="workers per rack")
    # --rate/--uplink-rate, as switchagg-testbed up --racks (Mbit/s, or tc's units: 400mbit, 1gbit)
    rate = p.add_argument(
        "--rate", dest="worker_mbit", type=parse_rate, default=400.0, metavar="RATE", help="worker link rate"
    )
    uplink = p.add_argument(
        "--uplink-rate",
        dest="uplink_mbit",
        type=parse_rate,
        default=200.0,
        metavar="RATE",
        help="leaf-spine link rate",
    )
    add_renamed(p, "--worker-mbit", rate)
    add_renamed(p, "--uplink-mbit", uplink)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 32], help="MB of float32")
    p.add_argument("--reps", type=int, default=2, help="timed allreduces per point (median)")
    p.add_argument("--k", type=int, default=2048, help="elements per packet (8 KiB datagrams: jumbo frames)")
    p.add_argument("--slots", type=int, default=128, help="slots (packets in flight) per job")
    p.add_argument("--out", default=str(RESULTS / "two_level.json"))
    return bench(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
