"""How often a torch job leaves cleanly: runs a script under ``torchrun`` again and again, optionally
with busy processes loading every core, and counts the runs in which every rank exited 0 with no
"terminate called" (a C++ abort at interpreter exit) in its output.

    python tools/clean_exits.py --runs 100 --load 2 -- examples/train_digits.py --backend hook --epochs 1

Prints one line per failed run (its exit code and the tail of its output) and a JSON summary last.
Exits 1 if any run failed. A measurement, not a test: docs/TORCH.md quotes its results.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ABORT = "terminate called"


def _burn(until: float) -> None:
    x = 0
    while time.monotonic() < until:
        x += 1


def run_once(script: list[str], nproc: int, timeout: float) -> tuple[int, str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *script,
    ]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return -1, out + "\n(timed out)"
    return p.returncode, p.stdout + p.stderr


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--nproc", type=int, default=4, help="ranks per run")
    p.add_argument("--load", type=int, default=0, help="busy processes running meanwhile")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for one run")
    p.add_argument("--keep", type=Path, help="write each failed run's whole output to DIR/run-N.log")
    p.add_argument("script", nargs="+", help="the script and its arguments (after --)")
    args = p.parse_args(argv)
    burners = [
        multiprocessing.Process(
            target=_burn, args=(time.monotonic() + args.runs * args.timeout,), daemon=True
        )
        for _ in range(args.load)
    ]
    for b in burners:
        b.start()
    clean, aborts, failed = 0, 0, 0
    started = time.monotonic()
    try:
        for i in range(args.runs):
            code, out = run_once(args.script, args.nproc, args.timeout)
            if code == 0 and ABORT not in out:
                clean += 1
                continue
            aborts += ABORT in out
            failed += 1
            print(f"run {i}: exit {code}\n{out[-1500:]}", file=sys.stderr, flush=True)
            if args.keep is not None:
                args.keep.mkdir(parents=True, exist_ok=True)
                (args.keep / f"run-{i}.log").write_text(out)
    finally:
        for b in burners:
            b.terminate()
    summary = {
        "script": args.script,
        "runs": args.runs,
        "ranks": args.nproc,
        "load": args.load,
        "clean": clean,
        "failed": failed,
        "aborts_at_exit": aborts,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary), flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
