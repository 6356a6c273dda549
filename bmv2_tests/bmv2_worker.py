"""One rank allreducing through the P4 switch, run inside its endpoint's namespace.

``python bmv2_worker.py CONFIG_JSON`` (keys: job rank n aggregator slot_base slots bind port
tensors seed out rounds timeout); writes ``<out>/job<J>_rank<R>.npz`` with every result, or
exits 3 with the error on stderr.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from switchagg import Session, SwitchaggTimeout, protocol


def inputs(job: int, rank: int, size: int, dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, job, rank])
    if dtype == "int32":
        return rng.integers(-(2**28), 2**28, size, dtype=np.int32)
    return (rng.standard_normal(size) * (rank + 1)).astype(np.float32)


def main() -> int:
    cfg = json.loads(sys.argv[1])
    job, rank = cfg["job"], cfg["rank"]
    results: dict[str, np.ndarray] = {}
    with Session(
        job,
        rank,
        cfg["n"],
        aggregator=(cfg["aggregator"], protocol.UDP_PORT),
        slot_base=cfg["slot_base"],
        slot_count=cfg["slots"],
        k=protocol.P4_K,
        bind=(cfg["bind"], cfg["port"]),
        timeout=cfg.get("timeout", 20.0),
    ) as s:
        try:
            for i, (dtype, size) in enumerate(cfg["tensors"]):
                x = inputs(job, rank, size, dtype, cfg.get("seed", 0) + i)
                s.allreduce(x)
                results[f"t{i}"] = x
        except SwitchaggTimeout as e:
            print(f"SwitchaggTimeout: {e}", file=sys.stderr)
            return 3
        stats = s.stats()
    results["stats"] = np.array(json.dumps(stats))
    np.savez(os.path.join(cfg["out"], f"job{job}_rank{rank}.npz"), **results)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
