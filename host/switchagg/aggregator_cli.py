"""switchagg-aggregator: the software aggregator's daemon (switchagg.aggregator is the library).

switchagg-aggregator --port 48879 --job 7:2:0:32:8192@127.0.0.1:5000,127.0.0.1:5001 --stats-interval 5

A job without KEY gets a random result key, printed (``job 7 result key: 0x...``) for the workers'
``Session(key=...)``; KEY ``unkeyed`` runs it without one, with a warning (docs/PROTOCOL.md, Security).

Every job names each rank's (IP, UDP port): a rank's contributions are accepted only from its
address and its results go only there (docs/PROTOCOL.md, Security). ``--threads N`` serves the
port with N threads (default: the CPUs the process may use), each owning the slots whose class (slot
mod 8) is congruent to
its index; the workers are unchanged.

Two levels (docs/PROTOCOL.md, Two levels): a leaf names its local ranks and ``-`` for the others,
and ``--leaf JOB:INDEX@SPINE_IP:PORT``; a spine is a plain job whose ranks are the leaves; every
node of a job is given its one key:

switchagg-aggregator --port 6001 --job 7:4:0:32:8192:1:0x5ec12e7@127.0.0.1:5000,127.0.0.1:5001,-,-
    --leaf 7:0@127.0.0.1:6000
switchagg-aggregator --port 6000 --job 7:2:0:32:8192:1:0x5ec12e7@127.0.0.1:6001,127.0.0.1:6002

A controller installs jobs itself through the control service (switchagg.aggregator_control):

switchagg-aggregator --host 10.0.1.254 --control 10.0.0.1:50061 --control-secret-file secret
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from switchagg.aggregator import MAX_KEY, MAX_THREADS, SoftwareAggregator, format_counters, usable_cpus
from switchagg.cli_util import add_version, quiet_broken_pipe
from switchagg.keys import UNKEYED
from switchagg.protocol import DEFAULT_SW_K, DEFAULT_SW_SLOTS, UDP_PORT

# KEY: None when the spec gives none (a fresh random key is drawn and printed), UNKEYED for "unkeyed".
JobSpec = tuple[int, int, int, int, int, int, list[tuple[str, int] | None], int | None]
JOB_SYNTAX = "ID:N:BASE:COUNT:K[:GEN[:KEY]]@IP:PORT,IP:PORT,..."
NO_KEY = "unkeyed"


LEAF_SYNTAX = "JOB:INDEX@IP:PORT"


def parse_job(spec: str) -> JobSpec:
    """ID:N:BASE:COUNT:K[:GEN[:KEY]]@ADDR,... -> (job_id, n, slot_base, slot_count, k, generation,
    addrs, key); an ADDR ``-`` (None) is a rank behind another leaf. GEN defaults to 1. KEY, the
    result key (decimal or 0x hex, 32 bits, non-zero): None when omitted (main draws one and prints
    it); ``unkeyed`` opts out (UNKEYED, with a warning)."""
    numbers, at, addr_list = spec.partition("@")
    if not at or not addr_list:
        raise argparse.ArgumentTypeError(
            f"--job {spec!r} names no rank addresses: append @IP:PORT,... with one address per rank "
            f"({JOB_SYNTAX}); packets are accepted only from the addresses the job names"
        )
    parts = numbers.split(":")
    if len(parts) not in (5, 6, 7):
        raise argparse.ArgumentTypeError(f"--job {spec!r}: expected {JOB_SYNTAX}")
    key: int | None = None
    if len(parts) == 7:
        text = parts.pop()
        try:
            key = UNKEYED if text == NO_KEY else int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--job {spec!r}: KEY {text!r} is not a number (or '{NO_KEY}')"
            ) from None
        if text != NO_KEY and not 0 < key <= MAX_KEY:
            raise argparse.ArgumentTypeError(
                f"--job {spec!r}: KEY {text} is not a non-zero 32-bit unsigned number (omit it for a "
                f"random one; '{NO_KEY}' runs the job without one)"
            )
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--job {spec!r}: every field must be an integer") from None
    if len(nums) == 5:
        nums.append(1)
    addrs: list[tuple[str, int] | None] = []
    for item in addr_list.split(","):
        if item == "-":
            addrs.append(None)
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"--job {spec!r}: {item!r} is not IP:PORT")
        addrs.append((host, int(port)))
    if len(addrs) != nums[1]:
        raise argparse.ArgumentTypeError(
            f"--job {spec!r}: {nums[1]} ranks but {len(addrs)} addresses (one per rank, in rank order)"
        )
    return (nums[0], nums[1], nums[2], nums[3], nums[4], nums[5], addrs, key)


def _ip_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{what}: {text!r} is not IP:PORT")
    return host, int(port)


def parse_leaf(spec: str) -> tuple[int, int, tuple[str, int]]:
    """JOB:INDEX@IP:PORT -> (job_id, leaf_index, spine address)."""
    head, at, addr = spec.partition("@")
    job, colon, index = head.partition(":")
    if not at or not colon or not job.isdigit() or not index.isdigit():
        raise argparse.ArgumentTypeError(f"--leaf {spec!r}: expected {LEAF_SYNTAX}")
    return int(job), int(index), _ip_port(addr, f"--leaf {spec!r}")


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability in [0, 1]")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="switchagg-aggregator",
        description="The switchagg software aggregator: in-network style gradient aggregation over UDP.",
    )
    add_version(p)
    p.add_argument("--host", default="127.0.0.1", help="IPv4 address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=UDP_PORT, help=f"UDP port (default {UDP_PORT})")
    p.add_argument(
        "--threads",
        type=_threads,
        default=None,
        metavar="N",
        help="serving threads, one socket each on the port, each owning the slots whose class (slot mod 8) "
        "is congruent to its "
        "index (default: the CPUs this process may use)",
    )
    p.add_argument(
        "--job",
        action="append",
        type=parse_job,
        default=[],
        metavar=JOB_SYNTAX,
        help=f"install a job (repeatable), e.g. 7:2:0:{DEFAULT_SW_SLOTS}:{DEFAULT_SW_K}@127.0.0.1:5000,"
        "127.0.0.1:5001; GEN defaults to 1; KEY is the job's result key (decimal or 0x hex, 32 bits, "
        "non-zero), written into every RESULT: workers given it (Session(key=...)) drop results "
        f"without it; omitted, a random one is drawn and printed; '{NO_KEY}' runs the job without "
        "one (a warning); rank r's packets are accepted only from the r-th address",
    )
    p.add_argument(
        "--leaf",
        action="append",
        type=parse_leaf,
        default=[],
        metavar=LEAF_SYNTAX,
        help="aggregate job JOB here as leaf INDEX of the spine at IP:PORT (repeatable); the job's "
        "--job names its local ranks and '-' for ranks behind other leaves",
    )
    p.add_argument(
        "--counters-json", type=Path, metavar="FILE", help="write the final counters as JSON on exit"
    )
    _add_faults(p)
    p.add_argument(
        "--job-name",
        action="append",
        type=_job_name,
        default=[],
        metavar="ID=NAME",
        help="a job's name in the metrics' labels (repeatable)",
    )
    p.add_argument(
        "--stats-interval", type=float, default=0.0, metavar="SECONDS", help="print counters periodically"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on http://METRICS_HOST:PORT/metrics (0: a free port)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint binds (default 127.0.0.1; 0.0.0.0 for a remote Prometheus)",
    )
    p.add_argument(
        "--control",
        metavar="LISTEN",
        help="serve the control service (a controller installs jobs through it) on HOST:PORT or unix:PATH",
    )
    p.add_argument(
        "--control-secret-file",
        type=Path,
        metavar="FILE",
        help="the control service's shared secret (required with --control)",
    )
    return p


def _add_faults(p: argparse.ArgumentParser) -> None:
    """The fault injector's flags (tests and demos: loss and duplication on this host)."""
    p.add_argument(
        "--drop-in", type=_probability, default=0.0, help="drop received datagrams with this probability"
    )
    p.add_argument("--dup-in", type=_probability, default=0.0, help="process received datagrams twice")
    p.add_argument("--drop-out", type=_probability, default=0.0, help="drop sent datagrams")
    p.add_argument("--dup-out", type=_probability, default=0.0, help="send datagrams twice")
    p.add_argument("--seed", type=int, default=1, help="fault injection seed")


