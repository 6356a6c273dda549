"""Prometheus metrics: the one module that names them and builds them from counter snapshots.

The counters live where the packets are (the C aggregator and worker, the P4 switch's counter
arrays), so a metric is built at scrape time from one snapshot of them (a custom collector)
instead of being counted twice. The data plane's families (`data_plane_families`) take plain
samples, so the software aggregator and the controller (P4 counters read over P4Runtime) export
the same names and labels; `serve` starts the HTTP endpoint. Names follow Prometheus
conventions: `switchagg_` prefix, `_total` for counters, base units (`_seconds`, `_bytes`).
docs/OBSERVABILITY.md lists them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from switchagg.protocol import DROP_REASONS, JOB_COUNTERS, LEAF_COUNTERS, WIRE_BITS

DEFAULT_HOST = "127.0.0.1"  # a scraper on another host needs 0.0.0.0 (or the host's address)

SWITCH_LABELS = ("switch", "data_plane")
# `switchagg_job`, not `job`: Prometheus sets `job` on every scraped series (the scrape job), and
# a target's own `job` label would become `exported_job` unless the scrape sets honor_labels.
JOB_LABELS = (*SWITCH_LABELS, "switchagg_job", "job_id")
WORKER_LABELS = ("switchagg_job", "job_id", "rank", "data_plane")

# docs/PROTOCOL.md, Counters: what each per-job counter counts.
_JOB_HELP = {
    "aggregated": "Contributions added to a slot",
    "multicast": "Results multicast to every rank of the job",
    "resent": "Results unicast again to a rank that retransmitted to a complete slot",
    "retrans_ignored": "Retransmissions to a slot still waiting for other ranks (dropped)",
}
# docs/PROTOCOL.md, Two levels: a leaf's own counters (only leaf jobs have them).
_LEAF_HELP = {
    "upstream": "Partial sums a leaf sent up to the spine",
    "upstream_resent": "Partial sums a leaf sent up again for a worker's retransmission",
    "stale_results": "Results from the spine that answered no partial the leaf waits for (dropped)",
}


# --- the data plane (aggregator, switch) --------------------------------------------------------


@dataclass(frozen=True)
class JobSample:
    """One job's counters on one data plane (``counters`` keyed by protocol.JOB_COUNTERS, and for a
    leaf of two levels also by protocol.LEAF_COUNTERS)."""

    job_id: int
    counters: Mapping[str, int]
    slots: int
    workers: int
    name: str = ""
    # Bytes per counter, where the data plane counts them (a P4 switch's packets_and_bytes counters).
    bytes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class DataPlaneSample:
    """One data plane's counters: ``switch`` names it (an aggregator's host:port, a switch's name)."""

    switch: str
    data_plane: str  # "software" or "p4", as the job service reports it
    drops: Mapping[str, int]  # keyed by protocol.DROP_REASONS
    jobs: Sequence[JobSample] = ()
    pool_slots: int | None = None  # the slot pool's size, when known: slots free = this - allocated
    packets_received: int | None = None
    packets_sent: int | None = None
    bytes_received: int | None = None  # UDP payload bytes
    bytes_sent: int | None = None
    faults: Mapping[str, int] = field(default_factory=dict)  # the software fault injector's counts
    # A software aggregator's loss notices sent (docs/PROTOCOL.md): "resend" to a rank a round lacks,
    # "hold" to a rank it has
    loss_notices: Mapping[str, int] = field(default_factory=dict)
    # A software aggregator's serving threads, each {"rx", "aggregated", "misrouted", ...}: the
    # totals above are their sums; these show how the slots' load splits over them.
    threads: Sequence[Mapping[str, int]] = ()


def data_plane_families(samples: Iterable[DataPlaneSample]) -> list[Metric]:
    """Every data plane metric for these data planes, one family per name."""
    c = _Families()
    for s in samples:
        _plane_totals(c, s)
        _thread_counters(c, s)
        _job_series(c, s)
    return c.families()


