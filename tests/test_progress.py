"""Long runs print one progress line per step on stderr, with the time left scaled by the
weight still to go; a real (small) benchmark run shows them and keeps stdout for its table."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from switchagg_lab.testing.progress import Steps

ROOT = Path(__file__).resolve().parents[1]


def test_steps_report_done_share_and_time_left() -> None:
    now = [100.0]
    out = io.StringIO()
    steps = Steps(3, total=10, stream=out, clock=lambda: now[0])
    steps.step("small", 2)
    now[0] += 30  # the first 2 of 10 took 30 s: 8 left take ~2 min
    steps.step("big", 6)
    now[0] += 90
    steps.step("last", 2)
    now[0] += 3700
    steps.finish("wrote x")
    assert out.getvalue().splitlines() == [
        "[1/3 0%, 0s in] small",
        "[2/3 20%, 30s in, ~2m00s left] big",
        "[3/3 80%, 2m00s in, ~30s left] last",
        "[3/3 100%, 1h03m] wrote x",
    ]


def test_a_benchmark_run_prints_a_line_per_step(tmp_path: Path) -> None:
    out = tmp_path / "allreduce.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench/bench_allreduce.py"), "--sizes", "1,2", "--workers", "2"]
        + ["--reps", "1", "--no-gloo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert lines[0] == "[1/2 0%, 0s in] n=2, 1 MB"
    assert lines[1].startswith("[2/2 33%, ") and lines[1].endswith("] n=2, 2 MB")
    assert lines[2].startswith("[2/2 100%, ") and lines[2].endswith(f"] wrote {out}")
    assert "[" not in p.stdout  # the table stays clean
    assert [r["mb"] for r in json.loads(out.read_text())["allreduce"]] == [1, 2]
