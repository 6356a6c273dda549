"""switchagg-demo: a multi-worker allreduce on the embedded software aggregator.

Starts a software aggregator in this process, spawns N worker processes that each allreduce
an int32 and a float32 tensor, and checks every result against the exact sum.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import time
from multiprocessing.synchronize import Event as EventType

import numpy as np

from switchagg import protocol
from switchagg.cli_util import add_version, quiet_broken_pipe


def _inputs(rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + rank)
    return rng.integers(-(2**20), 2**20, size, dtype=np.int32), rng.standard_normal(size, dtype=np.float32)


def _worker(rank: int, args: argparse.Namespace, port: int, key: int, out: mp.Queue, go: EventType) -> None:
    from switchagg import Session

    xi, xf = _inputs(rank, args.size)
    try:
        with Session(
            1, rank, args.workers, ("127.0.0.1", port), 0, args.slots, args.k, timeout=args.timeout, key=key
        ) as s:
            # The aggregator accepts this rank only from the address it registers before the job starts.
            out.put(("address", rank, s.local_address))
            if not go.wait(args.timeout):
                raise TimeoutError("the job was not installed on the aggregator")
            times = []
            for _ in range(args.iters):
                yi, yf = xi.copy(), xf.copy()
                t0 = time.perf_counter()
                s.allreduce(yi)
                s.allreduce(yf)
                times.append(time.perf_counter() - t0)
            every = [_inputs(r, args.size) for r in range(args.workers)]
            exact_i = np.sum([i.astype(np.int64) for i, _ in every], axis=0)
            exact_f = np.sum([f.astype(np.float64) for _, f in every], axis=0)
            int_ok = bool(np.array_equal(yi, exact_i.astype(np.int32)))
            err = float(np.max(np.abs(yf - exact_f)))
            peak = max(float(np.max(np.abs(f))) for _, f in every)
            bound = protocol.error_bound(args.workers, int(np.frexp(peak)[1]))
            out.put(("result", rank, int_ok, err <= bound, err, min(times), s.stats(), ""))
    except Exception as e:  # reported by the parent, which decides the exit code
        out.put(("result", rank, False, False, float("inf"), 0.0, {}, f"{type(e).__name__}: {e}"))


@quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="switchagg-demo", description=__doc__)
    add_version(p)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--size", type=int, default=1_000_000, help="elements per tensor")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--k", type=int, default=protocol.DEFAULT_SW_K, help="elements per packet")
    p.add_argument("--slots", type=int, default=protocol.DEFAULT_SW_SLOTS, help="slots (packets in flight)")
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--port", type=int, default=0, help="the aggregator's UDP port (default: a free one)")
    p.add_argument("--drop", type=float, default=0.0, help="inject this loss probability both ways")
    args = p.parse_args(argv)

    from switchagg.aggregator import SoftwareAggregator, new_key

    agg = SoftwareAggregator("127.0.0.1", args.port, drop_in=args.drop, drop_out=args.drop)
    agg.start()
    port = agg.address[1]
    print(
        f"software aggregator on 127.0.0.1:{port}; {args.workers} workers, {args.size:,} elements, K={args.k}"
    )
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    go = ctx.Event()
    key = new_key()  # the job's result key: only its workers and the aggregator know it
    procs = [ctx.Process(target=_worker, args=(r, args, port, key, out, go)) for r in range(args.workers)]
    for proc in procs:
        proc.start()
    addrs: dict[int, tuple[str, int]] = {}
    results: list[tuple[int, bool, bool, float, float, dict[str, int], str]] = []
    deadline = time.monotonic() + args.timeout * (args.iters + 2) + 60
    while len(results) < args.workers and time.monotonic() < deadline:
        try:
            kind, rank, *rest = out.get(timeout=1.0)
        except queue.Empty:
            if not any(proc.is_alive() for proc in procs) and out.empty():
                break
            continue
        if kind == "address":
            addrs[rank] = rest[0]
            if len(addrs) == args.workers:  # every rank is bound: pin them and start the job
                agg.add_job(
                    1,
                    args.workers,
                    0,
                    args.slots,
                    args.k,
                    1,
                    [addrs[r] for r in range(args.workers)],
                    key=key,
                )
                go.set()
        else:
            results.append((rank, *rest))
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    c = agg.counters()
    agg.stop()
    ok = len(results) == args.workers
    mb = args.size * 4 / 1e6
    for rank, int_ok, within, err, best, stats, error in sorted(results):
        good = int_ok and within and not error
        ok &= good
        line = error or (
            f"int32 exact={int_ok}  float32 max|err|={err:.2e}  best {best * 1e3:.1f} ms for 2x{mb:.0f} MB "
            f"({2 * mb / best / 1e3:.2f} GB/s)  retransmits={stats.get('retransmits', 0)}"
        )
        print(f"rank {rank}: {'OK ' if good else 'BAD'} {line}")
    print(
        f"aggregator: rx={c['rx']} tx={c['tx']} drops={sum(c['drops'].values())} faults={c.get('faults', {})}"
    )
    print("demo", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
