"""One rank of a run on a standing job, as a user's script is: bind the port the job names, make
int32 allreduces, print each sum, exit. ``python -m switchagg_lab.testing.run_rank JOB RANK N
AGG_IP:AGG_PORT BIND_IP:BIND_PORT KEY BASE [--calls C] [--size S] [--slots W] [--k K] [--timeout T]``.

Rank r of call c (1, 2, ...) contributes ``BASE * c + r`` in every element, so the exact sum is
``N * BASE * c + N * (N - 1) / 2``, different for every call and every BASE (a run): each call prints
one JSON line ``{"call": c, "sum": v, "exact": bool}`` (``v``: element 0; ``exact``: every element
is the exact sum), after a first line ``{"hello_rounds": r, "hello_ms": t}`` once the session opened;
a failure one line ``{"error": class, "message": ...}`` and exit status 3.
The sums are checked by the reader (tests/test_sessions.py, bmv2_tests), not trusted to this script.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from switchagg import Session, SwitchaggError


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("job", type=int)
    p.add_argument("rank", type=int)
    p.add_argument("n", type=int)
    p.add_argument("aggregator", type=_addr)
    p.add_argument("bind", type=_addr)
    p.add_argument("key", type=lambda t: int(t, 0))
    p.add_argument("base", type=int)
    p.add_argument("--calls", type=int, default=1)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--slot-base", type=int, default=0)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--k", type=int, default=None)
    p.add_argument("--timeout", type=float, default=10.0)
    a = p.parse_args()
    n = a.n
    try:
        with Session(
            a.job, a.rank, n, aggregator=a.aggregator, slot_base=a.slot_base, slot_count=a.slots, k=a.k,
            timeout=a.timeout, bind=a.bind, key=a.key,
        ) as s:  # fmt: skip
            s.open()  # the session's hello (docs/PROTOCOL.md, Sessions): what it cost
            stats = s.stats()
            print(
                json.dumps({"hello_rounds": stats["hello_rounds"], "hello_ms": stats["hello_ns"] / 1e6}),
                flush=True,
            )
            for c in range(1, a.calls + 1):
                x = np.full(a.size, a.base * c + a.rank, dtype=np.int32)
                s.allreduce(x)
                want = n * a.base * c + n * (n - 1) // 2
                print(json.dumps({"call": c, "sum": int(x[0]), "exact": bool((x == want).all())}), flush=True)
    except SwitchaggError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
