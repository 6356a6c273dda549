"""Writes docs/RELIABILITY.md from the reliability suite's own output.

    python tools/reliability_table.py build/reliability.jsonl -o docs/RELIABILITY.md

The input is what the tests marked ``@pytest.mark.reliability`` wrote through
switchagg_lab.testing.reliability when ``$SWITCHAGG_RELIABILITY_OUT`` named the file (``make
reliability`` does both steps): one JSON line per row. A test run again (the file appended to,
or several files) counts once: only its latest run's rows are kept. Rows of one fault and one
description (a parametrized test) are merged; the table lists the faults in the order of
switchagg_lab.testing.reliability.FAULTS, says which have no row, and totals runs, sums checked and
wrong sums. Exit status 1 when a row has wrong sums or a test failed, so that ``make`` fails too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from switchagg_lab.testing.reliability import FAULTS

HEADER = (
    "Fault",
    "What was tried",
    "Runs",
    "Sums checked",
    "Wrong sums",
    "Outcome",
    "Time to recover or to fail",
    "State left behind",
)


def load(paths: Iterable[Path]) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{path}:{n}: not a JSON line: {e}") from None
    return rows


def latest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of each test's latest run: a test's rows are written together at its end, tagged
    with the pytest session that ran it (older files: a run is a block of consecutive lines)."""
    run_of: list[Any] = []
    block, previous = 0, None
    for r in rows:
        if r.get("test") != previous:
            block, previous = block + 1, r.get("test")
        run_of.append(r.get("session") or f"block {block}")
    last = {r.get("test"): run for r, run in zip(rows, run_of, strict=True)}
    return [r for r, run in zip(rows, run_of, strict=True) if last[r.get("test")] == run]


