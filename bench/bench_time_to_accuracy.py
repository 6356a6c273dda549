"""Time to accuracy: DDP training of examples/train_digits.py on the emulated rack, every way of
summing the gradients a user would weigh, same run, same links (switchagg_lab.testbed: one namespace
per worker, every link capped at --rate both ways; switchagg through the testbed's job service, its
software aggregator in the switch namespace):

* gloo: DDP's float32 ring allreduce (the reference);
* gloo + fp16_compress_hook: torch's one-line compression (float16 on the ring);
* gloo + PowerSGD: torch's powerSGD_hook, rank 4, error feedback and warm start (torch 2.13 on gloo
  deadlocks once DDP has more buckets than gloo has threads, 2: each bucket's callback waits, on a
  gloo thread, for an allreduce that needs one; then the run is reported hung, with where rank 0's
  threads were parked, and "gloo + PowerSGD, one bucket" runs it with DDP's whole gradient in one
  bucket, where it runs);
* switchagg 32 / 16 / 8: switchagg.torch.allreduce_hook with bits=32, 16 and 8 (8 with error feedback,
  the hook's default there).

All start from the same seed and see the same batches. Per method and epoch it records the test
accuracy and the training time so far (the sum of the step times: forward, backward with DDP's
gradient allreduces, optimizer); it prints the steady step time (epochs after the first, which also
pays the set-up), its ratio to gloo's and to gloo + fp16_compress_hook's, the accuracy per epoch, the
final accuracy and the time to --target accuracy. A run that makes no epoch for --stall seconds is
killed and recorded as hung (never an exception). --small-hidden repeats the set at a small width
(default 256: a gradient of 85k values, where torch's PowerSGD runs with its default buckets).
Writes bench/results/time_to_accuracy.json and .png (accuracy against training time, every run;
steady step time per method).

Needs root, iproute2 and torch. Bounded: every run has a timeout.
    python bench/bench_time_to_accuracy.py                  # n=8, 200mbit, 4 epochs (~25 min)
    python bench/bench_time_to_accuracy.py --workers 2 --epochs 1 --hidden 256 --small-hidden 0
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from switchagg.cli_util import parse_rate
from switchagg_lab.testing.kit import wait_all

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
EXAMPLE = ROOT / "examples" / "train_digits.py"


@dataclass(frozen=True)
class Method:
    label: str  # as the table names it
    argv: tuple[str, ...]  # train_digits.py's options
    color: str


METHODS = {
    "gloo": Method("gloo (float32 ring)", ("--backend", "gloo"), "tab:blue"),
    "gloo+fp16": Method("gloo + fp16_compress_hook", ("--backend", "gloo", "--hook", "fp16"), "tab:cyan"),
    "gloo+powersgd": Method(
        "gloo + PowerSGD (rank 4, EF)", ("--backend", "gloo", "--hook", "powersgd"), "tab:green"
    ),
    # --bucket-cap-mb is added per width (gradient_mb + 1): DDP's whole gradient in one bucket
    "gloo+powersgd-1bucket": Method(
        "gloo + PowerSGD (rank 4, EF), one bucket", ("--backend", "gloo", "--hook", "powersgd"), "tab:olive"
    ),
    "switchagg32": Method("switchagg, 32-bit lanes", ("--backend", "hook", "--bits", "32"), "tab:orange"),
    "switchagg16": Method("switchagg, 16-bit lanes", ("--backend", "hook", "--bits", "16"), "tab:red"),
    "switchagg8": Method("switchagg, 8-bit lanes + EF", ("--backend", "hook", "--bits", "8"), "tab:purple"),
}
# Where the whole gradient is one bucket anyway (the small width), the one-bucket run is the plain one.
SMALL_METHODS = [m for m in METHODS if m != "gloo+powersgd-1bucket"]


def rank_env(bed: Any, workdir: Path, index: int, port: int) -> dict[str, str]:
    from switchagg_lab.testbed.testbed_controller import worker_env

    env = {**os.environ, **worker_env(bed.endpoints, index, workdir, port), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env.pop("SWITCHAGG_WIRE_BITS", None)  # each method says its lanes
    return env


def run_ranks(bed: Any, workdir: Path, argv: list[str], timeout: float, port: int) -> list[str]:
    """``argv`` on every rank of the rack at once; their standard outputs."""
    procs = [
        e.popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=rank_env(bed, workdir, e.index, port)
        )
        for e in bed.endpoints
    ]
    done = wait_all(procs, timeout)
    failed = [d for d in done if d.returncode != 0]
    if failed:
        raise RuntimeError(f"a rank failed ({failed[0].returncode}): {failed[0].stderr[-2000:]}")
    return [d.stdout for d in done]


def where_parked(pid: int) -> str:
    """py-spy's dump of a hung rank's threads (where it waits), or why there is none."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    try:
        out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(no py-spy dump: {e})"
    return (out.stdout or out.stderr).strip()[-4000:]


