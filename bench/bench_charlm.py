"""A transformer with AdamW on switchagg's narrow lanes: examples/train_charlm.py (a 4-layer causal
transformer on characters of local text) under torchrun on this host, DDP on gloo in float32 against
switchagg.torch.allreduce_hook at 32, 16 and 8 bits (8 with error feedback, the hook's default), same
seed, same batches, one run after another. Also gloo at another seed: how far two float32 runs
differ where only the seed does, the scale against which the lanes' differences read.

Prints and writes (bench/results/charlm.json, .png) the eval loss of each along training, the final
eval loss and its difference from gloo's (the goal: within 1%), the step time (loopback, the ranks
sharing this host's cores: a CPU figure, not a network one) and the bytes each rank sent per lane width.

No root needed. Bounded: every run has a timeout.
    python bench/bench_charlm.py                     # 8 ranks, 600 steps (~6 min on 2 cores)
    python bench/bench_charlm.py --ranks 2 --steps 40 --out /tmp/charlm.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from switchagg_lab.testing.kit import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
EXAMPLE = ROOT / "examples" / "train_charlm.py"

METHODS: dict[str, tuple[str, tuple[str, ...]]] = {  # name: (label, train_charlm.py's options)
    "gloo": ("gloo (float32)", ("--backend", "gloo")),
    "gloo-seed1": ("gloo (float32), seed + 1", ("--backend", "gloo")),
    "switchagg32": ("switchagg, 32-bit lanes", ("--backend", "hook", "--bits", "32")),
    "switchagg16": ("switchagg, 16-bit lanes", ("--backend", "hook", "--bits", "16")),
    "switchagg8": ("switchagg, 8-bit lanes + EF", ("--backend", "hook", "--bits", "8")),
    "switchagg8-noef": (
        "switchagg, 8-bit lanes, no EF",
        ("--backend", "hook", "--bits", "8", "--error-feedback", "off"),
    ),
}
DEFAULT_METHODS = ["gloo", "gloo-seed1", "switchagg32", "switchagg16", "switchagg8"]


def train(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One torchrun of train_charlm.py: rank 0's report, or how it failed."""
    out = tmp / f"{name}.json"
    seed = args.seed + (1 if name == "gloo-seed1" else 0)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE)]
    cmd += [*METHODS[name][1], "--steps", str(args.steps), "--seed", str(seed), "--json", str(out)]
    cmd += ["--eval-every", str(args.eval_every)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("SWITCHAGG_JOB_SERVICE", "SWITCHAGG_WIRE_BITS"):  # the embedded aggregator; each run's lanes
        env.pop(k, None)
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"status": "hung", "label": METHODS[name][0], "hung_after_s": args.timeout}
    if proc.returncode != 0:
        return {"status": "failed", "label": METHODS[name][0], "stderr": proc.stderr[-3000:]}
    report: dict[str, Any] = json.loads(out.read_text())
    return {
        "status": "ok",
        "label": METHODS[name][0],
        "seed": seed,
        "wall_s": time.monotonic() - start,
        **report,
    }


def summarize(runs: dict[str, dict[str, Any]]) -> None:
    ref = runs.get("gloo", {}).get("history")
    for run in runs.values():
        if run["status"] != "ok":
            continue
        h = run["history"]
        run["final_eval_loss"] = h[-1]["eval_loss"]
        run["step_ms"] = sum(r["step_ms"] for r in h[1:]) / len(h[1:])
        if ref:
            run["vs_gloo"] = run["final_eval_loss"] / ref[-1]["eval_loss"] - 1
            run["max_vs_gloo_along"] = max(
                abs(a["eval_loss"] / b["eval_loss"] - 1) for a, b in zip(h, ref, strict=True)
            )


def show(runs: dict[str, dict[str, Any]]) -> None:
    print(
        f"{'method':<32} {'final eval loss':>15} {'vs gloo':>8} {'max along':>9} {'ms/step':>8}  "
        "lane bytes (rank 0)"
    )
    for name, run in runs.items():
        label = METHODS[name][0]
        if run["status"] != "ok":
            print(f"{label:<32} {run['status']}")
            continue
        print(
            f"{label:<32} {run['final_eval_loss']:15.4f} {run.get('vs_gloo', 0):+8.2%} "
            f"{run.get('max_vs_gloo_along', 0):9.2%} {run['step_ms']:8.1f}  {run.get('lane_bytes')}",
            flush=True,
        )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in result["runs"].items():
        if run["status"] == "ok":
            h = run["history"]
            ax.plot([r["step"] for r in h], [r["eval_loss"] for r in h], marker=".", label=METHODS[name][0])
    ax.set_xlabel("step")
    ax.set_ylabel("eval loss (nats per character)")
    ax.set_title(f"char-level transformer, AdamW, DDP on {result['ranks']} ranks", fontsize=10)
    ax.set_ylim(top=min(4.5, ax.get_ylim()[1]))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=DEFAULT_METHODS)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per training run")
    p.add_argument("--out", default=str(RESULTS / "charlm.json"))
    args = p.parse_args()
    load = os.getloadavg()[0]
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.methods:
            print(
                f"training with {METHODS[name][0]} ({args.ranks} ranks, {args.steps} steps) ...", flush=True
            )
            runs[name] = train(name, args, Path(tmp))
            if runs[name]["status"] != "ok":
                print(f"  {runs[name]}", flush=True)
    summarize(runs)
    show(runs)
    result = {"ranks": args.ranks, "steps": args.steps, "cpus": os.cpu_count(), "load_before": load,
              "load_after": os.getloadavg()[0], "runs": runs}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} (load average {load:.2f} before)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
