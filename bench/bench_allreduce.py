"""Benchmark of the host library and the software aggregator, with baselines from the same run.

(a) quantize + dequantize bandwidth against numpy copying the same buffer;
(b) allreduce time for 2 and 4 workers at 4, 64 and 256 MB against torch.distributed's gloo;
(c) packets per second and payload Gbit/s of the switchagg runs.
Prints a table and writes the figures as JSON (bench/results/allreduce.json by default).
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from switchagg import _core, protocol
from switchagg_lab.testing.kit import free_port
from switchagg_lab.testing.progress import Steps


def best_of(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_quantize(mb: int, reps: int, k: int) -> dict[str, float]:
    n_el = mb * (1 << 20) // 4
    x = np.random.default_rng(0).standard_normal(n_el, dtype=np.float32)
    blocks = (n_el + k - 1) // k
    q = np.empty(blocks * k, np.uint32)
    e = np.empty(blocks, np.int8)
    y = np.empty_like(x)
    dst = np.empty_like(x)
    t_copy = best_of(lambda: np.copyto(dst, x), reps)
    t_q = best_of(lambda: _core.quantize(x, q, e, 4, k), reps)
    t_d = best_of(lambda: _core.dequantize(q, e, y, 4, k), reps)
    gbs = lambda t: x.nbytes / t / 1e9  # noqa: E731
    return {
        "mb": mb,
        "copy_GBps": gbs(t_copy),
        "quantize_GBps": gbs(t_q),
        "dequantize_GBps": gbs(t_d),
        "quant_dequant_GBps": x.nbytes / (t_q + t_d) / 1e9,
        # A round trip reads the buffer and writes it back once, like one copy does.
        "ratio_to_copy": t_copy / (t_q + t_d),
    }


def _time_allreduces(allreduce: Any, fresh: Any, reps: int, bar: Any) -> list[float]:
    """One warm-up (page faults, socket buffers), then ``reps`` allreduces started together."""
    allreduce(fresh())
    times = []
    for _ in range(reps):
        y = fresh()
        bar.wait()
        t0 = time.perf_counter()
        allreduce(y)
        times.append(time.perf_counter() - t0)
    return times


def _switchagg_worker(
    rank: int,
    n: int,
    port: int,
    n_el: int,
    reps: int,
    k: int,
    slots: int,
    key: int,
    bar: Any,
    q: Any,
    go: Any,
) -> None:
    from switchagg import Session

    x = np.random.default_rng(rank).standard_normal(n_el, dtype=np.float32)
    with Session(1, rank, n, ("127.0.0.1", port), 0, slots, k, timeout=60, key=key) as s:
        q.put(("address", rank, s.local_address))  # the job is installed with every rank's address
        if not go.wait(60):
            raise SystemExit("the job was never installed")
        q.put(("times", rank, _time_allreduces(s.allreduce, x.copy, reps, bar), s.stats()))


def _gloo_worker(rank: int, n: int, port: int, n_el: int, reps: int, bar: Any, q: Any, go: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    x = torch.from_numpy(np.random.default_rng(rank).standard_normal(n_el, dtype=np.float32))
    q.put(("times", rank, _time_allreduces(dist.all_reduce, x.clone, reps, bar), {}))
    dist.destroy_process_group()


def _run(
    target: Any, n: int, args: tuple[Any, ...], install: Any = None
) -> tuple[list[float], list[dict[str, int]]]:
    """Runs n ranks of ``target``; ``install(addresses)`` is called once every rank announced its own."""
    ctx = mp.get_context("spawn")
    bar, q, go = ctx.Barrier(n), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=target, args=(r, n, *args, bar, q, go)) for r in range(n)]
    for p in procs:
        p.start()
    addresses: dict[int, tuple[str, int]] = {}
    out: list[list[Any]] = []
    while len(out) < n:
        kind, rank, *rest = q.get(timeout=600)
        if kind == "address":
            addresses[rank] = rest[0]
            if len(addresses) == n:
                install([addresses[r] for r in range(n)])
                go.set()
        else:
            out.append(rest)
    for p in procs:
        p.join(timeout=60)
    reps = len(out[0][0])
    # An allreduce is done when its slowest rank is done.
    per_rep = [max(o[0][i] for o in out) for i in range(reps)]
    return per_rep, [o[1] for o in out]


def bench_allreduce(n: int, mb: int, reps: int, k: int, slots: int, gloo: bool) -> dict[str, Any]:
    from switchagg.aggregator import SoftwareAggregator, new_key

    n_el = mb * (1 << 20) // 4
    key = new_key()  # the job's result key, as the job service would give it
    agg = SoftwareAggregator("127.0.0.1", 0)
    agg.start()
    try:

        def install(addrs: list[tuple[str, int]]) -> None:
            agg.add_job(1, n, 0, slots, k, 1, addrs, key=key)

        times, stats = _run(_switchagg_worker, n, (agg.address[1], n_el, reps, k, slots, key), install)
    finally:
        agg.stop()
    t_sa = statistics.median(times)
    pkts = sum(s["sent"] for s in stats) / (reps + 1)  # per allreduce, all workers
    row: dict[str, Any] = {
        "workers": n,
        "mb": mb,
        "switchagg_s": t_sa,
        "packets_per_s": pkts / t_sa,
        "payload_Gbps": n * n_el * 4 * 8 / t_sa / 1e9,
        "retransmits": sum(s["retransmits"] for s in stats),
    }
    if gloo:
        g_times, _ = _run(_gloo_worker, n, (free_port(), n_el, reps))
        row["gloo_s"] = statistics.median(g_times)
        row["speedup_vs_gloo"] = row["gloo_s"] / t_sa
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4,64,256", help="tensor sizes in MB")
    p.add_argument("--workers", default="2,4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--k", type=int, default=protocol.DEFAULT_SW_K)
    p.add_argument("--slots", type=int, default=protocol.DEFAULT_SW_SLOTS)
    p.add_argument("--no-gloo", action="store_true", help="skip the gloo baseline (torch not installed)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "allreduce.json"))
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    workers = [int(w) for w in args.workers.split(",")]

    print(f"(a) quantize + dequantize, K={args.k}, against numpy copying the same buffer")
    quant = [bench_quantize(mb, 5, args.k) for mb in (4, 64)]
    print(
        f"{'MB':>5} {'copy GB/s':>10} {'quant GB/s':>11} {'dequant GB/s':>13} {'q+dq GB/s':>10} {'ratio':>7}"
    )
    for r in quant:
        print(
            f"{r['mb']:>5} {r['copy_GBps']:>10.2f} {r['quantize_GBps']:>11.2f} {r['dequantize_GBps']:>13.2f} "
            f"{r['quant_dequant_GBps']:>10.2f} {r['ratio_to_copy']:>6.2f}x"
        )
    print(
        f"\n(b, c) float32 allreduce, median of {args.reps}, K={args.k}, {args.slots} slots, "
        f"{os.cpu_count()} cores"
    )
    print(
        f"{'n':>3} {'MB':>5} {'switchagg s':>12} {'gloo s':>8} {'speedup':>8} {'Mpkt/s':>7} "
        f"{'payload Gbit/s':>15}"
    )
    rows = []
    progress = Steps(len(workers) * len(sizes), len(workers) * sum(sizes))
    for n in workers:
        for mb in sizes:
            progress.step(f"n={n}, {mb} MB", mb)
            r = bench_allreduce(n, mb, args.reps, args.k, args.slots, not args.no_gloo)
            rows.append(r)
            g = (
                f"{r['gloo_s']:>8.3f} {r['speedup_vs_gloo']:>7.2f}x"
                if "gloo_s" in r
                else f"{'-':>8} {'-':>8}"
            )
            print(
                f"{n:>3} {mb:>5} {r['switchagg_s']:>12.3f} {g} {r['packets_per_s'] / 1e6:>7.3f} "
                f"{r['payload_Gbps']:>15.2f}",
                flush=True,
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"quantize": quant, "allreduce": rows, "cores": os.cpu_count()}, indent=2))
    progress.finish(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