def supervise(procs: list[subprocess.Popen[str]], log: Path, stall: float, timeout: float) -> dict[str, Any]:
    """Waits for the ranks while rank 0's log (``log``) gains an epoch line at least every ``stall``
    seconds; a run that stops making epochs is hung: rank 0's stacks are dumped, every rank killed."""
    start = last = time.monotonic()
    epochs = 0
    while any(p.poll() is None for p in procs):
        time.sleep(1.0)
        now = time.monotonic()
        seen = log.read_text(errors="replace").count("] epoch ") if log.exists() else 0
        if seen > epochs:
            epochs, last = seen, now
        if now - last > stall or now - start > timeout:
            parked = where_parked(procs[0].pid)
            for p in procs:
                p.kill()
            for p in procs:
                p.wait(timeout=30)
            waited = now - last if now - last > stall else now - start
            return {"status": "hung", "hung_after_s": round(waited), "epochs_done": epochs,
                    "run_s": round(now - start), "rank0_stacks": parked}  # fmt: skip
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        return {"status": "failed", "failed_ranks": failed, "run_s": round(time.monotonic() - start)}
    return {"status": "ok", "run_s": round(time.monotonic() - start)}


def train(
    bed: Any, workdir: Path, name: str, hidden: int, args: argparse.Namespace, port: int
) -> dict[str, Any]:
    """One training run of every rank with method ``name``: its outcome and rank 0's history."""
    out = workdir / f"train-{name}-{hidden}.json"
    argv = [sys.executable, str(EXAMPLE), *METHODS[name].argv, "--epochs", str(args.epochs)]
    argv += ["--hidden", str(hidden), "--seed", str(args.seed), "--json", str(out)]
    if name == "gloo+powersgd-1bucket":
        argv += ["--bucket-cap-mb", str(gradient_mb(hidden) + 1)]
    logs = [workdir / f"{name}-{hidden}-rank{e.index}.log" for e in bed.endpoints]
    procs = []
    for e, log in zip(bed.endpoints, logs, strict=True):
        with open(log, "w") as f:  # the child keeps its own descriptor
            env = rank_env(bed, workdir, e.index, port)
            procs.append(e.popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env))
    run = {
        "label": METHODS[name].label,
        "argv": argv[2:],
        **supervise(procs, logs[0], args.stall, args.timeout),
    }
    if run["status"] == "failed":
        run["log_tail"] = logs[run["failed_ranks"][0][0]].read_text(errors="replace")[-3000:]
    if run["status"] != "ok":
        return run
    report = json.loads(out.read_text())
    history: list[dict[str, Any]] = report["history"]
    elapsed = 0.0
    for record in history:
        elapsed += record["train_s"]
        record["elapsed_s"] = elapsed
    return {**run, "history": history, "lane_bytes": report.get("lane_bytes")}


def gradient_mb(hidden: int) -> int:
    """train_digits.py's gradient in MB (its MLP 64 -> hidden -> hidden -> 10, float32), at least 1."""
    params = 64 * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10
    return max(1, round(params * 4 / 1e6))


def allreduce_only(
    bed: Any, workdir: Path, backend: str, bits: int, args: argparse.Namespace, port: int
) -> float:
    """Seconds of one allreduce of the gradient's size on its own (bench_testbed.py's worker, the
    slowest rank per repetition, median of 5): the gain DDP's step could reach at best."""
    argv = [sys.executable, str(ROOT / "bench" / "bench_testbed.py"), "--worker", "--backend", backend]
    argv += ["--size", str(gradient_mb(args.hidden)), "--reps", "5", "--bits", str(bits)]
    outs = run_ranks(bed, workdir, argv, args.timeout, port)
    reports = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    slowest = [max(r["times"][i] for r in reports) for i in range(5)]
    return statistics.median(slowest)


