"""A worker process for the end-to-end tests: allreduce seeded tensors and save the results.

Run as ``python worker_proc.py CONFIG_JSON``; writes ``<out>/rank<R>.npz`` or exits 3 with the
error on stderr. With ``die_after`` set it kills itself (SIGKILL) once that many results came
back, i.e. in the middle of an allreduce.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np

from switchagg import Session, SwitchaggTimeout


def inputs(rank: int, size: int, dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    if dtype == "int32":
        return rng.integers(-(2**24), 2**24, size, dtype=np.int32)
    return (rng.standard_normal(size) * (rank + 1)).astype(np.float32)


def main() -> int:
    cfg = json.loads(sys.argv[1])
    rank, n = cfg["rank"], cfg["n"]
    s = Session(
        cfg.get("job", 1),
        rank,
        n,
        ("127.0.0.1", cfg["port"]),
        cfg.get("slot_base", 0),
        cfg.get("slots", 8),
        cfg.get("k", 256),
        timeout=cfg.get("timeout", 10.0),
        rto=cfg.get("rto", 0.05),
    )
    results: dict[str, np.ndarray] = {}
    if cfg.get("die_after"):

        def assassin() -> None:  # bounded: gives up after 60 s
            end = time.monotonic() + 60
            while s.stats()["results"] < cfg["die_after"] and time.monotonic() < end:
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=assassin, daemon=True).start()
    try:
        for i, (dtype, size) in enumerate(cfg["tensors"]):
            x = inputs(rank, size, dtype, cfg.get("seed", 0) + i)
            s.allreduce(x)
            results[f"t{i}"] = x
    except SwitchaggTimeout as e:
        print(f"SwitchaggTimeout: {e}", file=sys.stderr)
        return 3
    results["stats"] = np.array(json.dumps(s.stats()))
    np.savez(os.path.join(cfg["out"], f"rank{rank}.npz"), **results)  # type: ignore[arg-type]
    s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
