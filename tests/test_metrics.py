"""Prometheus metrics scraped over HTTP while real jobs run: `switchagg-aggregator --metrics-port`
(a separate process, with loss injected) and the workers' side of the host library (a Session
argument and $SWITCHAGG_METRICS_PORT). Each scrape is validated by `promtool check metrics` where
the Debian `prometheus` package is installed, and always by the client library's own parser."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("prometheus_client", reason="the metrics need prometheus-client (pip install .[metrics])")

from switchagg import Session, SwitchaggTimeout, _core, protocol  # noqa: E402
from switchagg.aggregator import SoftwareAggregator  # noqa: E402
from switchagg_lab.testing.checks import hello_rounds  # noqa: E402
from switchagg_lab.testing.kit import (  # noqa: E402
    allreduce_all,
    free_port,
    on_every_rank,
)
from switchagg_lab.testing.prom import Samples, scrape, value  # noqa: E402

WAIT_S = 30.0


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """The process's stdout lines, read by a thread (select() cannot see what TextIO buffered)."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


@pytest.fixture
def aggregator_cli(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Starts `switchagg-aggregator` for a job of the given workers; yields (port, metrics address)."""
    procs: list[subprocess.Popen[str]] = []

    def start(workers: list[_core.Worker], *extra: str) -> tuple[int, tuple[str, int]]:
        addrs = ",".join("{}:{}".format(*w.address) for w in workers)
        cmd = [sys.executable, "-m", "switchagg.aggregator_cli", "--port", "0", "--metrics-port", "0"]
        cmd += ["--job", f"5:{len(workers)}:100:8:{K}:1:{KEY}@{addrs}", "--job-name", "5=resnet", *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        lines = _lines(proc)
        first, second = lines.get(timeout=WAIT_S), lines.get(timeout=WAIT_S)
        assert "listening on 127.0.0.1:" in first, first
        port = int(first.split("127.0.0.1:")[1].split(";")[0])
        url = second.split("http://")[1].split("/")[0]
        host, _, metrics_port = url.rpartition(":")
        return port, (host, int(metrics_port))

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err


K, N, SIZE = 1024, 2, 200_000  # 196 chunks per allreduce
KEY = 0x5A5A0001  # the jobs' result key
CHUNKS = -(-SIZE // K)


def _eventually(check: Callable[[], Samples | None], what: str) -> Samples:
    """Calls ``check`` (which scrapes) until it returns samples: a retransmission still in flight
    when the allreduces returned reaches the aggregator a moment later. Bounded; the failure says what."""
    deadline = time.monotonic() + WAIT_S
    while True:
        samples = check()
        if samples is not None:
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.05)


JOB_LABELS = {"switchagg_job": "resnet", "job_id": "5", "data_plane": "software"}


def _check_installed_job(samples: Samples) -> None:
    job = JOB_LABELS
    assert value(samples, "switchagg_job_aggregated_total", **job) == 0
    assert value(samples, "switchagg_job_slots", **job) == 8
    assert value(samples, "switchagg_job_workers", **job) == N
    assert value(samples, "switchagg_slots_allocated", data_plane="software") == 8
    assert value(samples, "switchagg_slots_free", data_plane="software") == protocol.POOL_SLOT_MASK + 1 - 8
    assert value(samples, "switchagg_jobs") == 1
    assert value(samples, "process_cpu_seconds_total") > 0


def _lossy_rounds(
    sessions: list[Session], agg_metrics: tuple[str, int], worker_address: tuple[str, int]
) -> Samples:
    """Two exact int32 allreduces through the lossy aggregator; after each, every counter on both
    sides says what the round did. Returns the last scrape of both."""
    job = JOB_LABELS
    rng = np.random.default_rng(5)
    inputs = [rng.integers(-1000, 1000, SIZE, dtype=np.int32) for _ in range(N)]
    expected = np.sum(inputs, axis=0, dtype=np.int32)
    now: Samples = {}
    for round_ in (1, 2):
        tensors = [x.copy() for x in inputs]
        allreduce_all(sessions, tensors, WAIT_S * 2)
        assert all(np.array_equal(t, expected) for t in tensors)

        def settled() -> Samples | None:
            # Every DATA packet a worker sent was either dropped by the injector, or counted
            # by the aggregator exactly once as aggregated, resent or retrans_ignored.
            agg, wk = scrape(agg_metrics), scrape(worker_address)
            sent = value(wk, "switchagg_worker_packets_sent_total", job_id="5")
            accounted = sum(
                value(agg, f"switchagg_job_{c}_total", **job)
                for c in protocol.JOB_COUNTERS
                if c != "multicast"
            ) + value(agg, "switchagg_faults_injected_total", fault="dropped_in")
            return {**agg, **wk} if sent == accounted else None

        now = _eventually(settled, "the aggregator accounts for every packet the workers sent")
        # int32: every chunk is one contribution per rank and one multicast, lost or not; so is each
        # round of the sessions' hello (docs/PROTOCOL.md, Sessions), the same ones on every rank.
        hello = hello_rounds([s.stats() for s in sessions])
        assert value(now, "switchagg_job_aggregated_total", **job) == (round_ * CHUNKS + hello) * N
        assert value(now, "switchagg_job_multicast_total", **job) == round_ * CHUNKS + hello
        assert value(now, "switchagg_worker_allreduces_total", job_id="5") == round_ * N
        assert value(now, "switchagg_worker_allreduce_seconds_count", job_id="5") == round_ * N
        assert value(now, "switchagg_worker_allreduce_bytes_total", job_id="5") == round_ * N * SIZE * 4
        assert value(now, "switchagg_worker_results_total", job_id="5") == (round_ * CHUNKS + hello) * N
        assert value(now, "switchagg_packets_received_total") == value(
            now, "switchagg_worker_packets_sent_total", job_id="5"
        )
        # Bytes too: what the workers sent (resends included) is what the aggregator received,
        # and every RESULT it sent is a datagram of a header and K values or fewer.
        assert value(now, "switchagg_received_bytes_total") == value(
            now, "switchagg_worker_sent_bytes_total", job_id="5"
        )
        sent = value(now, "switchagg_sent_bytes_total")
        assert 0 < sent <= value(now, "switchagg_packets_sent_total") * protocol.packet_len(K)
    return now


def _counted_once(agg_metrics: tuple[str, int], port: int, reason: str, packet: bytes) -> Samples:
    """Sends ``packet`` until the aggregator's drop counter for ``reason`` counted it: the injector
    drops 5% of what arrives (and counts those itself), so one send may not reach the parser."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
        for _ in range(20):
            injected = value(scrape(agg_metrics), "switchagg_faults_injected_total", fault="dropped_in")
            stranger.sendto(packet, ("127.0.0.1", port))

            def counted(injected: float = injected) -> Samples | None:
                s = scrape(agg_metrics)
                dropped = value(s, "switchagg_faults_injected_total", fault="dropped_in")
                return s if value(s, "switchagg_drops_total", reason=reason) or dropped > injected else None

            drops = _eventually(counted, f"the {reason} packet is counted")
            if value(drops, "switchagg_drops_total", reason=reason):
                return drops
    raise AssertionError(f"20 {reason} packets sent, none counted")


def test_aggregator_and_worker_metrics_move_as_a_lossy_job_runs(aggregator_cli: Any) -> None:
    workers = [_core.Worker("127.0.0.1", 0) for _ in range(N)]
    port, agg_metrics = aggregator_cli(workers, "--drop-in", "0.05", "--seed", "3")
    sessions = [
        Session(
            5, r, N, ("127.0.0.1", port), 100, 8, K, timeout=20, rto=0.02, metrics_port=0, key=KEY, _worker=w
        )
        for r, w in enumerate(workers)
    ]
    try:
        _check_installed_job(scrape(agg_metrics))
        worker_address = sessions[0].metrics_address
        assert worker_address is not None
        now = _lossy_rounds(sessions, agg_metrics, worker_address)
        # 5% of ~800 DATA packets were dropped: some were resent (by timer or fast retransmit),
        # and each resend was answered with the stored result, ignored, or aggregated.
        dropped = value(now, "switchagg_faults_injected_total", fault="dropped_in")
        resends = value(now, "switchagg_worker_retransmits_total", job_id="5")
        assert dropped > 0 and resends >= dropped
        assert value(now, "switchagg_worker_allreduce_seconds_sum", job_id="5") > 0

        # A malformed and a spoofed packet are dropped by reason, and change no sum.
        good = protocol.Header(job=5, rank=0, slot=100, values=[1] * K)
        bad_version = protocol.Header(**{**good.__dict__, "version": 9}).pack()
        for reason, packet in (("bad_version", bad_version), ("spoofed", good.pack())):
            drops = _counted_once(agg_metrics, port, reason, packet)
            assert value(drops, "switchagg_drops_total", reason=reason) == 1
        hello = hello_rounds([s.stats() for s in sessions])
        assert value(drops, "switchagg_job_aggregated_total", **JOB_LABELS) == (2 * CHUNKS + hello) * N
    finally:
        for s in sessions:
            s.close()
    gone = scrape(worker_address)
    assert not [k for k in gone if dict(k[1]).get("job_id") == "5"], "a closed session's series remain"


def test_worker_metrics_count_bytes_per_lane_width() -> None:
    """switchagg_worker_lane_bytes_total{bits}: each completed call's datagrams (first sends) under its
    lane width, what Session.stats() counts: a float32 call in 32-, 16- and 8-bit lanes, an int32 one."""
    size, k = 50_000, 361
    with SoftwareAggregator("127.0.0.1", 0) as agg:
        workers = [_core.Worker("127.0.0.1", 0) for _ in range(2)]
        key = agg.add_job(11, 2, 0, 8, k, 1, [w.address for w in workers])
        sessions = [
            Session(11, r, 2, agg.address, 0, 8, k, timeout=20, metrics_port=0, key=key, _worker=w)
            for r, w in enumerate(workers)
        ]

        def call(bits: int, dtype: type = np.float32) -> None:
            out = on_every_rank(sessions, lambda r, s: s.allreduce(np.ones(size, dtype), bits=bits))
            assert out == [None, None]

        try:
            for bits in protocol.WIRE_BITS:
                call(bits)
            call(32, np.int32)
            address = sessions[0].metrics_address
            assert address is not None
            samples = scrape(address)
            for bits in protocol.WIRE_BITS:
                calls = 2 if bits == 32 else 1
                packets = calls * -(-size // protocol.lanes_per_packet(k, bits))
                for rank, s in enumerate(sessions):
                    labels = {"job_id": "11", "rank": str(rank), "bits": str(bits)}
                    counted = value(samples, "switchagg_worker_lane_bytes_total", **labels)
                    assert counted == s.stats()[f"bytes_lanes{bits}"] == packets * protocol.packet_len(k)
        finally:
            for s in sessions:
                s.close()


def test_a_timed_out_allreduce_is_counted() -> None:
    with SoftwareAggregator("127.0.0.1", 0) as agg:
        worker = _core.Worker("127.0.0.1", 0)
        key = agg.add_job(6, 2, 0, 2, 64, 1, [worker.address, ("127.0.0.1", 9)])  # rank 1 never comes
        with Session(
            6, 0, 2, agg.address, 0, 2, 64, timeout=0.3, metrics_port=0, key=key, _worker=worker
        ) as s:
            assert s.metrics_address is not None
            with pytest.raises(SwitchaggTimeout):
                s.allreduce(np.zeros(100, np.int32))
            after = scrape(s.metrics_address)
    assert value(after, "switchagg_worker_session_timeouts_total", job_id="6", rank="0") == 1
    assert value(after, "switchagg_worker_retransmits_total", job_id="6", kind="timeout") > 0
    assert value(after, "switchagg_worker_allreduces_total", job_id="6") == 0
    assert not [k for k in after if k[0].startswith("switchagg_worker_allreduce_seconds")]  # none finished


def test_the_environment_turns_worker_metrics_on(monkeypatch: pytest.MonkeyPatch) -> None:
    base = free_port() - 1
    monkeypatch.setenv("SWITCHAGG_METRICS_PORT", str(base))
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's second rank on this host: base + 1
    with Session(7, 1, 2, ("127.0.0.1", 9), key=KEY) as s:
        assert s.metrics_address == ("127.0.0.1", base + 1)
        assert (
            value(scrape(s.metrics_address), "switchagg_worker_packets_sent_total", job_id="7", rank="1") == 0
        )
        # A second process's port clash or a typo never stops a job: a warning, no metrics.
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            monkeypatch.setenv("SWITCHAGG_METRICS_PORT", str(taken.getsockname()[1]))
            monkeypatch.setenv("LOCAL_RANK", "0")
            with (
                pytest.warns(RuntimeWarning, match="no metrics"),
                Session(8, 0, 2, ("127.0.0.1", 9), key=KEY) as t,
            ):
                assert t.metrics_address is None
        monkeypatch.setenv("SWITCHAGG_METRICS_PORT", "http")
        with (
            pytest.warns(RuntimeWarning, match="is not a port"),
            Session(9, 0, 2, ("127.0.0.1", 9), key=KEY) as u,
        ):
            assert u.metrics_address is None
    monkeypatch.delenv("SWITCHAGG_METRICS_PORT")
    with Session(10, 0, 2, ("127.0.0.1", 9), key=KEY) as v:
        assert v.metrics_address is None


def test_cli_refuses_a_name_for_a_job_it_does_not_install() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "switchagg.aggregator_cli", "--port", "0", "--job-name", "3=resnet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "names job 3, which no --job installs" in out.stderr, out.stderr