def time_to(history: list[dict[str, Any]], target: float) -> float | None:
    """Training seconds until the first epoch at or above ``target`` accuracy (None: never)."""
    return next((r["elapsed_s"] for r in history if r["accuracy"] >= target), None)


def summarize(runs: dict[str, dict[str, Any]], target: float) -> None:
    """Adds each finished run's steady step time (epochs after the first: the first also pays the
    set-up; all epochs where there is one), its ratios to gloo and to gloo + fp16_compress_hook, its
    final accuracy and its time to ``target``."""
    for run in runs.values():
        if run["status"] != "ok":
            continue
        h = run["history"]
        steady = h[1:] if len(h) > 1 else h
        run["step_ms"] = sum(r["step_ms"] for r in steady) / len(steady)
        run["step_ms_all_epochs"] = sum(r["step_ms"] for r in h) / len(h)
        run["accuracy_per_epoch"] = [r["accuracy"] for r in h]
        run["final_accuracy"] = h[-1]["accuracy"]
        run["time_to_target_s"] = time_to(h, target)
    for base, key in (("gloo", "vs_gloo"), ("gloo+fp16", "vs_fp16_hook")):
        ref = runs.get(base, {}).get("step_ms")
        for run in runs.values():
            if ref is not None and "step_ms" in run:
                run[key] = ref / run["step_ms"]


def hung_or_failed(run: dict[str, Any]) -> str:
    return f"hung after {run['hung_after_s']} s" if run["status"] == "hung" else run["status"]


def show(runs: dict[str, dict[str, Any]], hidden: int, target: float) -> None:
    print(f"\nhidden {hidden}: {'method':<44} {'ms/step':>8} {'vs gloo':>8} {'vs fp16':>8} "
          f"{'final':>7} {'to ' + format(target, '.0%'):>8}  accuracy per epoch")  # fmt: skip
    for name, run in runs.items():
        label = METHODS[name].label
        if run["status"] != "ok":
            print(f"{'':11} {label:<44} {hung_or_failed(run)}")
            continue
        tt = run["time_to_target_s"]
        print(
            f"{'':11} {label:<44} {run['step_ms']:8.0f} {run.get('vs_gloo', 0):7.2f}x "
            f"{run.get('vs_fp16_hook', 0):7.2f}x {run['final_accuracy']:7.2%} "
            f"{'never' if tt is None else format(tt, '.1f') + ' s':>8}  "
            + " / ".join(f"{a:.1%}" for a in run["accuracy_per_epoch"]),
            flush=True,
        )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = [s for s in ("main", "small") if s in result]
    fig, axes = plt.subplots(
        len(sets), 2, figsize=(12, 4.2 * len(sets)), squeeze=False, gridspec_kw={"width_ratios": [3, 2]}
    )
    for (acc, steps), key in zip(axes, sets, strict=True):
        part = result[key]
        done = {n: r for n, r in part["runs"].items() if r["status"] == "ok"}
        for name, run in done.items():
            h = run["history"]
            acc.plot([0] + [r["elapsed_s"] for r in h], [0.1] + [r["accuracy"] for r in h], marker="o",
                     color=METHODS[name].color, label=METHODS[name].label)  # fmt: skip
        acc.axhline(result["target"], color="grey", linestyle=":", linewidth=1)
        acc.set_xlabel("training time (s)")
        acc.set_ylabel("test accuracy")
        acc.set_title(f"train_digits --hidden {part['hidden']}: DDP, {result['n']} workers, "
                      f"{result['rate_mbit']:g} Mbit/s links", fontsize=10)  # fmt: skip
        acc.legend(fontsize=8)
        names = list(part["runs"])
        ms = [part["runs"][n].get("step_ms", 0.0) for n in names]
        bars = steps.barh(range(len(names)), ms, color=[METHODS[n].color for n in names])
        steps.set_yticks(range(len(names)), [METHODS[n].label for n in names], fontsize=8)
        steps.invert_yaxis()
        for bar, name in zip(bars, names, strict=True):
            run = part["runs"][name]
            text = f" {bar.get_width():.0f} ms" if run["status"] == "ok" else f" {hung_or_failed(run)}"
            steps.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=8)
        steps.set_xlabel("step time, after the first epoch (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def train_set(
    bed: Any, workdir: Path, hidden: int, names: list[str], args: argparse.Namespace, port: int
) -> dict[str, Any]:
    """Every method of ``names`` at one width, one after another on the same rack."""
    runs: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(names):
        where = f"hidden {hidden}, {bed.n} workers, {args.rate:g} Mbit/s"
        print(f"training with {METHODS[name].label} ({where}) ...", flush=True)
        runs[name] = train(bed, workdir, name, hidden, args, port + i)
        run = runs[name]
        if run["status"] != "ok":
            print(
                f"  {run['status']}: {json.dumps({k: v for k, v in run.items() if k != 'argv'})[:3000]}",
                flush=True,
            )
            continue
        for r in run["history"]:
            done = f"accuracy {r['accuracy']:.2%} after {r['elapsed_s']:.1f} s"
            print(f"  epoch {r['epoch']}: {done} (step {r['step_ms']:.0f} ms)", flush=True)
    summarize(runs, args.target)
    show(runs, hidden, args.target)
    return {"hidden": hidden, "gradient_mb": gradient_mb(hidden), "methods": names, "runs": runs}


