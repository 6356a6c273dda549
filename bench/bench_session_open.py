"""What a session's hello costs (docs/PROTOCOL.md, Sessions): n ranks (threads, one socket each) open
sessions on one standing job of the software aggregator, again and again, as runs of a script do; for
each open, the hello's time (the worker's ``hello_ns``) beside the time of the session's second call,
a one-packet int32 allreduce (one round trip: the baseline from the same run), printed as a ratio.
Writes bench/results/session_open.json. Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from switchagg import Session, _core
from switchagg.aggregator import SoftwareAggregator


def one_open(
    agg: SoftwareAggregator, key: int, workers: list[_core.Worker], k: int
) -> tuple[float, float, int]:
    """Every rank opens a session on the standing job and makes two one-packet calls; returns the
    slowest rank's hello seconds, the slowest rank's second call's seconds and the hello's rounds."""
    n = len(workers)
    out: list[tuple[float, float, int]] = [(0.0, 0.0, 0)] * n

    def rank(r: int) -> None:
        s = Session(1, r, n, agg.address, 0, 16, k, key=key, _worker=workers[r])
        x = np.full(k, r, np.int32)
        s.allreduce(x)  # the hello, then the first call
        t0 = time.perf_counter()
        s.allreduce(x)
        call = time.perf_counter() - t0
        stats = s.stats()
        out[r] = (stats["hello_ns"] / 1e9, call, stats["hello_rounds"])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return max(o[0] for o in out), max(o[1] for o in out), out[0][2]


def measure(n: int, opens: int, k: int) -> dict[str, Any]:
    with SoftwareAggregator() as agg:
        workers = [_core.Worker("127.0.0.1", 0) for _ in range(n)]
        key = agg.add_job(1, n, 0, 16, k, 1, [w.address for w in workers])
        runs = []
        for _ in range(opens):  # each open reuses the same ports, as a run's ranks bind the job's
            runs.append(one_open(agg, key, workers, k))
            for i, w in enumerate(workers):
                address = w.address
                w.close()
                workers[i] = _core.Worker(*address)
        for w in workers:
            w.close()
    hello = statistics.median(r[0] for r in runs)
    call = statistics.median(r[1] for r in runs)
    return {
        "n": n,
        "opens": opens,
        "hello_rounds": sorted({r[2] for r in runs}),
        "hello_ms_median": round(hello * 1e3, 3),
        "call_ms_median": round(call * 1e3, 3),
        "ratio": round(hello / call, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--opens", type=int, default=30)
    p.add_argument("--k", type=int, default=361)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results/session_open.json")
    a = p.parse_args()
    rows = [measure(n, a.opens, a.k) for n in a.ranks]
    print(f"{'n':>3} {'hello rounds':>12} {'hello ms':>9} {'1-packet call ms':>17} {'hello / call':>12}")
    for r in rows:
        rounds = ",".join(map(str, r["hello_rounds"]))
        print(
            f"{r['n']:>3} {rounds:>12} {r['hello_ms_median']:>9} {r['call_ms_median']:>17} {r['ratio']:>12}"
        )
    a.out.write_text(json.dumps({"k": a.k, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
