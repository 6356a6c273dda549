"""The software aggregator with several serving threads (switchagg-aggregator --threads N): one
socket per thread on the same port (SO_REUSEPORT), a classic BPF program that steers each datagram
to thread slot % N by the header's pool field, each thread alone on its slots. Real sockets, a real
daemon process for the end-to-end sums; the workers are unchanged."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from switchagg import Session, _core, protocol
from switchagg.aggregator import SoftwareAggregator, new_key
from switchagg.protocol import MSG_RESULT, Header
from switchagg_lab.testing.checks import float_bound, hello_rounds, hello_slots
from switchagg_lab.testing.kit import (
    allreduce_all,  # noqa: E402
    wait_until,
)
from switchagg_lab.testing.prom import scrape, value

WAIT_S = 30.0  # only guards against hangs


def _packet(job: int, rank: int, slot: int, k: int, values: int = 0, **fields: int) -> bytes:
    return Header(job=job, rank=rank, slot=slot, values=[values] * k, **fields).pack()


def _settle(agg: SoftwareAggregator, rx: int) -> dict:
    wait_until(lambda: agg.counters()["rx"] >= rx, WAIT_S, f"{rx} datagrams received", interval=0.005)
    return agg.counters()


@pytest.fixture
def sock() -> Iterator[socket.socket]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        s.settimeout(WAIT_S)
        yield s


def test_the_steering_program_reads_the_slot_from_the_udp_payload() -> None:
    """On this kernel the reuseport program sees the datagram from the UDP payload on (the switchagg
    header): slot s lands on thread s % 4 exactly, whatever the sender's port; a datagram too
    short for the pool field lands on thread 0. Were it reading the UDP header, or hashing, the
    split below would differ."""
    with SoftwareAggregator(threads=4) as agg:
        sent = {0: 0, 1: 0, 2: 0, 3: 0}
        senders = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
        try:
            for slot, times in [(4, 1), (1, 2), (6, 3), (3, 4), (32767, 5), (8, 1)]:
                for i in range(times):  # from several source ports: the 4-tuple does not matter
                    senders[i % 3].sendto(_packet(77, 0, slot, 4), agg.address)
                    sent[slot % 4] += 1
            for short in (b"", b"\x02", b"\x02\x01\x00\x80\x00\x4d\x00\x00\x00"):  # < 10 bytes
                senders[0].sendto(short, agg.address)
                sent[0] += 1
        finally:
            for s in senders:
                s.close()
        c = _settle(agg, sum(sent.values()))
        assert [t["rx"] for t in c["threads"]] == [sent[i] for i in range(4)]
        assert c["drops"]["unknown_job"] == 16 and c["drops"]["truncated"] == 3
        assert [t["dropped"] for t in c["threads"]] == [sent[i] for i in range(4)]
        assert all(t["misrouted"] == 0 for t in c["threads"])


def test_each_thread_answers_its_slots_from_the_one_port(sock: socket.socket) -> None:
    """A one-rank job on slots 10..17 over 3 threads: every result comes from the aggregator's
    address (the worker's connect() would drop anything else), and each thread served its slots."""
    with SoftwareAggregator(threads=3) as agg:
        agg.add_job(2, 1, 10, 8, 16, 1, [sock.getsockname()])
        for slot in range(10, 18):
            sock.sendto(_packet(2, 0, slot, 16, values=slot), agg.address)
        for _ in range(8):
            payload, source = sock.recvfrom(65536)
            h = Header.unpack(payload)
            assert source == agg.address and h.type == MSG_RESULT and h.values == [h.slot] * 16
        c = agg.counters()
    # a thread owns whole steering classes: (slot mod STEER_CLASSES) mod threads
    per_thread = [sum(1 for s in range(10, 18) if s % protocol.STEER_CLASSES % 3 == t) for t in range(3)]
    assert [t["aggregated"] for t in c["threads"]] == per_thread
    assert [t["tx"] for t in c["threads"]] == per_thread
    assert c["jobs"][2]["aggregated"] == c["jobs"][2]["multicast"] == c["tx"] == 8


def test_malformed_packets_are_counted_by_reason_on_every_thread(sock: socket.socket) -> None:
    """Every drop reason, on slots of every thread: the summed counters say why, exactly, and no
    slot state changes (the job's next round still sums only its ranks)."""
    k = 8
    with SoftwareAggregator(threads=4) as agg, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        other.bind(("127.0.0.1", 0))
        agg.add_job(5, 2, 0, 8, k, 1, [sock.getsockname(), other.getsockname()])
        bad: list[tuple[str, bytes]] = []
        for slot in range(8):
            bad += [
                ("bad_version", _packet(5, 0, slot, k, version=1)),
                ("bad_type", _packet(5, 0, slot, k, type=7)),
                ("unknown_job", _packet(6, 0, slot, k)),
                ("bad_rank", _packet(5, 2, slot, k)),
                ("bad_pool", _packet(5, 0, slot + 8, k)),
                ("truncated", _packet(5, 0, slot, k)[:-4]),
                ("truncated", _packet(5, 0, slot, k - 1)),
            ]
        bad += [("truncated", b"\x02\x01")] * 3
        for _, p in bad:  # from rank 0's own address: past the pinning check
            sock.sendto(p, agg.address)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
            for slot in range(8):
                stranger.sendto(_packet(5, 1, slot, k, values=1000), agg.address)  # rank 1, elsewhere
        c = _settle(agg, len(bad) + 8)
        want = {reason: 0 for reason in protocol.DROP_REASONS}
        for reason, _ in bad:
            want[reason] += 1
        want["spoofed"] = 8
        assert c["drops"] == want
        assert sum(t["dropped"] for t in c["threads"]) == len(bad) + 8
        assert all(t["dropped"] > 0 for t in c["threads"])
        assert c["jobs"][5]["aggregated"] == 0
        for slot in range(8):  # the slots are untouched: the ranks' round sums their values only
            sock.sendto(_packet(5, 0, slot, k, values=slot), agg.address)
            other.sendto(_packet(5, 1, slot, k, values=1), agg.address)
        for s in (sock, other):
            got = sorted(Header.unpack(s.recv(65536)).values[0] for _ in range(8))
            assert got == [slot + 1 for slot in range(8)]


# ---- end to end: the daemon with --threads, workers unchanged ----

N, K, SLOTS, BASE = 4, 1024, 16, 40
INT_SIZE, FLOAT_SIZE = 100_000, 70_001  # 98 and 69 chunks over 16 slots


def _chunks(size: int) -> int:
    return -(-size // K)


def _contributions_per_thread(threads: int, hello: int) -> list[int]:
    """Each rank contributes once per round; a round lives on slot BASE + chunk % SLOTS, served by
    thread slot % threads. The float32 call adds a PRIME round on each slot it uses, and the
    session's hello its rounds (docs/PROTOCOL.md, Sessions)."""
    per = [0] * threads
    for offset in hello_slots(hello, SLOTS):
        per[(BASE + offset) % threads] += N
    for chunks, prime in ((_chunks(INT_SIZE), False), (_chunks(FLOAT_SIZE), True)):
        rounds = list(range(chunks)) + (list(range(min(chunks, SLOTS))) if prime else [])
        for j in rounds:
            per[(BASE + j % SLOTS) % threads] += N
    return per


def _start_daemon(threads: int, workers: list[_core.Worker], key: int, tmp: Path) -> subprocess.Popen[str]:
    addrs = ",".join("{}:{}".format(*w.address) for w in workers)
    cmd = [sys.executable, "-m", "switchagg.aggregator_cli", "--port", "0", "--threads", str(threads)]
    cmd += ["--job", f"3:{N}:{BASE}:{SLOTS}:{K}:1:{key}@{addrs}", "--metrics-port", "0"]
    cmd += ["--counters-json", str(tmp / "counters.json")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.parametrize("threads", [2, 4])
def test_sums_are_exact_and_every_thread_serves_its_slots(threads: int, tmp_path: Path) -> None:
    """switchagg-aggregator --threads N, 4 unchanged workers, a 16-slot job: int32 exact, float32
    within the bound; each thread counted exactly the contributions of its slots, the counters and
    the Prometheus metrics are the threads' sums."""
    workers = [_core.Worker("127.0.0.1", 0) for _ in range(N)]
    key = new_key()
    proc = _start_daemon(threads, workers, key, tmp_path)
    try:
        assert proc.stdout is not None
        first, second = proc.stdout.readline(), proc.stdout.readline()
        assert f"; {threads} threads; jobs: 3 (n={N}" in first, first
        port = int(first.split("127.0.0.1:")[1].split(";")[0])
        metrics_host, _, metrics_port = second.split("http://")[1].split("/")[0].rpartition(":")
        sessions = [
            Session(3, r, N, ("127.0.0.1", port), BASE, SLOTS, K, timeout=20, key=key, _worker=w)
            for r, w in enumerate(workers)
        ]
        rng = np.random.default_rng(11)
        ints = [rng.integers(-(2**30), 2**30, INT_SIZE, dtype=np.int32) for _ in range(N)]
        floats = [(rng.standard_normal(FLOAT_SIZE) * (r + 1)).astype(np.float32) for r in range(N)]
        got_i, got_f = [x.copy() for x in ints], [x.copy() for x in floats]
        allreduce_all(sessions, got_i, WAIT_S * 2)
        allreduce_all(sessions, got_f, WAIT_S * 2)
        want_i = np.sum([x.astype(np.int64) for x in ints], axis=0).astype(np.int32)  # wraps as int32
        exact = np.sum([x.astype(np.float64) for x in floats], axis=0)
        bound = float_bound(floats, K)
        for r in range(N):
            assert np.array_equal(got_i[r], want_i), f"rank {r}: int32 sum differs"
            assert not (np.abs(got_f[r] - exact) > bound).any(), f"rank {r}: float32 off the bound"
            assert np.array_equal(got_f[r], got_f[0])
        samples = scrape((metrics_host, int(metrics_port)))
        for s in sessions:
            s.close()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    c = json.loads((tmp_path / "counters.json").read_text())
    per_thread = [t["aggregated"] for t in c["threads"]]
    # A contribution is aggregated once, whatever was resent; so these counts are exact.
    hello = hello_rounds([w.stats() for w in workers])  # every rank saw the same rounds
    assert per_thread == _contributions_per_thread(threads, hello) and all(per_thread)
    job = c["jobs"]["3"]
    assert job["aggregated"] == sum(per_thread)
    assert c["rx"] == sum(t["rx"] for t in c["threads"]) and all(t["rx"] for t in c["threads"])
    assert c["tx"] == sum(t["tx"] for t in c["threads"]) and all(t["tx"] for t in c["threads"])
    assert sum(c["drops"].values()) == 0 and not any(t["misrouted"] for t in c["threads"])
    # The scrape came after the last allreduce returned: no contribution was added since.
    assert value(samples, "switchagg_job_aggregated_total", job_id="3") == job["aggregated"]
    assert value(samples, "switchagg_packets_received_total") <= c["rx"]
    for t in range(threads):  # each thread's own series; the totals above are their sums
        assert value(samples, "switchagg_thread_contributions_total", thread=str(t)) == per_thread[t]
        assert (
            0
            < value(samples, "switchagg_thread_packets_received_total", thread=str(t))
            <= c["threads"][t]["rx"]
        )
        assert value(samples, "switchagg_thread_misrouted_total", thread=str(t)) == 0
    thread_lines = [line for line in out.splitlines() if line.startswith("thread ")]
    assert len(thread_lines) == threads  # the final table: one line per thread