ALONE = {  # allreduce_only's runs: (backend, bench_testbed.py --bits); gloo at 16 sums float16
    "gloo": ("gloo", 32),
    "gloo+fp16": ("gloo", 16),
    "switchagg32": ("switchagg", 32),
    "switchagg16": ("switchagg", 16),
    "switchagg8": ("switchagg", 8),
}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """The training sets and the allreduces alone, on one rack and one job service."""
    from switchagg_lab.testbed import Testbed
    from switchagg_lab.testbed.testbed_controller import start_job_service

    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        with Testbed(args.workers, workdir, data_plane="soft", rate_mbit=args.rate) as bed:
            service = start_job_service(bed, workdir, sw_k=args.k, sw_slots=args.slots)
            try:
                result["main"] = train_set(bed, workdir, args.hidden, args.methods, args, 29600)
                if args.small_hidden:
                    small = [m for m in args.methods if m in SMALL_METHODS]
                    result["small"] = train_set(bed, workdir, args.small_hidden, small, args, 29650)
                if args.allreduce:
                    alone = {}
                    for i, (name, (backend, bits)) in enumerate(ALONE.items()):
                        alone[name] = allreduce_only(bed, workdir, backend, bits, args, 29700 + i)
                        mb = gradient_mb(args.hidden)
                        print(f"one {mb} MB allreduce alone, {name}: {alone[name]:.3f} s", flush=True)
                    result["allreduce_s"] = alone
            finally:
                service.kill()
                service.wait(timeout=30)
    return result


def bench(args: argparse.Namespace) -> int:
    from switchagg_lab.testbed import tools

    reason = tools.missing_for(["ip", "tc"], "bench_time_to_accuracy")
    if reason:
        print(reason, file=sys.stderr)
        return 2
    load = os.getloadavg()[0]
    result = {
        "n": args.workers,
        "rate_mbit": args.rate,
        "epochs": args.epochs,
        "seed": args.seed,
        "cpus": os.cpu_count(),
        "load_before": load,
        "target": args.target,
        "torch": _torch_version(),
        **run_all(args),
    }
    result["load_after"] = os.getloadavg()[0]
    alone = result.get("allreduce_s")
    if alone:
        result["allreduce_vs_gloo"] = {k: alone["gloo"] / v for k, v in alone.items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} (load average {load:.2f} before, "
          f"{result['load_after']:.2f} after)")  # fmt: skip
    return 0


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rate", type=parse_rate, default=200.0, help="link rate: Mbit/s, or 1gbit, 200mbit")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048, help="train_digits.py --hidden (gradient size)")
    p.add_argument(
        "--small-hidden", type=int, default=256, help="the same methods at this width too (0: not)"
    )
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.9, help="the accuracy whose time is reported")
    p.add_argument(
        "--allreduce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time one gradient-sized allreduce alone per backend and width",
    )
    p.add_argument("--k", type=int, help="elements per packet (default: the most one frame carries)")
    p.add_argument("--slots", type=int, help="slots per job (default: protocol.WINDOW_BYTES of packets)")
    p.add_argument("--stall", type=float, default=180.0, help="seconds without an epoch: the run hung")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--out", default=str(RESULTS / "time_to_accuracy.json"))
    return bench(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
