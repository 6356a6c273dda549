"""DDP step time and pure allreduce time, switchagg against gloo in the same run.

    python bench/bench_ddp.py [--workers 4] [--sizes 1,5,10,25,50] [--lanes 1,2] [--out bench/results]

Starts the workers itself (real processes on loopback, the embedded software aggregator);
each size's model is an MLP of 1024x1024 layers with about that many million parameters.
Times are the slowest rank's, median over --iters repetitions after one warm-up. Writes
ddp.json and ddp.png to --out and prints the ratios. --budget bounds the run: sizes left when
it is spent are skipped (and reported as skipped). --lanes times switchagg with each of those
SWITCHAGG_LANES (calls on the wire at once per group, docs/TORCH.md) in the same run, one group each.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from switchagg_lab.testing.kit import free_port
from switchagg_lab.testing.progress import Steps

WIDTH = 1024
BATCH = 16


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--sizes", default="1,5,10,25,50", help="model sizes in millions of parameters")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--lanes", default="", help="SWITCHAGG_LANES values to compare, e.g. 1,2 (default: the env's)"
    )
    p.add_argument("--budget", type=float, default=240.0, help="seconds; later sizes are skipped after it")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    try:
        args.sizes = [float(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes {args.sizes!r} is not a comma-separated list of numbers")
    try:
        args.lanes = [int(x) for x in args.lanes.split(",")] if args.lanes else []
    except ValueError:
        p.error(f"--lanes {args.lanes!r} is not a comma-separated list of integers")
    if not all(0 < s <= 200 for s in args.sizes):
        p.error("--sizes must be within (0, 200] million")
    if not 2 <= args.workers <= 16 or args.iters < 1 or args.budget <= 0:
        p.error("--workers must be within [2, 16], --iters and --budget positive")
    return args


# ---------------------------------------------------------------- worker side


def _slowest(seconds: float, group: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _timed(run: Callable[[], None], iters: int, group: Any) -> float:
    import torch.distributed as dist

    run()  # warm-up: first-touch of buffers, DDP's bucket rebuild
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        start = time.perf_counter()
        run()
        times.append(_slowest(time.perf_counter() - start, group))
    return statistics.median(times)


def _model(millions: float) -> Any:
    import torch

    layers = max(1, round(millions * 1e6 / (WIDTH * WIDTH + WIDTH)))
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _ddp_step(model: Any, x: Any) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()

    return step


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import switchagg.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("switchagg")
    net = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    # One switchagg group per --lanes value (the variable is read when a group is created).
    lane_groups: list[tuple[str, Any]] = []
    for lanes in args.lanes:
        os.environ["SWITCHAGG_LANES"] = str(lanes)
        lane_groups.append((f"switchagg_L{lanes}", dist.new_group(backend="switchagg")))
    networks = lane_groups or [("switchagg", net)]
    rank = dist.get_rank()
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    progress = Steps(len(args.sizes), sum(args.sizes)) if rank == 0 else None
    for millions in args.sizes:
        over = torch.tensor([1 if time.monotonic() - started > args.budget else 0])
        dist.broadcast(over, 0, group=gloo)  # rank 0's clock decides, so all ranks skip together
        if over.item():
            rows.append({"millions": millions, "skipped": True})
            continue
        if progress is not None:
            progress.step(f"{millions:g}M parameters: allreduce and DDP steps, gloo and switchagg", millions)
        model = _model(millions)
        params = sum(p.numel() for p in model.parameters())
        row: dict[str, Any] = {"millions": millions, "params": params, "skipped": False}
        buf = torch.randn(params)
        for name, group in (("gloo", gloo), *networks):
            row[f"allreduce_{name}"] = _timed(
                functools.partial(dist.all_reduce, buf, group=group), args.iters, gloo
            )
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
        for name, group in (("gloo", gloo), *networks):
            ddp = DDP(model, process_group=group)
            row[f"ddp_{name}"] = _timed(_ddp_step(ddp, x), args.iters, gloo)
            del ddp
        if lane_groups:  # the first --lanes value stands for switchagg in the table and plot
            for kind in ("allreduce", "ddp"):
                row[f"{kind}_switchagg"] = row[f"{kind}_{lane_groups[0][0]}"]
        # Compute alone, no communication: what the DDP step would cost on an infinitely fast network.
        row["compute"] = _timed(_ddp_step(model, x), args.iters, gloo)
        rows.append(row)
        del model, buf
    if progress is not None:
        progress.finish()
        Path(args.result).write_text(json.dumps({"workers": dist.get_world_size(), "rows": rows}))
    dist.barrier(group=gloo)


# ---------------------------------------------------------------- launcher side


def launch(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = out / "ddp.json.partial"
    result.unlink(missing_ok=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    env.update(WORLD_SIZE=str(args.workers), SWITCHAGG_BENCH_RESULT=str(result))
    env.pop("SWITCHAGG_JOB_SERVICE", None)  # the benchmark measures the embedded software aggregator
    procs = [
        subprocess.Popen([sys.executable, __file__, *argv], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
        for r in range(args.workers)
    ]
    hang_guard = args.budget * 3 + 300
    try:
        codes = [p.wait(timeout=hang_guard) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise SystemExit(f"a worker failed (exit codes {codes})")
    data: dict[str, Any] = json.loads(result.read_text())
    result.unlink()
    return data


def report(data: dict[str, Any], out: Path) -> None:
    rows = [r for r in data["rows"] if not r["skipped"]]
    print(f"\n{data['workers']} workers, loopback, software aggregator; seconds (slowest rank, median)")
    head = (
        f"{'params':>8} {'AR gloo':>9} {'AR sw':>9} {'gloo/sw':>8} "
        f"{'DDP gloo':>9} {'DDP sw':>9} {'gloo/sw':>8} {'compute':>9}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['params'] / 1e6:7.1f}M {r['allreduce_gloo']:9.4f} {r['allreduce_switchagg']:9.4f} "
            f"{r['allreduce_gloo'] / r['allreduce_switchagg']:8.2f} {r['ddp_gloo']:9.4f} "
            f"{r['ddp_switchagg']:9.4f} {r['ddp_gloo'] / r['ddp_switchagg']:8.2f} {r['compute']:9.4f}"
        )
    lanes = sorted(
        {k.removeprefix("ddp_switchagg_L") for r in rows for k in r if k.startswith("ddp_switchagg_L")},
        key=int,
    )
    if lanes:
        print("DDP step with SWITCHAGG_LANES=L (seconds; ratio to the first L)")
        for r in rows:
            first = r[f"ddp_switchagg_L{lanes[0]}"]
            cells = " ".join(
                f"L={lane}: {r[f'ddp_switchagg_L{lane}']:.4f} ({first / r[f'ddp_switchagg_L{lane}']:.2f}x)"
                for lane in lanes
            )
            print(f"{r['params'] / 1e6:7.1f}M {cells}")
    for r in data["rows"]:
        if r["skipped"]:
            print(f"{r['millions']:7g}M skipped: --budget spent")
    (out / "ddp.json").write_text(json.dumps(data, indent=1))
    if rows:
        plot(data["workers"], rows, out / "ddp.png")
    print(f"wrote {out / 'ddp.json'}" + (f" and {out / 'ddp.png'}" if rows else ""))


def plot(workers: int, rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = [r["params"] / 1e6 for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, kind, title in (
        (axes[0], "allreduce", "allreduce of the gradients"),
        (axes[1], "ddp", "DDP step"),
    ):
        ax.plot(size, [r[f"{kind}_gloo"] for r in rows], "o-", label="gloo")
        ax.plot(size, [r[f"{kind}_switchagg"] for r in rows], "s-", label="switchagg")
        if kind == "ddp":
            ax.plot(size, [r["compute"] for r in rows], "^--", color="gray", label="compute only")
        ax.set_xlabel("model size (million float32 parameters)")
        ax.set_ylabel("seconds")
        ax.set_title(f"{title}, {workers} workers")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if "RANK" in os.environ:
        args.result = os.environ["SWITCHAGG_BENCH_RESULT"]
        worker(args)
        return 0
    report(launch(args, argv), Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
