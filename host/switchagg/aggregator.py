"""The software aggregator as a library: `_core.Aggregator` served in a daemon thread
(SoftwareAggregator), what a controller sees of any aggregator (AggregatorHandle), its counters
for the metrics, and result keys. Its console script, switchagg-aggregator, is aggregator_cli.

Every job names each rank's (IP, UDP port): a rank's contributions are accepted only from its
address and its results go only there (docs/PROTOCOL.md, Security). With ``threads`` > 1 the
port is served by that many threads, each owning the slots whose class (slot mod 8) is congruent to its index
(docs/PROTOCOL.md, The software aggregator).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from switchagg import _core
from switchagg.keys import UNKEYED, new_key, warn_unkeyed
from switchagg.protocol import DROP_REASONS, JOB_COUNTERS, LEAF_COUNTERS, POOL_SLOT_MASK

if TYPE_CHECKING:
    from switchagg.metrics import DataPlaneSample

Counters = dict[str, Any]
POOL_SLOTS = POOL_SLOT_MASK + 1  # the software aggregator's pool: every index the header can name
MAX_KEY = 0xFFFFFFFF
MAX_THREADS = 256  # the engine's SA_MAX_THREADS


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask): the daemon's default thread count."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class InstalledJob:
    n: int
    slot_base: int
    slot_count: int
    k: int
    name: str
    key: int = UNKEYED  # the job's result key


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
        key: int | None = None,
        loss_notices: bool = True,
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
        bytes_received=c.get("rx_bytes"),
        bytes_sent=c.get("tx_bytes"),
        faults=c.get("faults", {}),
        loss_notices={"resend": c.get("status_resend", 0), "hold": c.get("status_hold", 0)},
        threads=c.get("threads", []),
    )


_JOIN_TIMEOUT_S = 10.0  # run() notices stop() within ~50 ms; this only guards against a hang


class SoftwareAggregator:
    """A UDP aggregator serving in a background thread (and ``threads - 1`` more of the engine's,
    each on its own socket of the same port, owning the slots whose class, slot mod 8, is congruent to
    its index); the GIL is
    released while it serves."""

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
        threads: int = 1,
    ) -> None:
        self._agg = _core.Aggregator(
            host=host,
            port=port,
            drop_in=drop_in,
            dup_in=dup_in,
            drop_out=drop_out,
            dup_out=dup_out,
            seed=seed,
            threads=threads,
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

    @property
    def threads(self) -> int:
        """Serving threads, one socket each on the same port."""
        return int(self._agg.threads)

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
        key: int | None = None,
        loss_notices: bool = True,
    ) -> int:
        """Install a job: rank r's packets must come from ``addrs[r]``, and its results go there.
        ``name`` only labels the job's metrics. ``key``: the job's 32-bit result key, written into
        every RESULT (its workers drop results without it; docs/PROTOCOL.md, Security); None: a
        fresh random one; UNKEYED (0): none, with a warning. Returns the key, for the workers
        (``Session(key=...)``).

        With ``upstream`` (the spine's address) the job is aggregated here as leaf ``leaf_index`` of
        a two-level job (docs/PROTOCOL.md, Two levels): ``n`` is the job's total, ``addrs[r]`` is
        None for the ranks behind other leaves, and partial sums go to the spine, whose RESULTs
        are accepted from that address only. A spine is a plain job whose ranks are the leaves.

        ``loss_notices=False``: no loss notices (docs/PROTOCOL.md) to this job's ranks, for a spine
        whose ranks are P4 leaves (they take none: a STATUS would count as a bad_type drop there)."""
        if key is None:
            key = new_key()
        elif key == UNKEYED:
            warn_unkeyed(f"job {job_id}")
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
            loss_notices=loss_notices,
        )
        self._jobs = {**self._jobs, job_id: InstalledJob(n, slot_base, slot_count, k, name, key)}
        return key

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
    """A readable table of an aggregator's counters (summed over its threads, then each thread's
    line when there are several)."""
    lines = [f"rx {c['rx']}  tx {c['tx']}"]
    drops = "  ".join(f"{name} {c['drops'][name]}" for name in DROP_REASONS)
    lines.append(f"drops: {drops}")
    faults = "  ".join(f"{name} {value}" for name, value in c["faults"].items())
    lines.append(f"faults: {faults}")
    lines.append(f"loss notices: resend {c.get('status_resend', 0)}  hold {c.get('status_hold', 0)}")
    threads = c.get("threads", [])
    if len(threads) > 1:
        for i, t in enumerate(threads):
            lines.append(
                f"thread {i}: rx {t['rx']}  tx {t['tx']}  aggregated {t['aggregated']}  "
                f"dropped {t['dropped']}  misrouted {t['misrouted']}"
            )
    any_leaf = any(LEAF_COUNTERS[0] in row for row in c["jobs"].values())
    names = JOB_COUNTERS + (LEAF_COUNTERS if any_leaf else ())
    header = f"{'job':>6} " + " ".join(f"{name:>16}" for name in names)
    lines.append(header)
    for job_id in sorted(c["jobs"]):
        row = c["jobs"][job_id]
        lines.append(f"{job_id:>6} " + " ".join(f"{row.get(name, '-'):>16}" for name in names))
    return "\n".join(lines)
