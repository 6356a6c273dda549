"""Time to accuracy: DDP training of examples/train_digits.py on the emulated rack, gloo against
switchagg, same run, same links (switchagg_lab.testbed: one namespace per worker, every link capped
at --rate both ways; switchagg through the testbed's job service, its software aggregator in the
switch namespace).

Per backend and epoch it records the test accuracy and the training time so far (the sum of the
step times: forward, backward with DDP's gradient allreduces, optimizer), prints the step time of
each backend and their ratio, the time each took to reach --target accuracy, and writes
bench/results/time_to_accuracy.json and .png (accuracy against training time; step time per
backend). Both backends start from the same seed and see the same batches, so their accuracy
curves should lie on one another; switchagg's only shifts left where its allreduce is faster.

Needs root, iproute2 and torch. Bounded: every run has a timeout.
    python bench/bench_time_to_accuracy.py                  # n=8, 200mbit, 4 epochs (~10 min)
    python bench/bench_time_to_accuracy.py --workers 4 --epochs 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from switchagg.cli_util import parse_rate
from switchagg_lab.testing.kit import wait_all

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BACKENDS = ("gloo", "switchagg")


def run_ranks(bed: Any, workdir: Path, argv: list[str], timeout: float, port: int) -> list[str]:
    """``argv`` on every rank of the rack at once; their standard outputs."""
    from switchagg_lab.testbed.testbed_controller import worker_env

    procs = []
    for e in bed.endpoints:
        env = {
            **os.environ,
            **worker_env(bed.endpoints, e.index, workdir, port),
            "TORCH_CPP_LOG_LEVEL": "ERROR",
        }
        procs.append(e.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
    done = wait_all(procs, timeout)
    failed = [d for d in done if d.returncode != 0]
    if failed:
        raise RuntimeError(f"a rank failed ({failed[0].returncode}): {failed[0].stderr[-2000:]}")
    return [d.stdout for d in done]


def train(bed: Any, workdir: Path, backend: str, args: argparse.Namespace, port: int) -> list[dict[str, Any]]:
    """One training run of every rank; rank 0's per-epoch history."""
    out = workdir / f"train-{backend}.json"
    argv = [sys.executable, str(ROOT / "examples" / "train_digits.py"), "--backend", backend]
    argv += ["--epochs", str(args.epochs), "--hidden", str(args.hidden), "--json", str(out)]
    run_ranks(bed, workdir, argv, args.timeout, port)
    history: list[dict[str, Any]] = json.loads(out.read_text())["history"]
    elapsed = 0.0
    for record in history:
        elapsed += record["train_s"]
        record["elapsed_s"] = elapsed
    return history


def gradient_mb(hidden: int) -> int:
    """train_digits.py's gradient in MB (its MLP 64 -> hidden -> hidden -> 10, float32), at least 1."""
    params = 64 * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10
    return max(1, round(params * 4 / 1e6))


def allreduce_only(bed: Any, workdir: Path, backend: str, args: argparse.Namespace, port: int) -> float:
    """Seconds of one allreduce of the gradient's size on its own (bench_testbed.py's worker, the
    slowest rank per repetition, median of 5): the gain DDP's step could reach at best."""
    argv = [sys.executable, str(ROOT / "bench" / "bench_testbed.py"), "--worker", "--backend", backend]
    argv += ["--size", str(gradient_mb(args.hidden)), "--reps", "5"]
    outs = run_ranks(bed, workdir, argv, args.timeout, port)
    reports = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    slowest = [max(r["times"][i] for r in reports) for i in range(5)]
    return statistics.median(slowest)


