"""The software aggregator: `_core.Aggregator` served in a daemon thread, and its console script.

switchagg-aggregator --port 48879 --job 7:2:0:32:8192@127.0.0.1:5000,127.0.0.1:5001 --stats-interval 5

Every job names each rank's (IP, UDP port): a rank's contributions are accepted only from its
address and its results go only there (docs/PROTOCOL.md, Security).

Two levels (docs/PROTOCOL.md, Two levels): a leaf names its local ranks and ``-`` for the others,
and ``--leaf JOB:INDEX@SPINE_IP:PORT``; a spine is a plain job whose ranks are the leaves:

switchagg-aggregator --port 6001 --job 7:4:0:32:8192@127.0.0.1:5000,127.0.0.1:5001,-,-
    --leaf 7:0@127.0.0.1:6000
switchagg-aggregator --port 6000 --job 7:2:0:32:8192@127.0.0.1:6001,127.0.0.1:6002

A controller installs jobs itself through the control service (switchagg.aggregator_control):

switchagg-aggregator --host 10.0.1.254 --control 10.0.0.1:50061 --control-secret-file secret
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from switchagg import _core
from switchagg.cli_util import add_version, quiet_broken_pipe
from switchagg.protocol import (
    DEFAULT_SW_K,
    DEFAULT_SW_SLOTS,
    DROP_REASONS,
    JOB_COUNTERS,
    LEAF_COUNTERS,
    POOL_SLOT_MASK,
    UDP_PORT,
)

if TYPE_CHECKING:
    from switchagg.metrics import DataPlaneSample

Counters = dict[str, Any]
POOL_SLOTS = POOL_SLOT_MASK + 1  # the software aggregator's pool: every index the header can name


@dataclass(frozen=True)
class InstalledJob:
    n: int
    slot_base: int
    slot_count: int
    k: int
    name: str
    key: int = 0  # the job's result key (0: unkeyed)


class AggregatorHandle(Protocol):
    """What installs and reads jobs on a software aggregator: a SoftwareAggregator in this process,
    or a RemoteAggregator (switchagg.aggregator_control) reaching another one's control service."""

    @property
    def address(self) -> tuple[str, int]: ...

    def add_job(
        self,
        job_id: int,
        n: int,
        slot_base: int,
        slot_count: int,
        k: int,
        generation: int,
        addrs: Sequence[tuple[str, int] | None],
        *,
        name: str = "",
        upstream: tuple[str, int] | None = None,
        leaf_index: int = 0,
        key: int = 0,
    ) -> Any: ...

    def remove_job(self, job_id: int) -> Any: ...

    def jobs(self) -> dict[int, InstalledJob]: ...

    def counters(self) -> Counters: ...


def metrics_sample(
    agg: AggregatorHandle, switch: str | None = None, data_plane: str = "software"
) -> DataPlaneSample:
    """One snapshot of an aggregator's counters, as switchagg.metrics exports them: this
    process's or one reached through its control service (then two blocking calls). ``switch``
    names it (default its host:port); ``data_plane`` is what the job service calls its jobs'."""
    from switchagg.metrics import DataPlaneSample, JobSample

    # Counters first: a job added meanwhile is in jobs only, one removed in the counters only,
    # and only the jobs in both are shown.
    c, jobs = agg.counters(), agg.jobs()
    if switch is None:
        host, port = agg.address
        switch = f"{host}:{port}"
    return DataPlaneSample(
        switch=switch,
        data_plane=data_plane,
        drops=c["drops"],
        jobs=[
            JobSample(job_id, counters, jobs[job_id].slot_count, jobs[job_id].n, jobs[job_id].name)
            for job_id, counters in sorted(c["jobs"].items())
            if job_id in jobs
        ],
        pool_slots=POOL_SLOTS,
        packets_received=c["rx"],
        packets_sent=c["tx"],
        faults=c.get("faults", {}),
    )


_JOIN_TIMEOUT_S = 10.0  # run() notices stop() within ~50 ms; this only guards against a hang


