"""The multi-core software aggregator on loopback: ``switchagg-aggregator --threads 1`` against
``--threads 2``, and both against the raw UDP pump of the same machine, in the same run.

* **aggregator**: a ``switchagg-aggregator`` process, n workers (the unchanged worker engine, one
  thread each in this process, the GIL released) allreduce an int32 tensor of --size-mb through it
  (K = 16368: 65,500-byte datagrams; --slots slots). Its rate: the contributions it aggregated per
  second (n x chunks per allreduce, resends not counted) and their payload in Gbit/s.
* **raw UDP pump** (bench/udp_pump.c, compiled here with the system gcc): sendmmsg on one socket,
  recvmmsg on another, 64 datagrams per call like the aggregator, the same datagram size, no
  protocol: what the kernel moves one way between two sockets. Once with one sender and one
  receiver, once with two of each (an SO_REUSEPORT group, as the aggregator's threads).

The configurations run in turns, --rounds times (the machine's other work moves each number; the
median of the rounds is reported). Prints each rate and the ratios (2 threads / 1 thread, each
against the pump), and the aggregator's CPU (cores busy, from /proc) and the workers' resends;
writes bench/results/aggregator_threads.json.

On loopback the workers and the aggregator share the CPUs: where they are fewer than the
aggregator's threads plus the workers, the workers are the limit and a second aggregator thread
cannot show its worth. The JSON records the CPU count.

    python bench/bench_aggregator_threads.py --workers 2 --size-mb 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PUMP_SOURCE = ROOT / "bench" / "udp_pump.c"
MB = 1 << 20
JOB = 1


def build_pump(where: Path) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SystemExit("the raw UDP pump needs gcc (apt-get install gcc libc6-dev)")
    exe = where / "udp_pump"
    cmd = [gcc, "-O2", "-std=gnu11", "-Wall", "-Wextra", str(PUMP_SOURCE), "-lpthread", "-o", str(exe)]
    subprocess.run(cmd, check=True, timeout=120)
    return exe


def pump(exe: Path, datagram: int, seconds: float, pairs: int) -> dict[str, float]:
    out = subprocess.run(
        [str(exe), str(datagram), str(seconds), str(pairs), str(pairs)],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    )
    r = json.loads(out.stdout)
    pps = r["received"] / r["seconds"]
    return {"pkts_per_s": pps, "gbit_per_s": pps * datagram * 8 / 1e9}


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed_allreduce(sessions: list[Any], tensors: list[np.ndarray]) -> float:
    """One allreduce of every rank at once (a thread each; the worker releases the GIL): its
    seconds, every sum checked (rank r contributes r + 1)."""
    want = len(sessions) * (len(sessions) + 1) // 2
    for r, t in enumerate(tensors):
        t.fill(r + 1)
    errors: list[BaseException] = []

    def run(s: Any, t: np.ndarray) -> None:
        try:
            s.allreduce(t)
        except BaseException as e:
            errors.append(e)

    runs = [threading.Thread(target=run, args=st) for st in zip(sessions, tensors, strict=True)]
    start = time.perf_counter()
    for th in runs:
        th.start()
    for th in runs:
        th.join()
    took = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"an allreduce failed: {errors[0]!r}")
    if not all((t == want).all() for t in tensors):
        raise RuntimeError("a sum is wrong")
    return took


def aggregator(threads: int, workers: int, size_mb: int, reps: int, k: int, slots: int) -> dict[str, Any]:
    """One switchagg-aggregator --threads process, ``workers`` sessions: one warm-up allreduce, then
    ``reps`` timed ones; every result checked exactly."""
    from switchagg import Session, _core
    from switchagg.aggregator import new_key

    elems = size_mb * MB // 4
    ws = [_core.Worker("127.0.0.1", 0) for _ in range(workers)]
    key = new_key()
    addrs = ",".join("{}:{}".format(*w.address) for w in ws)
    with tempfile.TemporaryDirectory() as tmp:
        counters_file = Path(tmp) / "counters.json"
        cmd = [sys.executable, "-m", "switchagg.aggregator_cli", "--port", "0", "--threads", str(threads)]
        cmd += [
            "--job",
            f"{JOB}:{workers}:0:{slots}:{k}:1:{key}@{addrs}",
            "--counters-json",
            str(counters_file),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stderr is not None
            first = proc.stdout.readline()
            if "listening on" not in first:
                raise RuntimeError(f"switchagg-aggregator did not start: {first}{proc.stderr.read()}")
            port = int(first.split("127.0.0.1:")[1].split(";")[0])
            sessions = [
                Session(JOB, r, workers, ("127.0.0.1", port), 0, slots, k, timeout=60, key=key, _worker=w)
                for r, w in enumerate(ws)
            ]
            tensors = [np.full(elems, r + 1, dtype=np.int32) for r in range(workers)]

            def one_allreduce() -> float:
                return _timed_allreduce(sessions, tensors)

            one_allreduce()  # warm-up: page faults, socket buffers
            before = [s.stats() for s in sessions]
            cpu0 = _cpu_seconds(proc.pid)
            times = [one_allreduce() for _ in range(reps)]
            cpu = _cpu_seconds(proc.pid) - cpu0
            after = [s.stats() for s in sessions]
            for s in sessions:
                s.close()
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=10)
        counters = json.loads(counters_file.read_text())
    chunks = -(-elems // k)
    total = sum(times)
    pps = workers * chunks * reps / total
    resends = sum(a["retransmits"] - b["retransmits"] for a, b in zip(after, before, strict=True))
    return {
        "pkts_per_s": pps,
        "gbit_per_s": pps * k * 4 * 8 / 1e9,
        "seconds_per_allreduce": statistics.median(times),
        "aggregator_cores_busy": cpu / total,
        "resends": resends,
        "contributions": workers * chunks * reps,
        "per_thread_rx": [t["rx"] for t in counters["threads"]],
    }


def bench(args: argparse.Namespace) -> int:
    from switchagg import protocol

    k = args.k
    datagram = protocol.HEADER_LEN + 4 * k
    configs = ["pump x1", "pump x2", "aggregator 1 thread", "aggregator 2 threads"]
    rounds: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_pump(Path(tmp))
        for i in range(args.rounds):
            for c in configs:
                print(f"[round {i + 1}/{args.rounds}] {c}", file=sys.stderr, flush=True)
                if c.startswith("pump"):
                    rounds[c].append(pump(exe, datagram, args.pump_seconds, 1 if c.endswith("x1") else 2))
                else:
                    threads = 1 if "1 thread" in c else 2
                    rounds[c].append(
                        aggregator(threads, args.workers, args.size_mb, args.reps, k, args.slots)
                    )
    med = {
        c: {m: statistics.median(r[m] for r in rs) for m in ("pkts_per_s", "gbit_per_s")}
        for c, rs in rounds.items()
    }
    one, two, p1 = med["aggregator 1 thread"], med["aggregator 2 threads"], med["pump x1"]
    usable = len(os.sched_getaffinity(0))
    print(
        f"\nloopback, {datagram}-byte datagrams (K = {k}), {args.workers} workers, {args.size_mb} MB int32, "
        f"{os.cpu_count()} CPUs ({usable} usable); median of {args.rounds} rounds"
    )
    print(f"{'':22} {'pkts/s':>8} {'Gbit/s':>7} {'of pump x1':>10}  aggregator cores busy; resends")
    for c in configs:
        m = med[c]
        of_pump = m["pkts_per_s"] / p1["pkts_per_s"]
        line = f"{c:22} {m['pkts_per_s']:>8.0f} {m['gbit_per_s']:>7.2f} {of_pump:>9.2f}x"
        if c.startswith("aggregator"):
            busy = statistics.median(r["aggregator_cores_busy"] for r in rounds[c])
            resends = sum(r["resends"] for r in rounds[c])
            line += f"  {busy:.2f}; {resends} of {sum(r['contributions'] for r in rounds[c])}"
        print(line)
    ratio = two["pkts_per_s"] / one["pkts_per_s"]
    print(
        f"2 threads / 1 thread: {ratio:.2f}x packets/s; payload against the pump: "
        f"1 thread {one['gbit_per_s'] / p1['gbit_per_s']:.2f}, "
        f"2 threads {two['gbit_per_s'] / p1['gbit_per_s']:.2f} "
        f"(against the 2-pair pump: {two['gbit_per_s'] / med['pump x2']['gbit_per_s']:.2f})"
    )
    result = {
        "datagram_bytes": datagram,
        "k": k,
        "workers": args.workers,
        "size_mb": args.size_mb,
        "reps": args.reps,
        "slots": args.slots,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "median": med,
        "ratio_2_over_1_threads": ratio,
        "runs": rounds,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def main() -> int:
    from switchagg import protocol

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="worker sessions (default 2)")
    p.add_argument("--size-mb", type=int, default=64, help="int32 tensor per allreduce, MB (default 64)")
    p.add_argument("--reps", type=int, default=4, help="timed allreduces per configuration and round")
    p.add_argument("--rounds", type=int, default=3, help="turns over all configurations (median reported)")
    p.add_argument("--slots", type=int, default=32, help="the job's slots: its window (default 32)")
    p.add_argument("--k", type=int, default=protocol.DEFAULT_SW_K, help="values per datagram")
    p.add_argument("--pump-seconds", type=float, default=2.0, help="how long each pump run lasts")
    p.add_argument("--out", default=str(RESULTS / "aggregator_threads.json"))
    return bench(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