def time_to(history: list[dict[str, Any]], target: float) -> float | None:
    """Training seconds until the first epoch at or above ``target`` accuracy (None: never)."""
    return next((r["elapsed_s"] for r in history if r["accuracy"] >= target), None)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, steps) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]})
    for backend, history in result["runs"].items():
        acc.plot([0] + [r["elapsed_s"] for r in history], [0.1] + [r["accuracy"] for r in history],
                 marker="o", label=backend)  # fmt: skip
    acc.axhline(result["target"], color="grey", linestyle=":", linewidth=1)
    acc.set_xlabel("training time (s)")
    acc.set_ylabel("test accuracy")
    acc.set_title(f"DDP, {result['n']} workers, {result['rate_mbit']:g} Mbit/s links")
    acc.legend()
    names = list(result["runs"])
    ms = [sum(r["step_ms"] for r in result["runs"][b]) / len(result["runs"][b]) for b in names]
    steps.bar(names, ms, color=["tab:blue", "tab:orange"])
    steps.set_ylabel("step time (ms)")
    steps.set_title(f"{result['speedup']:.2f}x faster steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bench(args: argparse.Namespace) -> int:
    from switchagg_lab.testbed import Testbed, tools
    from switchagg_lab.testbed.testbed_controller import start_job_service

    reason = tools.missing_for(["ip", "tc"], "bench_time_to_accuracy")
    if reason:
        print(reason, file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, Any]]] = {}
    alone: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        with Testbed(args.workers, workdir, data_plane="soft", rate_mbit=args.rate) as bed:
            service = start_job_service(bed, workdir, sw_k=args.k, sw_slots=args.slots)
            try:
                for port, backend in enumerate(BACKENDS, start=29600):
                    print(
                        f"training on {backend} ({args.workers} workers, {args.rate:g} Mbit/s) ...",
                        flush=True,
                    )
                    runs[backend] = train(bed, workdir, backend, args, port)
                    for r in runs[backend]:
                        done = f"accuracy {r['accuracy']:.2%} after {r['elapsed_s']:.1f} s"
                        print(f"  epoch {r['epoch']}: {done} (step {r['step_ms']:.0f} ms)", flush=True)
                    alone[backend] = allreduce_only(bed, workdir, backend, args, port + 10)
                    mb = gradient_mb(args.hidden)
                    print(f"  one {mb} MB allreduce alone: {alone[backend]:.3f} s", flush=True)
            finally:
                service.kill()
                service.wait(timeout=30)
    step = {b: sum(r["step_ms"] for r in h) / len(h) for b, h in runs.items()}
    # The first epoch also pays the set-up (gloo's connections, the job's join, DDP's first step).
    later = {b: sum(r["step_ms"] for r in h[1:]) / len(h[1:]) for b, h in runs.items() if len(h) > 1}
    result = {
        "n": args.workers,
        "rate_mbit": args.rate,
        "hidden": args.hidden,
        "cpus": os.cpu_count(),
        "target": args.target,
        "speedup": step["gloo"] / step["switchagg"],
        "speedup_after_first_epoch": later["gloo"] / later["switchagg"] if later else None,
        "gradient_mb": gradient_mb(args.hidden),
        "allreduce_s": alone,
        "allreduce_speedup": alone["gloo"] / alone["switchagg"],
        "time_to_target_s": {b: time_to(h, args.target) for b, h in runs.items()},
        "final_accuracy": {b: h[-1]["accuracy"] for b, h in runs.items()},
        "runs": runs,
    }
    result["fraction_of_allreduce_gain"] = result["speedup"] / result["allreduce_speedup"]
    print(f"step time: gloo {step['gloo']:.0f} ms, switchagg {step['switchagg']:.0f} ms: "
          f"{result['speedup']:.2f}x; time to {args.target:.0%}: {result['time_to_target_s']}")  # fmt: skip
    if later:
        print(f"after the first epoch: gloo {later['gloo']:.0f} ms, switchagg {later['switchagg']:.0f} ms: "
              f"{result['speedup_after_first_epoch']:.2f}x")  # fmt: skip
    print(f"allreduce alone ({result['gradient_mb']} MB): {result['allreduce_speedup']:.2f}x; the DDP step "
          f"reaches {result['fraction_of_allreduce_gain']:.0%} of it")  # fmt: skip
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
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048, help="train_digits.py --hidden (gradient size)")
    p.add_argument("--target", type=float, default=0.9, help="the accuracy whose time is reported")
    p.add_argument("--k", type=int, help="elements per packet (default: the most one frame carries)")
    p.add_argument("--slots", type=int, help="slots per job (default: protocol.WINDOW_BYTES of packets)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per training run")
    p.add_argument("--out", default=str(RESULTS / "time_to_accuracy.json"))
    return bench(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