class SoftwareAggregator:
    """A UDP aggregator serving in a background thread; the GIL is released while it serves."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        drop_in: float = 0.0,
        dup_in: float = 0.0,
        drop_out: float = 0.0,
        dup_out: float = 0.0,
        seed: int = 1,
    ) -> None:
        self._agg = _core.Aggregator(
            host=host,
            port=port,
            drop_in=drop_in,
            dup_in=dup_in,
            drop_out=drop_out,
            dup_out=dup_out,
            seed=seed,
        )
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._jobs: dict[int, InstalledJob] = {}  # what add_job installed, for the metrics' labels

    @property
    def address(self) -> tuple[str, int]:
        return (str(self._agg.host), int(self._agg.port))

    @property
    def port(self) -> int:
        return int(self._agg.port)

    def add_job(
        self,
        job_id: int,
        n: int,
        slot_base: int,
        slot_count: int,
        k: int,
        generation: int,
        addrs: Sequence[tuple[str, int] | None],
        *,
        name: str = "",
        upstream: tuple[str, int] | None = None,
        leaf_index: int = 0,
        key: int = 0,
    ) -> None:
        """Install a job: rank r's packets must come from ``addrs[r]``, and its results go there.
        ``name`` only labels the job's metrics. ``key``: the job's 32-bit result key, written into
        every RESULT (its workers drop results without it; docs/PROTOCOL.md, Security).

        With ``upstream`` (the spine's address) the job is aggregated here as leaf ``leaf_index`` of
        a two-level job (docs/PROTOCOL.md, Two levels): ``n`` is the job's total, ``addrs[r]`` is
        None for the ranks behind other leaves, and partial sums go to the spine, whose RESULTs
        are accepted from that address only. A spine is a plain job whose ranks are the leaves."""
        self._agg.add_job(
            job_id,
            n,
            slot_base,
            slot_count,
            k,
            generation,
            list(addrs),
            upstream=upstream,
            leaf_index=leaf_index,
            key=key,
        )
        self._jobs = {**self._jobs, job_id: InstalledJob(n, slot_base, slot_count, k, name, key)}

    def remove_job(self, job_id: int) -> None:
        self._agg.remove_job(job_id)
        self._jobs = {j: info for j, info in self._jobs.items() if j != job_id}

    def jobs(self) -> dict[int, InstalledJob]:
        """The installed jobs by id."""
        return dict(self._jobs)

    def counters(self) -> Counters:
        result: Counters = self._agg.counters()
        return result

    def metrics_sample(self) -> DataPlaneSample:
        """One snapshot of the counters, as switchagg.metrics exports them."""
        return metrics_sample(self)

    def serve_metrics(self, port: int = 0, host: str = "127.0.0.1") -> tuple[str, int]:
        """Serves this aggregator's metrics (and its process's) on http://host:port/metrics from a
        daemon thread (0: a free port); returns the bound address."""
        try:
            from prometheus_client import CollectorRegistry, ProcessCollector
        except ImportError as e:
            raise ImportError(f"{e}: metrics need pip install 'switchagg[metrics]'") from e

        from switchagg import metrics

        registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # CPU and memory: is the aggregator the bottleneck?
        registry.register(
            metrics.SnapshotCollector(lambda: metrics.data_plane_families([self.metrics_sample()]))
        )
        return metrics.serve(registry, port, host)

    def start(self) -> SoftwareAggregator:
        if self._thread is not None:
            raise RuntimeError("the aggregator is already started")
        self._thread = threading.Thread(
            target=self._serve, name=f"switchagg-aggregator:{self.port}", daemon=True
        )
        self._thread.start()
        return self

    def _serve(self) -> None:
        try:
            self._agg.run()
        except BaseException as exc:  # reported by stop(); a daemon thread has nobody else to tell
            self._error = exc

    def stop(self) -> None:
        """Stop serving and close the socket; raises if the serving thread failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._agg.stop()  # a stop() that lands before run() started is kept until run() sees it
            thread.join(_JOIN_TIMEOUT_S)
            if thread.is_alive():
                raise RuntimeError("the aggregator's serving thread did not stop")
        self._agg.close()
        if self._error is not None:
            raise RuntimeError(f"the aggregator's serving thread failed: {self._error!r}") from self._error

    def __enter__(self) -> SoftwareAggregator:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def format_counters(c: Counters) -> str:
    """A readable table of an aggregator's counters."""
    lines = [f"rx {c['rx']}  tx {c['tx']}"]
    drops = "  ".join(f"{name} {c['drops'][name]}" for name in DROP_REASONS)
    lines.append(f"drops: {drops}")
    faults = "  ".join(f"{name} {value}" for name, value in c["faults"].items())
    lines.append(f"faults: {faults}")
    any_leaf = any(LEAF_COUNTERS[0] in row for row in c["jobs"].values())
    names = JOB_COUNTERS + (LEAF_COUNTERS if any_leaf else ())
    header = f"{'job':>6} " + " ".join(f"{name:>16}" for name in names)
    lines.append(header)
    for job_id in sorted(c["jobs"]):
        row = c["jobs"][job_id]
        lines.append(f"{job_id:>6} " + " ".join(f"{row.get(name, '-'):>16}" for name in names))
    return "\n".join(lines)


JobSpec = tuple[int, int, int, int, int, int, list[tuple[str, int] | None], int]
JOB_SYNTAX = "ID:N:BASE:COUNT:K[:GEN[:KEY]]@IP:PORT,IP:PORT,..."
MAX_KEY = 0xFFFFFFFF