def _plane_totals(c: _Families, s: DataPlaneSample) -> None:
    where = (s.switch, s.data_plane)
    for reason in DROP_REASONS:
        c.counter(
            "switchagg_drops",
            "Packets dropped without changing any sum, by reason (docs/PROTOCOL.md)",
            (*SWITCH_LABELS, "reason"),
            (*where, reason),
            s.drops.get(reason, 0),
        )
    totals = (
        ("switchagg_packets_received", "Datagrams received", s.packets_received),
        ("switchagg_packets_sent", "Datagrams sent", s.packets_sent),
        ("switchagg_received_bytes", "UDP payload bytes received", s.bytes_received),
        ("switchagg_sent_bytes", "UDP payload bytes sent", s.bytes_sent),
    )
    for name, doc, value in totals:
        if value is not None:
            c.counter(name, doc, SWITCH_LABELS, where, value)
    for kind, count in s.faults.items():
        c.counter(
            "switchagg_faults_injected",
            "Datagrams the fault injector dropped or duplicated (tests)",
            (*SWITCH_LABELS, "fault"),
            (*where, kind),
            count,
        )
    for kind, count in s.loss_notices.items():
        c.counter(
            "switchagg_loss_notices",
            "Loss notices sent: to a rank a round lacks (resend), to a rank it has (hold) (docs/PROTOCOL.md)",
            (*SWITCH_LABELS, "kind"),
            (*where, kind),
            count,
        )
    allocated = sum(j.slots for j in s.jobs)
    c.gauge("switchagg_jobs", "Jobs installed", SWITCH_LABELS, where, len(s.jobs))
    c.gauge("switchagg_slots_allocated", "Slots of the pool held by jobs", SWITCH_LABELS, where, allocated)
    if s.pool_slots is not None:
        c.gauge(
            "switchagg_slots_free",
            "Slots of the pool no job holds",
            SWITCH_LABELS,
            where,
            s.pool_slots - allocated,
        )


_THREAD_COUNTERS = (  # (metric, help, key in a thread's counters)
    (
        "switchagg_thread_packets_received",
        "Datagrams one serving thread of a software aggregator received (slot mod threads)",
        "rx",
    ),
    (
        "switchagg_thread_contributions",
        "Contributions one serving thread aggregated, over all jobs",
        "aggregated",
    ),
    (
        "switchagg_thread_misrouted",
        "Datagrams for another thread's slot, dropped (only while the socket group is built)",
        "misrouted",
    ),
)


def _thread_counters(c: _Families, s: DataPlaneSample) -> None:
    labels = (*SWITCH_LABELS, "thread")
    for i, t in enumerate(s.threads):
        for name, doc, key in _THREAD_COUNTERS:
            c.counter(name, doc, labels, (s.switch, s.data_plane, str(i)), t[key])


def _job_series(c: _Families, s: DataPlaneSample) -> None:
    for j in s.jobs:
        labels = (s.switch, s.data_plane, j.name, str(j.job_id))
        for name in JOB_COUNTERS:
            c.counter(f"switchagg_job_{name}", _JOB_HELP[name], JOB_LABELS, labels, j.counters.get(name, 0))
        for name in LEAF_COUNTERS:
            if name in j.counters:
                c.counter(f"switchagg_job_{name}", _LEAF_HELP[name], JOB_LABELS, labels, j.counters[name])
        for name, nbytes in j.bytes.items():
            doc = f"Bytes of the packets in switchagg_job_{name}_total (frames, as the switch counts)"
            c.counter(f"switchagg_job_{name}_bytes", doc, JOB_LABELS, labels, nbytes)
        c.gauge("switchagg_job_slots", "Slots the job holds (its window)", JOB_LABELS, labels, j.slots)
        c.gauge("switchagg_job_workers", "Ranks of the job", JOB_LABELS, labels, j.workers)