def _threads(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of threads") from None
    if not 1 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{value} threads: expected 1..{MAX_THREADS}")
    return value


def _job_name(text: str) -> tuple[int, str]:
    job, sep, name = text.partition("=")
    if not sep or not job.isdigit() or not name:
        raise argparse.ArgumentTypeError(f"--job-name {text!r}: expected ID=NAME")
    return int(job), name


def _install_jobs(agg: SoftwareAggregator, args: argparse.Namespace) -> dict[int, int]:
    """Every --job on ``agg`` (with its --job-name and --leaf): each job's result key, by job id."""
    names = dict(args.job_name)
    unknown = sorted(set(names) - {job[0] for job in args.job})
    if unknown:
        raise ValueError(f"--job-name names job {unknown[0]}, which no --job installs")
    leaves = {job: (index, spine) for job, index, spine in args.leaf}
    unknown = sorted(set(leaves) - {job[0] for job in args.job})
    if unknown:
        raise ValueError(f"--leaf names jobs that no --job installs: {unknown}")
    keys: dict[int, int] = {}
    for job in args.job:
        index, spine = leaves.get(job[0], (0, None))
        if spine is None and None in job[6]:
            raise ValueError(f"job {job[0]} has ranks '-' (behind other leaves) but no --leaf {job[0]}:...")
        if job[7] == UNKEYED:
            print(
                f"switchagg-aggregator: warning: job {job[0]} is unkeyed: its workers accept any "
                "RESULT from this port, so a process that takes it over while this one is down can "
                "forge sums (docs/PROTOCOL.md, Security)",
                file=sys.stderr,
            )
        with warnings.catch_warnings():  # said above, in the daemon's words
            warnings.simplefilter("ignore", RuntimeWarning)
            keys[job[0]] = agg.add_job(
                *job[:7], name=names.get(job[0], ""), upstream=spine, leaf_index=index, key=job[7]
            )
    return keys


@quiet_broken_pipe
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        agg = SoftwareAggregator(
            args.host,
            args.port,
            drop_in=args.drop_in,
            dup_in=args.dup_in,
            drop_out=args.drop_out,
            dup_out=args.dup_out,
            seed=args.seed,
            threads=args.threads if args.threads is not None else min(usable_cpus(), MAX_THREADS),
        )
        keys = _install_jobs(agg, args)
        if args.metrics_port is not None:
            metrics_host, metrics_port = agg.serve_metrics(args.metrics_port, args.metrics_host)
        if args.control is not None:
            if args.control_secret_file is None:
                raise ValueError("--control needs --control-secret-file")
            from switchagg.aggregator_control import serve_control

            secret = args.control_secret_file.read_text().strip()
            control, control_port, boot_id = serve_control(agg, args.control, secret)
    except (ValueError, OSError, ImportError) as exc:
        print(f"switchagg-aggregator: {exc}", file=sys.stderr)
        return 2

    done = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    agg.start()
    host, port = agg.address
    jobs = ", ".join(f"{j[0]} (n={j[1]}, slots {j[2]}..{j[2] + j[3] - 1}, K={j[4]})" for j in args.job)
    threads = f"{agg.threads} thread{'s' if agg.threads > 1 else ''}"
    print(f"switchagg-aggregator listening on {host}:{port}; {threads}; jobs: {jobs or 'none'}", flush=True)
    if args.metrics_port is not None:
        print(f"metrics on http://{metrics_host}:{metrics_port}/metrics", flush=True)
    if args.control is not None:
        where = args.control if control_port == 0 else f"{args.control.rpartition(':')[0]}:{control_port}"
        print(f"control on {where}; boot id {boot_id}", flush=True)
    for job_id, key in keys.items():  # the workers need it: Session(key=...)
        print(f"job {job_id} result key: {f'{key:#010x}' if key != UNKEYED else NO_KEY}", flush=True)
    interval = args.stats_interval if args.stats_interval > 0 else None
    while not done.wait(interval):
        print(format_counters(agg.counters()), flush=True)
    if args.control is not None:
        control.stop(grace=1.0).wait()
    final = agg.counters()
    agg.stop()
    print("final counters:\n" + format_counters(final), flush=True)
    if args.counters_json is not None:
        args.counters_json.write_text(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
