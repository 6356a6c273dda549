"""Frame-sized packets at the cost of big datagrams (issue 34): UDP GSO/GRO against one datagram per
send, for the raw UDP pump (bench/udp_pump.c) and for switchagg itself, on loopback, at the same
datagram sizes: one 1500-byte frame (K = 361) and one 9000-byte frame (K = 2236).

switchagg: n workers and a one-thread software aggregator in this process (the C engines release
the GIL), an int32 allreduce of --mb MB per worker, --calls times; GSO on and off (SWITCHAGG_GSO=0)
alternate, each in a fresh subprocess. Reported: datagrams per second through the aggregator (in and
out) and the process's CPU seconds (getrusage: workers and aggregator) per Gbit/s of datagrams the
aggregator received and sent; the pump's likewise (one sender, one receiver). Loopback has no
wire: this is the host's cost per packet, what caps the emulated rack's links at MTU 1500.

    python bench/bench_gso.py                # writes bench/results/gso.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FRAMES = {1500: 361, 9000: 2236}  # MTU: K (protocol.k_for_mtu)


def engine(n: int, k: int, mb: int, calls: int) -> dict[str, Any]:
    """One run of the engines in this process (SWITCHAGG_GSO as the environment says)."""
    import threading

    import numpy as np

    from switchagg import Session, _core, protocol
    from switchagg.aggregator import SoftwareAggregator, new_key

    slots = protocol.window_slots(k)
    agg = SoftwareAggregator("127.0.0.1", 0).start()
    workers = [_core.Worker("127.0.0.1", 0) for _ in range(n)]
    key = new_key()
    agg.add_job(1, n, 0, slots, k, 1, [w.address for w in workers], key=key)
    sessions = [Session(1, r, n, agg.address, 0, slots, k, key=key, _worker=workers[r]) for r in range(n)]
    length = mb * (1 << 20) // 4
    xs = [np.full(length, r + 1, dtype=np.int32) for r in range(n)]

    def one_call() -> None:
        threads = [threading.Thread(target=s.allreduce, args=(x,)) for s, x in zip(sessions, xs, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)

    one_call()  # warm: the first round trips are measured by then
    c0, r0, t0 = agg.counters(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(calls):
        one_call()
    t1, r1, c1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), agg.counters()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    dgrams = (c1["rx"] - c0["rx"]) + (c1["tx"] - c0["tx"])
    gbit = ((c1["rx_bytes"] - c0["rx_bytes"]) + (c1["tx_bytes"] - c0["tx_bytes"])) * 8 / 1e9
    stats = [s.stats() for s in sessions]
    out = {
        "seconds": t1 - t0, "cpu_seconds": cpu, "datagrams": dgrams, "gbit": gbit,
        "gso": [w.gso for w in workers], "gro": [w.gro for w in workers],
        "aggregator_gso_sends": c1["gso_sends"], "aggregator_gro_receives": c1["gro_receives"],
        "retransmits": sum(s["retransmits"] for s in stats),
    }  # fmt: skip
    for s in sessions:
        s.close()
    agg.stop()
    return out


def pump(binary: Path, size: int, seconds: float, gso: bool) -> dict[str, Any]:
    argv = [str(binary), str(size), str(seconds), "1", "1"] + (["gso"] if gso else [])
    r: dict[str, Any] = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    gbit = r["received"] * size * 8 / 1e9
    return {
        "seconds": r["seconds"],
        "cpu_seconds": r["cpu_seconds"],
        "datagrams": r["received"],
        "gbit": gbit,
    }


def line(what: str, r: dict[str, Any]) -> str:
    return (
        f"{what:<40} {r['datagrams'] / r['seconds'] / 1e3:6.0f} kdgram/s "
        f"{r['gbit'] / r['seconds']:6.2f} Gbit/s {r['cpu_seconds'] / r['seconds']:5.2f} cores "
        f"{r['cpu_seconds'] / r['gbit']:7.3f} cpu-s/Gbit"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", nargs=4, type=int, metavar=("N", "K", "MB", "CALLS"), help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mb", type=int, default=16, help="MB of int32 per worker and call")
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--reps", type=int, default=3, help="alternations of GSO on and off")
    p.add_argument("--out", default=str(RESULTS / "gso.json"))
    args = p.parse_args()
    if args.engine:
        print(json.dumps(engine(*args.engine)))
        return 0
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "udp_pump"
        subprocess.run(
            ["cc", "-O2", "-o", str(binary), str(ROOT / "bench" / "udp_pump.c"), "-lpthread"], check=True
        )
        for _ in range(args.reps):
            for mtu, k in FRAMES.items():
                size = 28 + 4 * k
                for gso in (True, False):
                    mode = "GSO/GRO" if gso else "one datagram per send"
                    r = pump(binary, size, 2.0, gso)
                    rows.append({"what": "udp_pump", "mtu": mtu, "datagram": size, "gso": gso, **r})
                    print(line(f"pump {size} B, {mode}", r), flush=True)
                    env = {**os.environ, "SWITCHAGG_GSO": "1" if gso else "0"}
                    argv = [
                        sys.executable,
                        __file__,
                        "--engine",
                        str(args.workers),
                        str(k),
                        str(args.mb),
                        str(args.calls),
                    ]
                    out = subprocess.run(
                        argv, capture_output=True, text=True, env=env, timeout=600, check=True
                    )
                    e = json.loads(out.stdout.strip().splitlines()[-1])
                    rows.append({"what": "switchagg", "mtu": mtu, "datagram": size, "gso": gso, **e})
                    print(line(f"switchagg K={k}, {mode}", e), flush=True)
    Path(args.out).write_text(
        json.dumps({"cpus": os.cpu_count(), "workers": args.workers, "rows": rows}, indent=1)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