class _Families:
    """Collects samples into one family per metric name, in first-seen order."""

    def __init__(self) -> None:
        self._by_name: dict[str, Metric] = {}

    def counter(
        self, name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: float
    ) -> None:
        family = self._by_name.get(name)
        if family is None:
            family = self._by_name[name] = CounterMetricFamily(name, doc, labels=list(labels))
        assert isinstance(family, CounterMetricFamily)
        family.add_metric(list(values), value)

    def gauge(self, name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: float) -> None:
        family = self._by_name.get(name)
        if family is None:
            family = self._by_name[name] = GaugeMetricFamily(name, doc, labels=list(labels))
        assert isinstance(family, GaugeMetricFamily)
        family.add_metric(list(values), value)

    def families(self) -> list[Metric]:
        return list(self._by_name.values())


class SnapshotCollector(Collector):
    """A collector that builds its families at each scrape by calling ``snapshot``."""

    def __init__(self, snapshot: Callable[[], Iterable[Metric]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from self._snapshot()

    def describe(self) -> list[Metric]:
        return []  # registering must not take a snapshot; names are not checked for duplicates


def serve(registry: CollectorRegistry, port: int, host: str = DEFAULT_HOST) -> tuple[str, int]:
    """Serves ``registry`` over HTTP (GET /metrics) from a daemon thread; returns the bound address."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound_host, bound_port = server.server_address[:2]
    return str(bound_host), int(bound_port)


# --- the workers (host library) -----------------------------------------------------------------


class _Session(Protocol):
    job: int
    rank: int
    job_name: str
    data_plane: str

    def stats(self) -> dict[str, int]: ...


ALLREDUCE_SECONDS = Histogram(
    "switchagg_worker_allreduce_seconds",
    "Time of one allreduce, call to return",
    WORKER_LABELS,
    registry=None,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60),
)
ALLREDUCE_BYTES = Counter(
    "switchagg_worker_allreduce_bytes",
    "Bytes of the tensors reduced (once per allreduce)",
    WORKER_LABELS,
    registry=None,
)
SESSION_TIMEOUTS = Counter(
    "switchagg_worker_session_timeouts",
    "Allreduces that failed because no slot made progress for the session's timeout",
    WORKER_LABELS,
    registry=None,
)


def worker_labels(s: _Session) -> tuple[str, str, str, str]:
    return (s.job_name, str(s.job), str(s.rank), s.data_plane)


def _resend_counters(c: _Families, st: Mapping[str, int], labels: tuple[str, ...]) -> None:
    """A worker's resends by what caused them, and the loss notices that held one back."""
    kinds = (
        ("timeout", st.get("timeouts", 0)),
        ("fast", st.get("fast_retransmits", 0)),
        ("probe", st.get("tail_probes", 0)),
        ("asked", st.get("status_resends", 0)),
    )
    for kind, value in kinds:
        c.counter(
            "switchagg_worker_retransmits",
            "Packets resent: after a retransmission timeout, by fast retransmit, as a tail loss probe, "
            "or asked for by the aggregator's loss notice (docs/PROTOCOL.md)",
            (*WORKER_LABELS, "kind"),
            (*labels, kind),
            value,
        )
    c.counter(
        "switchagg_worker_loss_notice_holds",
        "Loss notices saying the round has this rank's packet and waits for a peer's: no resend",
        WORKER_LABELS,
        labels,
        st.get("status_holds", 0),
    )


def worker_families(sessions: Iterable[_Session]) -> list[Metric]:
    """The C packet path's counters of these sessions."""
    c = _Families()
    for s in sessions:
        st, labels = s.stats(), worker_labels(s)
        _resend_counters(c, st, labels)
        c.counter(
            "switchagg_worker_spurious_retransmits",
            "Fast retransmits found unneeded: their round was answered twice (the packet was late, not lost)",
            WORKER_LABELS,
            labels,
            st.get("spurious_retransmits", 0),
        )
        c.counter(
            "switchagg_worker_packets_sent",
            "DATA packets sent, resends included",
            WORKER_LABELS,
            labels,
            st.get("sent", 0),
        )
        c.counter(
            "switchagg_worker_sent_bytes",
            "UDP payload bytes sent, resends included",
            WORKER_LABELS,
            labels,
            st.get("bytes_sent", 0),
        )
        for bits in WIRE_BITS:
            c.counter(
                "switchagg_worker_lane_bytes",
                "Datagram bytes of completed allreduces (first sends, not resends), per lane width in bits",
                (*WORKER_LABELS, "bits"),
                (*labels, str(bits)),
                st.get(f"bytes_lanes{bits}", 0),
            )
        c.counter(
            "switchagg_worker_results", "RESULT packets accepted", WORKER_LABELS, labels, st.get("results", 0)
        )
        c.counter(
            "switchagg_worker_stale_results",
            "RESULT packets dropped as stale or duplicate",
            WORKER_LABELS,
            labels,
            st.get("stale", 0),
        )
        c.counter(
            "switchagg_worker_allreduces",
            "Allreduces completed",
            WORKER_LABELS,
            labels,
            st.get("allreduces", 0),
        )
        calls = getattr(s, "torch_calls", None)  # switchagg.torch's CallLog, on a torch group's session
        for (op, path), value in (calls.series() if calls is not None else {}).items():
            c.counter(
                "switchagg_torch_calls",
                "torch.distributed calls of the group, per op, run in the network or delegated to gloo",
                (*WORKER_LABELS, "op", "path"),
                (*labels, op, path),
                value,
            )
    return c.families()


class WorkerMetrics:
    """The process's open sessions, as one collector plus the histograms the Python side observes."""

    def __init__(self) -> None:
        self._sessions: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._registered: set[int] = set()  # ids of registries this is registered in
        self._servers: dict[tuple[str, int], tuple[str, int]] = {}
        self._collector = SnapshotCollector(self._snapshot)

    def _snapshot(self) -> list[Metric]:
        with self._lock:
            sessions = list(self._sessions)
        return worker_families(sessions)

    def register(self, registry: CollectorRegistry = REGISTRY) -> None:
        with self._lock:
            if id(registry) in self._registered:
                return
            self._registered.add(id(registry))
        for collector in (self._collector, ALLREDUCE_SECONDS, ALLREDUCE_BYTES, SESSION_TIMEOUTS):
            registry.register(collector)

    def serve(
        self, port: int, host: str = DEFAULT_HOST, registry: CollectorRegistry = REGISTRY
    ) -> tuple[str, int]:
        """Serves the worker metrics on host:port, once per address in this process (0: a free port)."""
        self.register(registry)
        with self._lock:
            if port and (host, port) in self._servers:
                return self._servers[(host, port)]
            address = serve(registry, port, host)
            self._servers[(host, port)] = address
            return address

    def attach(self, session: _Session) -> None:
        with self._lock:
            self._sessions.add(session)

    def observe(self, session: _Session, seconds: float, nbytes: int) -> None:
        labels = worker_labels(session)
        ALLREDUCE_SECONDS.labels(*labels).observe(seconds)
        ALLREDUCE_BYTES.labels(*labels).inc(nbytes)

    def timed_out(self, session: _Session) -> None:
        SESSION_TIMEOUTS.labels(*worker_labels(session)).inc()

    def detach(self, session: _Session) -> None:
        """A closed session's series disappear (its counters died with its socket)."""
        with self._lock:
            self._sessions.discard(session)
        labels = worker_labels(session)
        for metric in (ALLREDUCE_SECONDS, ALLREDUCE_BYTES, SESSION_TIMEOUTS):
            try:
                metric.remove(*labels)
            except KeyError:  # never observed
                pass


WORKERS = WorkerMetrics()
