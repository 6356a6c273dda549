"""One rank allreducing seeded tensors: ``python -m switchagg_lab.testing.worker CONFIG_JSON``.

Config keys: job rank n aggregator=[ip, port] slot_base slots k bind=[ip, port] tensors=[[dtype,
size], ...] seed out timeout rto key, and optionally announce (print the bound address as a JSON line
and wait for a line on stdin before the first allreduce: the job is installed with that address)
and die_after (SIGKILL itself once that many results came back, i.e. mid-allreduce).

Writes ``<out>/job<J>_rank<R>.npz`` (every result, the session stats and each allreduce's
seconds) or exits 3 with the error on stderr.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from switchagg import Session, SwitchaggError, protocol
from switchagg_lab.testing.checks import dtype_bits, inputs, result_file


def _die_after(s: Session, results: int) -> None:
    def assassin() -> None:  # bounded: gives up after 60 s
        end = time.monotonic() + 60
        while s.stats()["results"] < results and time.monotonic() < end:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=assassin, daemon=True).start()


def main() -> int:
    cfg = json.loads(sys.argv[1])
    job, rank = cfg["job"], cfg["rank"]
    agg_ip, agg_port = cfg["aggregator"]
    bind_ip, bind_port = cfg.get("bind", ["127.0.0.1", 0])
    results: dict[str, np.ndarray] = {}
    seconds: list[float] = []
    with Session(
        job,
        rank,
        cfg["n"],
        aggregator=(agg_ip, agg_port),
        slot_base=cfg.get("slot_base", 0),
        slot_count=cfg["slots"],
        k=cfg.get("k", protocol.P4_K),
        bind=(bind_ip, bind_port),
        timeout=cfg.get("timeout", 20.0),
        rto=cfg.get("rto", 0.05),
        key=cfg["key"],  # UNKEYED (0) only where the spawner asked for it
    ) as s:
        if cfg.get("announce"):
            print(json.dumps({"address": list(s.local_address)}), flush=True)
            if not sys.stdin.readline():
                print("no go from the parent (stdin closed)", file=sys.stderr)
                return 3
        if cfg.get("die_after"):
            _die_after(s, cfg["die_after"])
        try:
            for i, (spec, size) in enumerate(cfg["tensors"]):
                dtype, bits = dtype_bits(spec)
                x = inputs(job, rank, size, dtype, cfg.get("seed", 0) + i)
                t0 = time.perf_counter()
                s.allreduce(x, bits=bits)
                seconds.append(time.perf_counter() - t0)
                results[f"t{i}"] = x
        except SwitchaggError as e:
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
            return 3
        results["stats"] = np.array(json.dumps(s.stats()))
        results["seconds"] = np.array(seconds)
    np.savez(result_file(Path(cfg["out"]), job, rank), **results)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
