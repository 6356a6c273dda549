"""In-network aggregation against the ring, on rate-limited links: the emulated rack of
switchagg_lab.testbed (one namespace per worker, every link capped at R both ways by tbf), same run,
same links, side by side:

* switchagg: init_process_group("switchagg") through the testbed's job service; the software
  aggregator in the switch namespace sums (the "switch"); each worker sends S and receives S.
* gloo: torch's allreduce (a ring), over the same links through the switch namespace's bridge;
  each worker sends and receives 2(n-1)/n * S.

Links have MTU --mtu (9000 and/or 1500) and lose --loss percent of their IPv4 frames each way at
every worker (nftables, fragments and gloo's TCP included); switchagg's K is the most one frame
carries unless --k says (protocol.k_for_mtu) and its window protocol.WINDOW_BYTES of packets.

--bits 16 / 8 sends switchagg's float32 values in 16- or 8-bit lanes (SWITCHAGG_WIRE_BITS; docs/PROTOCOL.md,
Narrow lanes), so its bound is S·bits/32/R; gloo then sums the same values as float16 at 16 bits (what
torch's fp16_compress_hook hands the ring) and as float32 at 8 (gloo has no 8-bit sum).

Per point it prints both times (the slowest rank's, median over --reps), gloo/switchagg, the
fraction of the in-network bound S/R that switchagg reaches, and the CPU each system used: its ranks'
(and switchagg's aggregator's) own CPU seconds over the timed allreduces, as a share of all the host's
cores (`cpu_share`; unlike the host's load, `cpu_busy`, it is not raised by a neighbour's work). Writes
bench/results/testbed.json and testbed.png; with --train, also the DDP step time of
examples/train_digits.py (a wide MLP, so the gradients are large) on both backends.

Needs root, iproute2 and torch. Bounded: every run has a timeout.
    python bench/bench_testbed.py                      # full grid (~15 min)
    python bench/bench_testbed.py --rates 200 --workers 4 --sizes 16 --reps 1
    python bench/bench_testbed.py --rates 200 --workers 4 --sizes 64 --mtu 1500 9000 --loss 0 0.1 1
    python bench/bench_testbed.py --rates 200 --workers 8 --sizes 64 --bits 32 16 8 \\
        --out bench/results/testbed_lanes.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from switchagg.cli_util import parse_rate
from switchagg_lab.testing.progress import Steps

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MB = 1 << 20


def gloo_dtype(bits: int) -> str:
    """What gloo sums where switchagg sends ``bits``-bit lanes: float16 at 16 (fp16_compress_hook's
    ring), float32 otherwise (gloo has no 8-bit float sum)."""
    return "float16" if bits == 16 else "float32"


def worker(args: argparse.Namespace) -> int:
    """One rank: allreduce --size MB of float32 values --reps times (in --bits lanes on switchagg, as
    gloo_dtype on gloo); prints its times as JSON."""
    import torch
    import torch.distributed as dist

    bits = args.bits[0]  # the bench passes one width to its workers
    if args.backend == "switchagg":
        os.environ["SWITCHAGG_WIRE_BITS"] = str(bits)
        import switchagg.torch  # noqa: F401 (registers the backend)
    dist.init_process_group(args.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, gloo_dtype(bits)) if args.backend == "gloo" else torch.float32
    x = torch.empty(args.size * MB // 4, dtype=dtype)
    warm = torch.ones(1 << 16)
    dist.all_reduce(warm)  # connections and the job are set up outside the timed part
    times, busy, total, cpu_s = [], 0, 0, 0.0
    for _ in range(args.reps):
        x.fill_(rank + 1)
        dist.barrier()
        b0, t0_cpu = _cpu()  # /proc/stat is the host's, whichever namespace reads it
        c0 = time.process_time()  # this process's own CPU (all threads): not the neighbours' load
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
        cpu_s += time.process_time() - c0
        b1, t1_cpu = _cpu()
        busy, total = busy + b1 - b0, total + t1_cpu - t0_cpu
    want = n * (n + 1) / 2
    err = float((x.float() - want).abs().max())
    report = {
        "rank": rank,
        "times": times,
        "max_error": err,
        "cpu_busy": busy / max(1, total),
        "cpu_s": cpu_s,
    }
    if args.backend == "switchagg":  # retransmissions spend capped link capacity: count them
        from switchagg.torch import backend_of

        stats = backend_of().data_plane.stats()
        report["retransmits"], report["sent"] = stats["retransmits"], stats["sent"]
        report["fast_retransmits"] = stats["fast_retransmits"]
        report["tail_probes"], report["timeouts"] = stats["tail_probes"], stats["timeouts"]
        report["bytes_lanes"] = {b: stats.get(f"bytes_lanes{b}", 0) for b in (32, 16, 8)}
        report["stats"] = stats
    print(json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs; niced work (a background build) counts as idle."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    user, nice, system, idle, iowait, irq, softirq = fields
    return user + system + irq + softirq, sum(fields)


def _process_cpu(pid: int | None) -> float:
    """CPU seconds (user + system, all threads) a process has used so far; 0 without one."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_ranks(bed: Any, workdir: Path, argv: list[str], timeout: float, port: int) -> list[str]:
    from switchagg_lab.testbed.testbed_controller import worker_env

    procs = []
    for e in bed.endpoints:
        env = {
            **os.environ,
            **worker_env(bed.endpoints, e.index, workdir, port),
            "TORCH_CPP_LOG_LEVEL": "ERROR",
        }
        procs.append(e.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
    outs = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"a rank did not finish within {timeout:.0f} s") from None
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise RuntimeError(f"a rank failed ({p.returncode}): {err.strip()[-2000:]}")
        outs.append(out)
    return outs