def new_key() -> int:
    """A fresh result key for a job: random (``secrets``), 32 bits, non-zero (0 means unkeyed)."""
    while True:
        key = secrets.randbits(32)
        if key:
            return key


LEAF_SYNTAX = "JOB:INDEX@IP:PORT"


def parse_job(spec: str) -> JobSpec:
    """ID:N:BASE:COUNT:K[:GEN[:KEY]]@ADDR,... -> (job_id, n, slot_base, slot_count, k, generation,
    addrs, key); an ADDR ``-`` (None) is a rank behind another leaf. GEN defaults to 1, KEY (the
    result key, decimal or 0x hex, 32 bits) to 0: unkeyed."""
    numbers, at, addr_list = spec.partition("@")
    if not at or not addr_list:
        raise argparse.ArgumentTypeError(
            f"--job {spec!r} names no rank addresses: append @IP:PORT,... with one address per rank "
            f"({JOB_SYNTAX}); packets are accepted only from the addresses the job names"
        )
    parts = numbers.split(":")
    if len(parts) not in (5, 6, 7):
        raise argparse.ArgumentTypeError(f"--job {spec!r}: expected {JOB_SYNTAX}")
    try:
        nums = [int(p) for p in parts[:6]] + [int(p, 0) for p in parts[6:]]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--job {spec!r}: every field must be an integer") from None
    if len(nums) == 5:
        nums.append(1)
    if len(nums) == 6:
        nums.append(0)
    if not 0 <= nums[6] <= MAX_KEY:
        raise argparse.ArgumentTypeError(f"--job {spec!r}: KEY {parts[6]} is not a 32-bit unsigned number")
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
    return (nums[0], nums[1], nums[2], nums[3], nums[4], nums[5], addrs, nums[6])


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
        "--job",
        action="append",
        type=parse_job,
        default=[],
        metavar=JOB_SYNTAX,
        help=f"install a job (repeatable), e.g. 7:2:0:{DEFAULT_SW_SLOTS}:{DEFAULT_SW_K}@127.0.0.1:5000,"
        "127.0.0.1:5001; GEN defaults to 1; KEY is the job's result key (decimal or 0x hex, 32 bits), "
        "written into every RESULT: workers given it (Session(key=...)) drop results without it; "
        "it defaults to 0, unkeyed; rank r's packets are accepted only from the r-th address",
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
    p.add_argument(
        "--drop-in", type=_probability, default=0.0, help="drop received datagrams with this probability"
    )
    p.add_argument("--dup-in", type=_probability, default=0.0, help="process received datagrams twice")
    p.add_argument("--drop-out", type=_probability, default=0.0, help="drop sent datagrams")
    p.add_argument("--dup-out", type=_probability, default=0.0, help="send datagrams twice")
    p.add_argument("--seed", type=int, default=1, help="fault injection seed")
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


def _job_name(text: str) -> tuple[int, str]:
    job, sep, name = text.partition("=")
    if not sep or not job.isdigit() or not name:
        raise argparse.ArgumentTypeError(f"--job-name {text!r}: expected ID=NAME")
    return int(job), name


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
        )
        names = dict(args.job_name)
        unknown = sorted(set(names) - {job[0] for job in args.job})
        if unknown:
            raise ValueError(f"--job-name names job {unknown[0]}, which no --job installs")
        leaves = {job: (index, spine) for job, index, spine in args.leaf}
        unknown = sorted(set(leaves) - {job[0] for job in args.job})
        if unknown:
            raise ValueError(f"--leaf names jobs that no --job installs: {unknown}")
        for job in args.job:
            index, spine = leaves.get(job[0], (0, None))
            if spine is None and None in job[6]:
                raise ValueError(
                    f"job {job[0]} has ranks '-' (behind other leaves) but no --leaf {job[0]}:..."
                )
            agg.add_job(*job[:7], name=names.get(job[0], ""), upstream=spine, leaf_index=index, key=job[7])
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
    jobs = (
        ", ".join(f"{j[0]} (n={j[1]}, slots {j[2]}..{j[2] + j[3] - 1}, K={j[4]})" for j in args.job) or "none"
    )
    print(f"switchagg-aggregator listening on {host}:{port}; jobs: {jobs}", flush=True)
    if args.metrics_port is not None:
        print(f"metrics on http://{metrics_host}:{metrics_port}/metrics", flush=True)
    if args.control is not None:
        where = args.control if control_port == 0 else f"{args.control.rpartition(':')[0]}:{control_port}"
        print(f"control on {where}; boot id {boot_id}", flush=True)
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