def _unique(values: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if v not in (None, "") and v not in out:
            out.append(v)
    return out


def _seconds(values: list[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = f"{lo:.2f} s" if lo == hi else f"{lo:.2f}-{hi:.2f} s"
    return f"{span} ({len(values)} runs)" if len(values) > 1 else span


def merge(group: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from the rows of one fault and description."""
    ran = [r for r in group if r.get("status") != "skipped"]
    seconds: list[float] = []
    for r in ran:
        value = r.get("recovery_s")
        seconds += [float(x) for x in (value if isinstance(value, list) else [value]) if x is not None]
    sums = [r.get("sums") for r in ran]
    wrong = [r.get("wrong") for r in ran]
    statuses = {r.get("status") for r in group}
    status = "failed" if "failed" in statuses else "passed" if "passed" in statuses else "skipped"
    outcome = _unique(r.get("outcome") for r in ran)
    if status == "skipped":
        outcome = ["skipped: " + "; ".join(_unique(r.get("note") for r in group))]
    failures = _unique(r.get("note") for r in group if r.get("status") == "failed")
    if failures:
        outcome.append("FAILED: " + "; ".join(failures))
    return {
        "fault": group[0]["fault"],
        "tried": group[0].get("tried", ""),
        "runs": sum(int(r.get("runs") or 0) for r in ran),
        "sums": None if any(s is None for s in sums) else sum(sums),
        "wrong": None if any(w is None for w in wrong) else sum(wrong),
        "outcome": "; ".join(outcome),
        "recovery": "; ".join(_unique([_seconds(seconds), *(r.get("recovery") for r in ran)])),
        "state": "; ".join(_unique(r.get("state") for r in ran)),
        "status": status,
        "tests": _unique(r.get("test") for r in group),
    }


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in latest(rows):
        groups.setdefault((r.get("fault", "?"), r.get("tried", "")), []).append(r)
    merged = [merge(g) for g in groups.values()]
    order = {f: i for i, f in enumerate(FAULTS)}
    return sorted(merged, key=lambda m: order.get(m["fault"], len(FAULTS)))  # stable: test order within


def _cell(value: Any) -> str:
    if value is None:
        return "?"
    return str(value).replace("|", "\\|").replace("\n", " ") or "-"


def _line(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def render(rows: list[dict[str, Any]], command: str, note: str = "") -> str:
    merged = table_rows(rows)
    ran = [m for m in merged if m["status"] != "skipped"]
    runs = sum(m["runs"] for m in ran)
    sums = sum(m["sums"] or 0 for m in ran)
    unknown_sums = any(m["sums"] is None for m in ran)
    wrong_known = sum(m["wrong"] or 0 for m in ran)
    unknown_wrong = any(m["wrong"] is None for m in ran)
    failed = [m for m in merged if m["status"] == "failed"]
    skipped = [m for m in merged if m["status"] == "skipped"]
    missing = [f for f in FAULTS if not any(m["fault"] == f for m in merged)]
    tests = _unique(t for m in merged for t in m["tests"])
    statuses = [m["status"] for m in merged]
    wrong_total = f"{wrong_known}{' + unknown (a failed test)' if unknown_wrong else ''}"
    out = [
        "# Reliability",
        "",
        "<!-- Generated by tools/reliability_table.py from the suite's own output: do not edit; "
        "run `make reliability`. -->",
        "",
        "Each row is a fault tried against real switchagg processes and sockets by a test of the suite",
        "(`@pytest.mark.reliability`, switchagg_lab.testing.reliability), with what it did to the sums. A",
        "fault may make a job fail, but only cleanly: every rank gets an error that says why, and no",
        "rank a wrong sum. The goal is **0 wrong sums** in every row.",
        "",
        f"Generated {datetime.date.today().isoformat()} by `{command}`: {len(tests)} tests, "
        f"{statuses.count('passed')} rows passed, {statuses.count('skipped')} skipped, "
        f"{statuses.count('failed')} failed.{' ' + note if note else ''}",
        "",
        f"**Totals: {runs} runs, {sums}{'+' if unknown_sums else ''} sums checked, {wrong_total} wrong "
        f"sums; {len(failed)} rows failed, {len(skipped)} rows skipped.**",
        "",
        _line(HEADER),
        "|" + "|".join("---" for _ in HEADER) + "|",
    ]
    for m in merged:
        sums_cell = "-" if m["status"] == "skipped" else m["sums"]
        wrong_cell = "-" if m["status"] == "skipped" else m["wrong"]
        cells = [
            m["fault"],
            m["tried"],
            m["runs"],
            sums_cell,
            wrong_cell,
            m["outcome"],
            m["recovery"],
            m["state"],
        ]
        out.append(_line(cells))
    out.append(
        _line(["**Total**", "", runs, f"{sums}{'+' if unknown_sums else ''}", wrong_total, "", "", ""])
    )
    out += [
        "",
        "Runs: how many times the fault was tried (jobs, restarts, fuzzing examples). Sums checked:",
        "allreduce results compared with the exact sum, one per rank and call (float32: within",
        "docs/PROTOCOL.md's bound and the same bits on every rank). A `?` is a count a failed test could",
        "not give. Skipped rows need what this machine lacks; they say what.",
    ]
    if missing:
        out += ["", "Faults with no row yet: " + ", ".join(missing) + "."]
    out += ["", "## The tests behind each row", ""]
    for m in merged:
        names = ", ".join(f"`{t}`" for t in m["tests"])
        out.append(f"- {m['fault']}, {m['tried']}: {names}")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="+", type=Path, help="JSON-lines files the suite wrote")
    p.add_argument("-o", "--output", type=Path, help="where to write the markdown (default: stdout)")
    p.add_argument("--command", default="make reliability", help="the command named as the source")
    p.add_argument(
        "--note", default="", help="a sentence after the header's counts (where the rows came from)"
    )
    args = p.parse_args(argv)
    rows = load(args.inputs)
    if not rows:
        print("no rows: did the suite run with $SWITCHAGG_RELIABILITY_OUT set?", file=sys.stderr)
        return 1
    text = render(rows, args.command, args.note)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    merged = table_rows(rows)
    bad = [m for m in merged if m["status"] == "failed" or m["wrong"]]
    for m in bad:
        print(f"reliability: {m['fault']}: {m['tried']}: {m['outcome']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