_port = iter(range(29500, 30500))


def measure(
    bed: Any,
    workdir: Path,
    backend: str,
    size_mb: int,
    reps: int,
    timeout: float,
    agg_pid: int | None = None,
    bits: int = 32,
) -> dict[str, Any]:
    """``agg_pid``: the process that aggregates (the job service's software aggregator); its CPU counts with
    the ranks' in ``cpu_share`` (the job's own CPU over the timed allreduces, of all the host's cores).
    ``bits``: switchagg's lanes (gloo sums gloo_dtype(bits))."""
    argv = [sys.executable, __file__, "--worker", "--backend", backend, "--size", str(size_mb)]
    argv += ["--reps", str(reps), "--bits", str(bits)]
    agg0 = _process_cpu(agg_pid)
    outs = _run_ranks(bed, workdir, argv, timeout, next(_port))
    agg_cpu = _process_cpu(agg_pid) - agg0  # over the whole run: an upper bound of the timed part
    reports = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    slowest = [
        max(r["times"][i] for r in reports) for i in range(reps)
    ]  # a collective ends with its last rank
    return {
        "seconds": statistics.median(slowest),
        "all_seconds": slowest,
        "max_error": max(r["max_error"] for r in reports),
        "cpu_busy": reports[0]["cpu_busy"],  # the host's load while rank 0 was in the allreduces
        "cpu_share": (sum(r["cpu_s"] for r in reports) + agg_cpu) / sum(slowest) / (os.cpu_count() or 1),
        "retransmits": sum(r.get("retransmits", 0) for r in reports),
        "sent": sum(r.get("sent", 0) for r in reports),
        "fast_retransmits": sum(r.get("fast_retransmits", 0) for r in reports),
        "tail_probes": sum(r.get("tail_probes", 0) for r in reports),
        "timeouts": sum(r.get("timeouts", 0) for r in reports),
        "status_resends": sum(r.get("stats", {}).get("status_resends", 0) for r in reports),
        "bytes_lanes": reports[0].get("bytes_lanes", {}),  # rank 0's datagram bytes per lane width
    }


def train(bed: Any, workdir: Path, backend: str, hidden: int, timeout: float) -> dict[str, Any]:
    out = workdir / f"train-{backend}.json"
    argv = [sys.executable, str(ROOT / "examples" / "train_digits.py"), "--backend", backend]
    argv += ["--epochs", "1", "--hidden", str(hidden), "--json", str(out)]
    _run_ranks(bed, workdir, argv, timeout, next(_port))
    record: dict[str, Any] = json.loads(out.read_text())["history"][-1]
    return record


def plot(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({p["rate_mbit"] for p in points}, reverse=True)
    sizes = sorted({p["size_mb"] for p in points})
    fig, axes = plt.subplots(
        len(rates), len(sizes), figsize=(4 * len(sizes), 3.2 * len(rates)), squeeze=False
    )
    for i, rate in enumerate(rates):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            pts = sorted(
                (p for p in points if p["rate_mbit"] == rate and p["size_mb"] == size), key=lambda p: p["n"]
            )
            ns = [p["n"] for p in pts]
            ax.plot(ns, [p["gloo_s"] for p in pts], "o-", label="gloo ring")
            ax.plot(ns, [p["switchagg_s"] for p in pts], "s-", label="switchagg")
            ax.plot(ns, [p["ina_bound_s"] for p in pts], "k--", label="S/R (in-network bound)")
            ax.plot(ns, [p["ring_bound_s"] for p in pts], "k:", label="2(n-1)/n S/R (ring bound)")
            ax.set_title(f"{size} MB float32, links {rate:g} Mbit/s", fontsize=9)
            ax.set_xlabel("workers")
            ax.set_ylabel("allreduce time (s)")
            ax.set_xticks(ns)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_loss(points: list[dict[str, Any]], path: Path) -> None:
    """Allreduce time against frame loss, per MTU, gloo beside switchagg (one panel per rate, n, size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(p["rate_mbit"], p["n"], p["size_mb"]) for p in points})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.4), squeeze=False)
    for ax, (rate, n, size) in zip(axes[0], panels, strict=True):
        for mtu in sorted({p["mtu"] for p in points}):
            pts = sorted(
                (
                    p
                    for p in points
                    if (p["rate_mbit"], p["n"], p["size_mb"], p["mtu"], p.get("gso", "on"))
                    == (rate, n, size, mtu, "on")
                ),
                key=lambda p: p["loss_pct"],
            )
            losses = [p["loss_pct"] for p in pts]
            ax.plot(losses, [p["switchagg_s"] for p in pts], "s-", label=f"switchagg, MTU {mtu}")
            ax.plot(losses, [p["gloo_s"] for p in pts], "o--", label=f"gloo ring, MTU {mtu}")
        bound = size * MB * 8 / (rate * 1e6)
        ax.axhline(bound, color="k", lw=0.8, ls=":", label="S/R")
        ax.set_xscale("symlog", linthresh=0.1)
        ax.set_title(f"{size} MB float32, n={n}, links {rate:g} Mbit/s", fontsize=9)
        ax.set_xlabel("frames lost each way (%)")
        ax.set_ylabel("allreduce time (s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_bits(points: list[dict[str, Any]], path: Path) -> None:
    """Allreduce time per lane width (--bits), gloo (float16 beside 16-bit lanes) beside switchagg,
    with switchagg's bound S·bits/32/R; one panel per (rate, n, size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(p["rate_mbit"], p["n"], p["size_mb"]) for p in points})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (rate, n, size) in zip(axes[0], panels, strict=True):
        pts = sorted(
            (p for p in points if (p["rate_mbit"], p["n"], p["size_mb"]) == (rate, n, size)),
            key=lambda p: -p["bits"],
        )
        xs = range(len(pts))
        ax.bar([x - 0.2 for x in xs], [p["gloo_s"] for p in pts], 0.4, label="gloo ring", color="tab:blue")
        ax.bar(
            [x + 0.2 for x in xs], [p["switchagg_s"] for p in pts], 0.4, label="switchagg", color="tab:orange"
        )
        for x, p in zip(xs, pts, strict=True):
            ax.hlines(
                p["ina_bound_s"],
                x,
                x + 0.4,
                colors="k",
                linestyles="--",
                label="S·bits/32/R" if x == 0 else None,
            )
            ax.text(
                x + 0.2,
                p["switchagg_s"],
                f"{p['switchagg_of_bound']:.0%}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(list(xs), [f"{p['bits']}-bit\n(gloo {p['gloo_dtype']})" for p in pts], fontsize=8)
        ax.set_title(f"{size} MB float32, n={n}, links {rate:g} Mbit/s", fontsize=9)
        ax.set_ylabel("allreduce time (s)")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


HEADER = (
    f"{'rate':>6} {'n':>2} {'size':>6} {'mtu':>5} {'loss%':>5} {'K':>5} {'gso':>3} {'bits':>4} {'gloo s':>8} "
    f"{'switchagg s':>11} {'gloo/sa':>8} {'bound s':>7} {'of it':>6} {'cpu gloo':>8} {'cpu sa':>6} "
    f"{'resent':>6}"
)


def step_weight(rate: float, size: int, reps: int) -> float:
    """A measurement's expected seconds: the in-network bound per allreduce, plus starting the ranks."""
    return reps * size * MB * 8 / (rate * 1e6) + 5


TRAIN_WEIGHT = 60.0  # one epoch of train_digits.py, roughly, on a capped testbed


def point(
    bed: Any,
    workdir: Path,
    rate: float,
    size: int,
    reps: int,
    progress: Steps,
    loss: float = 0.0,
    k: int = 0,
    agg_pid: int | None = None,
    bits: int = 32,
) -> dict[str, Any]:
    """Both systems on one testbed, one size, one frame loss, one lane width: gloo first, then
    switchagg. The bounds are those of the bytes each sends: switchagg S·bits/32/R, the ring
    2(n-1)/n of gloo_dtype's bytes over R."""
    n = bed.n
    for e in bed.endpoints:
        e.set_loss(loss)
    bound = size * MB * 8 / (rate * 1e6) * bits / 32
    ring = 2 * (n - 1) / n * size * MB * 8 / (rate * 1e6) * (16 if gloo_dtype(bits) == "float16" else 32) / 32
    timeout = 120 + 20 * size * MB * 8 / (rate * 1e6) * reps
    what = f"{rate:g} Mbit/s, n={n}, {size} MB" + (f", {bits}-bit lanes" if bits != 32 else "")
    progress.step(f"{what}: gloo ({gloo_dtype(bits)})", step_weight(rate, size, reps))
    g = measure(bed, workdir, "gloo", size, reps, timeout, bits=bits)
    progress.step(f"{what}: switchagg", step_weight(rate, size, reps))
    lost_before = sum(e.lost() for e in bed.endpoints)
    s = measure(bed, workdir, "switchagg", size, reps, timeout, agg_pid, bits)
    lost_switchagg = sum(e.lost() for e in bed.endpoints) - lost_before
    p = {
        "rate_mbit": rate, "n": n, "size_mb": size, "mtu": bed.mtu, "loss_pct": loss, "k": k,
        "bits": bits, "gloo_dtype": gloo_dtype(bits), "bytes_lanes": s["bytes_lanes"],
        "frames_lost": sum(e.lost() for e in bed.endpoints),  # in both systems' runs
        "frames_lost_switchagg": lost_switchagg,  # in switchagg's run: what its resends repaired
        "gloo_s": g["seconds"], "switchagg_s": s["seconds"], "speedup": g["seconds"] / s["seconds"],
        "ina_bound_s": bound, "ring_bound_s": ring,
        "switchagg_of_bound": bound / s["seconds"],
        "gloo_of_ring_bound": ring / g["seconds"],
        "cpu_busy_gloo": g["cpu_busy"], "cpu_busy_switchagg": s["cpu_busy"],
        "cpu_share_gloo": g["cpu_share"], "cpu_share_switchagg": s["cpu_share"],
        "max_error_switchagg": s["max_error"], "max_error_gloo": g["max_error"],
        "runs_gloo": g["all_seconds"], "runs_switchagg": s["all_seconds"],
        "retransmits": s["retransmits"], "fast_retransmits": s["fast_retransmits"], "packets_sent": s["sent"],
        "tail_probes": s["tail_probes"], "timeouts": s["timeouts"], "status_resends": s["status_resends"],
    }  # fmt: skip
    print(
        f"{rate:6g} {n:2d} {size:4d}MB {bed.mtu:5d} {loss:5g} {k:5d} "
        f"{'off' if os.environ.get('SWITCHAGG_GSO') == '0' else 'on':>3} {bits:4d} {p['gloo_s']:8.2f} "
        f"{p['switchagg_s']:11.2f} {p['speedup']:7.2f}x {bound:7.2f} {p['switchagg_of_bound']:6.0%} "
        f"{g['cpu_share']:8.0%} {s['cpu_share']:6.0%} {s['retransmits']:6d} ({s['fast_retransmits']} fast, "
        f"{s['status_resends']} asked, {s['tail_probes']} probes, {s['timeouts']} timer; {s['sent']} sent, "
        f"{lost_switchagg} frames lost)",
        flush=True,
    )
    return p


def train_both(bed: Any, workdir: Path, rate: float, hidden: int, progress: Steps) -> list[dict[str, Any]]:
    records = []
    for backend in ("gloo", "switchagg"):
        progress.step(f"{rate:g} Mbit/s, n={bed.n}: DDP training on {backend}", TRAIN_WEIGHT)
        rec = {
            "rate_mbit": rate,
            "n": bed.n,
            "backend": backend,
            **train(bed, workdir, backend, hidden, 1800),
        }
        records.append(rec)
        print(
            f"DDP step ({backend}, n={bed.n}, {rate:g} Mbit/s, hidden {hidden}): {rec['step_ms']:.0f} ms, "
            f"accuracy {rec['accuracy']:.2%}",
            flush=True,
        )
    g, s = records
    print(f"DDP step time gloo/switchagg: {g['step_ms'] / s['step_ms']:.2f}x", flush=True)
    return records


def bench(args: argparse.Namespace) -> int:
    from switchagg_lab.testbed import Testbed, tools
    from switchagg_lab.testbed.testbed_controller import start_job_service, sw_layout

    reason = tools.missing_for(["ip", "tc"] + (["nft"] if any(args.loss) else []), "bench_testbed")
    if reason:
        print(reason, file=sys.stderr)
        return 2
    points: list[dict[str, Any]] = []
    training: list[dict[str, Any]] = []
    weights = [
        step_weight(r, size, args.reps)
        for r in args.rates
        for _ in args.workers
        for _ in args.mtu
        for _ in args.loss
        for _ in args.gso
        for _ in args.bits
        for size in args.sizes
    ]
    trains = 2 if args.train else 0
    progress = Steps(2 * len(weights) + trains, 2 * sum(weights) + trains * TRAIN_WEIGHT)
    print(HEADER)
    with tempfile.TemporaryDirectory() as tmp:
        for rate, n, mtu in ((r, n, m) for r in args.rates for n in args.workers for m in args.mtu):
            workdir = Path(tmp) / f"r{rate:g}n{n}m{mtu}"
            k, slots = sw_layout(mtu, args.k, args.slots)
            with Testbed(n, workdir, data_plane="soft", rate_mbit=rate, mtu=mtu) as bed:
                for gso in args.gso:  # the aggregator (the job service's) and the ranks inherit it
                    os.environ["SWITCHAGG_GSO"] = "1" if gso == "on" else "0"
                    service = start_job_service(bed, workdir, sw_k=k, sw_slots=slots)
                    try:
                        points += [
                            {
                                **point(
                                    bed, workdir, rate, size, args.reps, progress, loss, k, service.pid, bits
                                ),
                                "gso": gso,
                            }
                            for loss in args.loss
                            for bits in args.bits
                            for size in args.sizes
                        ]
                        last = rate == args.rates[-1] and n == args.workers[-1] and gso == args.gso[-1]
                        if args.train and last:
                            for e in bed.endpoints:
                                e.set_loss(0)
                            training = train_both(bed, workdir, rate, args.hidden, progress)
                    finally:
                        service.kill()
                        service.wait(timeout=30)
    result = {
        "host": {
            "cpus": os.cpu_count(),
            "k": args.k,
            "slots": args.slots,
            "mtu": args.mtu,
            "loss": args.loss,
            "gso": args.gso,
            "bits": args.bits,
        },
        "points": points,
        "training": training,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if points:
        first = (args.loss[0], args.gso[0], args.bits[0])
        if len(args.bits) > 1:  # time per lane width, at the first loss and GSO setting
            plot_bits([p for p in points if (p["loss_pct"], p["gso"]) == first[:2]], out.with_suffix(".png"))
        else:
            plot(
                [p for p in points if (p["loss_pct"], p["gso"], p["bits"]) == first], out.with_suffix(".png")
            )
        if len(args.loss) > 1:
            plot_loss(points, out.with_name(out.stem + "_loss.png"))
    progress.finish(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument(
        "--rates",
        type=parse_rate,
        nargs="+",
        default=[1000, 200],
        help="link rates: Mbit/s, or 1gbit, 200mbit",
    )
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256], help="MB of float32")
    p.add_argument("--reps", type=int, default=2, help="timed allreduces per point (median)")
    p.add_argument("--mtu", type=int, nargs="+", default=[9000], help="link MTUs (default 9000)")
    p.add_argument(
        "--loss", type=float, nargs="+", default=[0.0], help="percent of frames lost each way per link"
    )
    p.add_argument(
        "--k", type=int, help="elements per packet (default: the most one frame of the MTU carries)"
    )
    p.add_argument("--slots", type=int, help="slots per job (default: protocol.WINDOW_BYTES of packets)")
    p.add_argument(
        "--gso",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="UDP GSO/GRO in the workers and the aggregator; `off` is SWITCHAGG_GSO=0, the fallback",
    )
    p.add_argument(
        "--bits",
        type=int,
        nargs="+",
        choices=(32, 16, 8),
        default=[32],
        help="switchagg's lane widths (SWITCHAGG_WIRE_BITS; gloo sums float16 at 16): one point each",
    )
    p.add_argument("--train", action="store_true", help="also time DDP steps of train_digits.py")
    p.add_argument("--hidden", type=int, default=2048, help="train_digits.py --hidden (gradient size)")
    p.add_argument("--out", default=str(RESULTS / "testbed.json"))
    args = p.parse_args()
    return worker(args) if args.worker else bench(args)


if __name__ == "__main__":
    sys.exit(main())
