"""The software aggregator (switchagg._core.Aggregator, SoftwareAggregator, the CLI) over real UDP.
Every test of the packet path runs with one serving thread and with three (slots spread over them;
tests/test_aggregator_threads.py checks the split itself)."""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from switchagg import _core
from switchagg.aggregator import SoftwareAggregator, format_counters
from switchagg.aggregator_cli import parse_job, parse_leaf
from switchagg.keys import UNKEYED
from switchagg.protocol import (
    DROP_REASONS,
    EXP_NONE,
    JOB_COUNTERS,
    LEAF_COUNTERS,
    MAX_K,
    MSG_RESULT,
    Header,
)
from switchagg_lab.testing.kit import wait_rx, wait_until

WAIT_S = 10.0  # generous; only guards against hangs


def fake_addrs(n: int) -> list[tuple[str, int]]:
    """Distinct rank addresses for jobs that see no traffic."""
    return [("127.0.0.1", 40000 + r) for r in range(n)]


@pytest.fixture(params=[1, 3], ids=lambda n: f"threads={n}")
def threads(request: pytest.FixtureRequest) -> int:
    n: int = request.param
    return n


@pytest.fixture
def agg(threads: int) -> Iterator[SoftwareAggregator]:
    with SoftwareAggregator(threads=threads) as a:
        yield a


def data(
    job: int, rank: int, slot: int, values: list[int] | np.ndarray, shadow: int = 0, exp: int = EXP_NONE
) -> bytes:
    return Header(
        job=job, rank=rank, slot=slot, shadow=shadow, exp=exp, values=[int(v) for v in values]
    ).pack()


def nothing_waiting(s: socket.socket) -> bool:
    return not select.select([s], [], [], 0.05)[0]


# ---- validation ----


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1, 0, 0, 4, 8, 1), "n \\(workers\\) must be in 1..32"),
        ((1, 33, 0, 4, 8, 1), "n \\(workers\\) must be in 1..32"),
        ((1, 2, 0, 4, 0, 1), "k must be in 1..16369"),
        ((1, 2, 0, 4, MAX_K + 1, 1), "k must be in 1..16369"),
        ((1, 2, 0, 0, 8, 1), "slot range"),
        ((1, 2, -1, 4, 8, 1), "slot range"),
        ((1, 2, 32767, 2, 8, 1), "slot range"),
        ((1, 2, 0, 4, 8, 0), "generation must be in 1..65535"),
        ((1, 2, 0, 4, 8, 65536), "generation must be in 1..65535"),
        ((65536, 2, 0, 4, 8, 1), "job_id must be in 0..65535"),
    ],
)
def test_add_job_rejects_bad_parameters(
    agg: SoftwareAggregator, args: tuple[int, int, int, int, int, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        agg.add_job(*args, fake_addrs(2))
    assert agg.counters()["jobs"] == {}


def test_add_job_rejects_bad_addrs(agg: SoftwareAggregator) -> None:
    with pytest.raises(ValueError, match="one \\(ip, port\\) per rank: 2 expected, got 1"):
        agg.add_job(1, 2, 0, 4, 8, 1, [("127.0.0.1", 5000)])
    with pytest.raises(ValueError, match="not an IPv4 address"):
        agg.add_job(1, 2, 0, 4, 8, 1, [("127.0.0.1", 5000), ("localhost", 5001)])
    with pytest.raises(ValueError, match="must be an \\(ip: str, port: int\\) tuple"):
        agg.add_job(1, 1, 0, 4, 8, 1, ["127.0.0.1:5000"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="addrs\\[0\\] and addrs\\[1\\] are the same address"):
        agg.add_job(1, 2, 0, 4, 8, 1, [("127.0.0.1", 5000), ("127.0.0.1", 5000)])
    with pytest.raises(ValueError, match="0.0.0.0 is no source address"):
        agg.add_job(1, 1, 0, 4, 8, 1, [("0.0.0.0", 5000)])
    with pytest.raises(TypeError):  # there is no mode without addresses
        agg._agg.add_job(1, 1, 0, 4, 8, 1)
    assert agg.counters()["jobs"] == {}


def test_job_ids_and_slot_ranges_are_exclusive(agg: SoftwareAggregator) -> None:
    two = fake_addrs(2)
    agg.add_job(1, 2, 100, 10, 8, 1, two)
    with pytest.raises(ValueError, match="job id 1 is already installed"):
        agg.add_job(1, 2, 0, 4, 8, 1, two)
    with pytest.raises(ValueError, match="overlap slots \\[100, 110\\) of job 1"):
        agg.add_job(2, 2, 109, 4, 8, 1, two)
    with pytest.raises(ValueError, match="overlap"):
        agg.add_job(2, 2, 90, 11, 8, 1, two)
    agg.add_job(2, 2, 110, 4, 8, 1, two)  # adjacent is fine
    agg.add_job(3, 2, 90, 10, 8, 1, two)
    agg.remove_job(1)
    with pytest.raises(ValueError, match="job 1 is not installed"):
        agg.remove_job(1)
    agg.add_job(4, 2, 100, 10, 8, 1, two)  # the range is free again
    assert sorted(agg.counters()["jobs"]) == [2, 3, 4]


def test_constructor_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="drop_in must be a probability"):
        _core.Aggregator(drop_in=1.5)
    with pytest.raises(ValueError, match="dup_out must be a probability"):
        _core.Aggregator(dup_out=-0.1)
    with pytest.raises(ValueError, match="host must be an IPv4 address"):
        _core.Aggregator(host="::1")
    with pytest.raises(ValueError, match="port must be in 0..65535"):
        _core.Aggregator(port=70000)
    with pytest.raises(ValueError, match="threads must be in 1..256"):
        _core.Aggregator(threads=0)
    taken = _core.Aggregator()
    with pytest.raises(OSError, match="cannot bind") as e:
        _core.Aggregator(port=taken.port)
    assert e.value.errno == errno.EADDRINUSE  # the engine's SA_ERR_BIND, with its errno
    # A port served by several threads is one SO_REUSEPORT group that no other socket group joins.
    group = _core.Aggregator(threads=3)
    for threads in (1, 3):
        with pytest.raises(OSError, match="cannot bind") as e:
            _core.Aggregator(port=group.port, threads=threads)
        assert e.value.errno == errno.EADDRINUSE


# ---- the packet path ----


def test_large_k_wraparound(agg: SoftwareAggregator, socks: list[socket.socket]) -> None:
    """K=8192 int32 wrap-around; each rank's result goes to its pinned address."""
    k, n = 8192, 4
    agg.add_job(5, n, 0, 2, k, 1, [s.getsockname() for s in socks])
    rng = np.random.default_rng(7)
    contributions = rng.integers(-(2**31), 2**31, size=(n, k), dtype=np.int64).astype(np.int32)
    for r in range(n):
        socks[r].sendto(data(5, r, 1, contributions[r], shadow=1, exp=r - 2), agg.address)
    want = contributions.sum(axis=0, dtype=np.int32)  # numpy int32 sums wrap like the protocol's
    for r in range(n):
        h = Header.unpack(socks[r].recv(65536))
        assert (h.type, h.rank, h.slot, h.shadow, h.exp, h.elems) == (MSG_RESULT, r, 1, 1, 1, k)
        assert np.array_equal(np.array(h.values, dtype=np.int32), want)
    c = agg.counters()
    assert c["jobs"][5] == {"aggregated": 4, "multicast": 1, "resent": 0, "retrans_ignored": 0}
    assert c["rx"] == 4 and c["tx"] == 4

    assert all(nothing_waiting(s) for s in socks)


def test_a_foreign_socket_cannot_contribute_or_receive(
    agg: SoftwareAggregator, socks: list[socket.socket]
) -> None:
    """socks[2] claims rank 0 and rank 1 before, between and after their real packets: the sum is
    the two pinned ranks' alone, counted drops say why, and the foreign socket hears nothing."""
    ranks, intruder = socks[:2], socks[2]
    agg.add_job(4, 2, 0, 1, 4, 1, [s.getsockname() for s in ranks])
    for r in (0, 1):
        intruder.sendto(data(4, r, 0, [1000] * 4), agg.address)
    ranks[0].sendto(data(4, 0, 0, [1] * 4), agg.address)
    intruder.sendto(data(4, 1, 0, [2000] * 4), agg.address)  # would complete the slot if accepted
    ranks[1].sendto(data(4, 1, 0, [2] * 4), agg.address)
    for s in ranks:
        assert Header.unpack(s.recv(65536)).values == [3] * 4
    intruder.sendto(data(4, 1, 0, [0] * 4), agg.address)  # a "retransmission" asking for the result
    c = wait_rx(agg, 6)
    assert c["drops"]["spoofed"] == 4 and c["tx"] == 2
    assert c["jobs"][4] == {"aggregated": 2, "multicast": 1, "resent": 0, "retrans_ignored": 0}
    assert nothing_waiting(intruder)


def test_two_jobs_are_isolated(agg: SoftwareAggregator, socks: list[socket.socket]) -> None:
    a, b = socks[0:2], socks[2:4]
    agg.add_job(1, 2, 0, 4, 16, 1, [s.getsockname() for s in a])
    agg.add_job(2, 2, 4, 4, 16, 9, [s.getsockname() for s in b])
    a[0].sendto(data(1, 0, 3, [1] * 16), agg.address)
    b[0].sendto(data(2, 0, 4, [100] * 16), agg.address)
    b[1].sendto(data(2, 1, 4, [200] * 16), agg.address)
    for s in b:
        assert Header.unpack(s.recv(65536)).values == [300] * 16
    a[1].sendto(data(2, 1, 4, [5] * 16), agg.address)  # job 1's endpoint claiming job 2's rank 1
    a[1].sendto(data(1, 1, 4, [5] * 16), agg.address)  # job 2's slot for job 1
    a[1].sendto(data(1, 1, 3, [2] * 16), agg.address)
    for s in a:
        h = Header.unpack(s.recv(65536))
        assert (h.job, h.slot, h.values) == (1, 3, [3] * 16)
    c = wait_rx(agg, 6)
    assert c["drops"]["spoofed"] == 1 and c["drops"]["bad_pool"] == 1
    assert c["jobs"][1]["multicast"] == 1 and c["jobs"][2]["multicast"] == 1
    assert all(nothing_waiting(s) for s in socks)


def test_counters_layout(agg: SoftwareAggregator) -> None:
    agg.add_job(3, 1, 0, 1, 8, 1, fake_addrs(1))
    c = agg.counters()
    assert set(c) == {
        "rx", "tx", "rx_bytes", "tx_bytes", "gso_sends", "gro_receives",
        "status_resend", "status_hold", "drops", "faults", "jobs", "threads",
    }  # fmt: skip
    assert len(c["threads"]) == agg.threads
    assert all(set(t) == {"rx", "tx", "dropped", "aggregated", "misrouted"} for t in c["threads"])
    assert list(c["drops"]) == list(DROP_REASONS)
    assert set(c["faults"]) == {"dropped_in", "duplicated_in", "dropped_out", "duplicated_out"}
    assert list(c["jobs"][3]) == list(JOB_COUNTERS)
    table = format_counters(c)
    assert "truncated" in table and "retrans_ignored" in table


def test_readding_a_job_resets_its_slots(agg: SoftwareAggregator, socks: list[socket.socket]) -> None:
    addrs = [s.getsockname() for s in socks[:2]]
    agg.add_job(6, 2, 0, 1, 4, 1, addrs)
    socks[0].sendto(data(6, 0, 0, [50] * 4), agg.address)
    wait_rx(agg, 1)
    agg.remove_job(6)
    agg.add_job(6, 2, 0, 1, 4, 2, addrs)
    socks[0].sendto(data(6, 0, 0, [1] * 4), agg.address)
    socks[1].sendto(data(6, 1, 0, [2] * 4), agg.address)
    for s in socks[:2]:
        assert Header.unpack(s.recv(65536)).values == [3] * 4
    assert agg.counters()["jobs"][6]["aggregated"] == 2


# ---- fault injection ----


def _inject(seed: int, socks: list[socket.socket], threads: int) -> tuple[dict, int]:
    """1000 rounds of a 1-worker job, 25 % drops and duplicates each way; -> (counters, received)."""
    rounds, batch = 1000, 50
    received = 0
    faults = SoftwareAggregator(
        drop_in=0.25, dup_in=0.25, drop_out=0.25, dup_out=0.25, seed=seed, threads=threads
    )
    with faults as a:
        a.add_job(1, 1, 0, 1, 4, 1, [socks[0].getsockname()])
        for start in range(0, rounds, batch):
            for i in range(start, start + batch):  # alternate sets: each packet starts a new round
                socks[0].sendto(data(1, 0, 0, [i] * 4, shadow=i % 2), a.address)
            c = wait_rx(a, start + batch)
            while received < c["tx"]:  # results were sent before rx counted their trigger
                socks[0].recv(65536)
                received += 1
        assert nothing_waiting(socks[0])
        return a.counters(), received


def test_fault_injection_is_honoured_and_seeded(socks: list[socket.socket], threads: int) -> None:
    c, received = _inject(1, socks, threads)
    f, j = c["faults"], c["jobs"][1]
    assert c["rx"] == 1000
    assert 150 <= f["dropped_in"] <= 350  # binomial(1000, 0.25): mean 250, sd 14
    processed = 1000 - f["dropped_in"] + f["duplicated_in"]
    assert 0.15 * (1000 - f["dropped_in"]) <= f["duplicated_in"] <= 0.35 * (1000 - f["dropped_in"])
    # Each processed datagram either completes its round or is a duplicate answered with the result.
    assert j["aggregated"] + j["resent"] + j["retrans_ignored"] == processed
    assert j["retrans_ignored"] == 0
    results = j["multicast"] + j["resent"]
    assert 0.15 * results <= f["dropped_out"] <= 0.35 * results
    assert c["tx"] == results - f["dropped_out"] + f["duplicated_out"] == received
    again, _ = _inject(1, socks, threads)
    assert again["faults"] == f and again["jobs"] == c["jobs"]
    other, _ = _inject(2, socks, threads)
    assert other["faults"] != f


def test_results_stay_intact_when_a_batch_fills_the_output_buffers(
    socks: list[socket.socket], threads: int
) -> None:
    """dup_in=1: each datagram completes a round and then asks again, two results each; waves of 48
    datagrams make batches of up to 96 results, more than the 64 output buffers of one flush."""
    k, waves, wave = 16, 4, 48
    with SoftwareAggregator(dup_in=1.0, threads=threads) as a:
        a.add_job(1, 1, 0, 1, k, 1, [socks[0].getsockname()])
        for w in range(waves):
            for i in range(w * wave, (w + 1) * wave):
                socks[0].sendto(data(1, 0, 0, [i] * k, shadow=i % 2), a.address)
            wait_rx(a, (w + 1) * wave)
            for i in range(w * wave, (w + 1) * wave):
                for _ in range(2):
                    h = Header.unpack(socks[0].recv(65536))
                    assert (h.shadow, h.values) == (i % 2, [i] * k)
        c = a.counters()
    assert c["jobs"][1] == {"aggregated": 192, "multicast": 192, "resent": 192, "retrans_ignored": 0}
    assert c["tx"] == 384


# ---- run / stop ----


def test_stop_ends_run_and_run_timeout_returns(threads: int) -> None:
    a = _core.Aggregator(threads=threads)
    t = threading.Thread(target=a.run)
    t.start()
    wait_until(lambda: a.running, WAIT_S, "the aggregator to serve", 0.001)
    with pytest.raises(RuntimeError, match="already serving"):
        a.run(timeout=0.1)
    a.stop()
    t.join(WAIT_S)
    assert not t.is_alive() and not a.running
    a.run(timeout=0.05)  # returns by itself
    with pytest.raises(ValueError, match="timeout must be None or >= 0"):
        a.run(timeout=-1)
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.counters()


def test_jobs_can_change_while_serving(agg: SoftwareAggregator, socks: list[socket.socket]) -> None:
    for job in range(20):
        agg.add_job(job, 1, job, 1, 4, 1, [socks[0].getsockname()])
        socks[0].sendto(data(job, 0, job, [job] * 4), agg.address)
        assert Header.unpack(socks[0].recv(65536)).values == [job] * 4
        if job % 2:
            agg.remove_job(job)
    assert sorted(agg.counters()["jobs"]) == list(range(0, 20, 2))


# ---- the CLI ----


def test_parse_job() -> None:
    two = [("127.0.0.1", 5000), ("10.0.0.2", 6000)]
    # No KEY: None, main draws a random one and prints it.
    assert parse_job("7:2:0:32:8192@127.0.0.1:5000,10.0.0.2:6000") == (7, 2, 0, 32, 8192, 1, two, None)
    assert parse_job("7:2:0:32:64:5@127.0.0.1:5000,10.0.0.2:6000") == (7, 2, 0, 32, 64, 5, two, None)
    # The result key: decimal or hex, 32 bits, non-zero; "unkeyed" by name only.
    assert parse_job("7:2:0:32:64:5:0xdeadbeef@127.0.0.1:5000,10.0.0.2:6000")[-1] == 0xDEADBEEF
    assert parse_job("7:2:0:32:64:5:4294967295@127.0.0.1:5000,10.0.0.2:6000")[-1] == 2**32 - 1
    assert parse_job("7:2:0:32:64:5:unkeyed@127.0.0.1:5000,10.0.0.2:6000")[-1] == UNKEYED
    for bad in ("4294967296", "0", "0x0"):
        with pytest.raises(Exception, match="not a non-zero 32-bit unsigned number.*'unkeyed'"):
            parse_job(f"7:2:0:32:64:5:{bad}@127.0.0.1:5000,10.0.0.2:6000")
    with pytest.raises(Exception, match="is not a number"):
        parse_job("7:2:0:32:64:5:none@127.0.0.1:5000,10.0.0.2:6000")
    with pytest.raises(Exception, match="ID:N:BASE:COUNT:K"):
        parse_job("7:2:0:32:64:5:1:2@127.0.0.1:5000,10.0.0.2:6000")
    with pytest.raises(Exception, match="names no rank addresses"):
        parse_job("7:2:0:32:8192")
    with pytest.raises(Exception, match="2 ranks but 1 addresses"):
        parse_job("7:2:0:32:8192@127.0.0.1:5000")
    with pytest.raises(Exception, match="is not IP:PORT"):
        parse_job("7:1:0:32:8192@127.0.0.1")
    with pytest.raises(Exception, match="ID:N:BASE:COUNT:K"):
        parse_job("7:2:0@127.0.0.1:1,127.0.0.1:2")
    with pytest.raises(Exception, match="integer"):
        parse_job("7:2:x:32:64@127.0.0.1:1,127.0.0.1:2")


def test_parse_leaf_and_ranks_behind_other_leaves() -> None:
    assert parse_job("7:3:0:4:64@127.0.0.1:5000,-,10.0.0.2:6000") == (
        7, 3, 0, 4, 64, 1, [("127.0.0.1", 5000), None, ("10.0.0.2", 6000)], None,
    )  # fmt: skip
    assert parse_leaf("7:2@10.0.0.9:48879") == (7, 2, ("10.0.0.9", 48879))
    for bad in ("7@10.0.0.9:1", "7:x@10.0.0.9:1", "7:1", "7:1@10.0.0.9"):
        with pytest.raises(Exception, match="--leaf"):
            parse_leaf(bad)


def test_add_job_leaf_parameters(agg: SoftwareAggregator) -> None:
    spine = ("127.0.0.1", 41000)
    with pytest.raises(ValueError, match=r"addrs\[1\] must be an \(ip: str, port: int\) tuple"):
        agg.add_job(1, 2, 0, 4, 8, 1, [("127.0.0.1", 40000), None])  # None needs an upstream
    with pytest.raises(ValueError, match="no upstream"):
        agg.add_job(1, 1, 0, 4, 8, 1, fake_addrs(1), leaf_index=1)
    with pytest.raises(ValueError, match="at least one local rank"):
        agg.add_job(1, 2, 0, 4, 8, 1, [None, None], upstream=spine)
    with pytest.raises(ValueError, match="leaf_index"):
        agg.add_job(1, 2, 0, 4, 8, 1, [None, ("127.0.0.1", 40000)], upstream=spine, leaf_index=32)
    with pytest.raises(ValueError, match="upstream = .* 0.0.0.0"):
        agg.add_job(1, 2, 0, 4, 8, 1, [None, ("127.0.0.1", 40000)], upstream=("0.0.0.0", 1))
    agg.add_job(1, 3, 0, 4, 8, 1, [None, ("127.0.0.1", 40000), None], upstream=spine, leaf_index=2)
    agg.add_job(2, 2, 4, 4, 8, 1, fake_addrs(2))
    jobs = agg.counters()["jobs"]
    assert list(jobs[1]) == list(JOB_COUNTERS + LEAF_COUNTERS)
    assert list(jobs[2]) == list(JOB_COUNTERS)


def test_a_hierarchy_of_two_leaves_and_a_spine_sums_exactly(socks: list[socket.socket], threads: int) -> None:
    """Two leaves of two workers each and a spine, over UDP: each leaf sends one partial up, the
    spine's RESULT reaches all four workers with their job ranks, and ends in no more packets."""
    k = 16
    spine, leaf0, leaf1 = (SoftwareAggregator(threads=threads) for _ in range(3))
    with spine, leaf0, leaf1:
        addrs = [s.getsockname() for s in socks]
        key = spine.add_job(5, 2, 8, 2, k, 1, [leaf0.address, leaf1.address])  # one key on every node
        up = spine.address
        leaf0.add_job(5, 4, 8, 2, k, 1, [addrs[0], addrs[1], None, None], upstream=up, key=key)
        leaf1.add_job(5, 4, 8, 2, k, 1, [None, None, addrs[2], addrs[3]], upstream=up, leaf_index=1, key=key)
        leaves = [leaf0, leaf0, leaf1, leaf1]
        for r, s in enumerate(socks):
            s.sendto(data(5, r, 9, [2**30 + r * e for e in range(k)], exp=r - 2), leaves[r].address)
        for r, s in enumerate(socks):
            h = Header.unpack(s.recv(65536))
            assert (h.type, h.rank, h.slot, h.exp) == (MSG_RESULT, r, 9, 1)
            assert h.values == [6 * e for e in range(k)]  # 4 * 2**30 wraps to 0
        assert spine.counters()["jobs"][5]["multicast"] == 1
        for leaf in (leaf0, leaf1):
            assert leaf.counters()["jobs"][5] == {
                "aggregated": 2, "multicast": 1, "resent": 0, "retrans_ignored": 0,
                "upstream": 1, "upstream_resent": 0, "stale_results": 0,
            }  # fmt: skip
        # Prometheus carries the leaf's own counters for leaf jobs only (the spine's job is plain).
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        from switchagg.metrics import data_plane_families

        def exported(agg: SoftwareAggregator) -> dict[str, float]:
            registry = CollectorRegistry()
            registry.register(_Fixed(data_plane_families([agg.metrics_sample()])))
            text = generate_latest(registry).decode()
            return {
                s.name: s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.labels.get("job_id") == "5"
            }

        assert exported(leaf1)["switchagg_job_upstream_total"] == 1
        assert exported(leaf1)["switchagg_job_stale_results_total"] == 0
        assert "switchagg_job_upstream_total" not in exported(spine)
        assert exported(spine)["switchagg_job_multicast_total"] == 1
        ready, _, _ = select.select(socks, [], [], 0.2)
        assert not ready


def test_cli_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "switchagg.aggregator_cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    assert "--job" in out.stdout and "--drop-in" in out.stdout and "--stats-interval" in out.stdout


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("1:2:0:4:8", "names no rank addresses"),
        ("1:1:0:4:8@localhost:5000", "not an IPv4 address"),
        ("1:1:0:4:99999@127.0.0.1:5000", "k must be in 1..16369"),
    ],
)
def test_cli_rejects_a_bad_job(spec: str, message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "switchagg.aggregator_cli", "--port", "0", "--job", spec],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--job", "1:2:0:4:8@127.0.0.1:5000,-"], "no --leaf 1:"),
        (["--job", "1:1:0:4:8@127.0.0.1:5000", "--leaf", "2:0@127.0.0.1:6000"], "no --job installs: [2]"),
        (["--threads", "0"], "0 threads: expected 1..256"),
        (["--threads", "two"], "'two' is not a number of threads"),
    ],
)
def test_cli_rejects_a_bad_leaf(args: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "switchagg.aggregator_cli", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr


def _readline(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], WAIT_S)
    assert ready, "the aggregator printed nothing"
    return proc.stdout.readline()


def test_cli_serves_a_job_and_exits_on_sigint(socks: list[socket.socket]) -> None:
    addrs = ",".join("{}:{}".format(*s.getsockname()) for s in socks[:2])
    cmd = [sys.executable, "-m", "switchagg.aggregator_cli", "--port", "0", "--job", f"9:2:10:4:32:3@{addrs}"]
    cmd += ["--stats-interval", "0.05"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            first = _readline(proc)
            assert "listening on 127.0.0.1:" in first and "9 (n=2, slots 10..13, K=32)" in first
            port = int(first.split("127.0.0.1:")[1].split(";")[0])
            # No KEY in the spec: a random one, printed for the workers, is in every RESULT.
            said = _readline(proc)
            assert said.startswith("job 9 result key: 0x"), said
            key = int(said.split(": ")[1], 16)
            assert key != UNKEYED
            socks[0].sendto(data(9, 0, 12, list(range(32))), ("127.0.0.1", port))
            socks[1].sendto(data(9, 1, 12, [-1] * 32), ("127.0.0.1", port))
            for r in range(2):
                h = Header.unpack(socks[r].recv(65536))
                assert (h.rank, h.values, h.key) == (r, [v - 1 for v in range(32)], key)
            while "rx 2" not in _readline(proc):  # the periodic table catches up with the traffic
                pass
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, err
    final = out.split("final counters:")[1]
    assert "rx 2  tx 2" in final
    assert final.strip().splitlines()[-1].split() == ["9", "2", "1", "0", "0"]


class _Fixed:
    """A collector that yields given families (for rendering one snapshot)."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def test_cli_unkeyed_only_by_name_and_with_a_warning(socks: list[socket.socket]) -> None:
    addrs = ",".join("{}:{}".format(*s.getsockname()) for s in socks[:2])
    cmd = [
        sys.executable,
        "-m",
        "switchagg.aggregator_cli",
        "--port",
        "0",
        "--job",
        f"9:2:10:4:32:3:0@{addrs}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT_S)
    assert out.returncode == 2 and "'unkeyed' runs the job without one" in out.stderr, out.stderr
    cmd[-1] = f"9:2:10:4:32:3:unkeyed@{addrs}"
    cmd += ["--stats-interval", "0.05"]  # lines keep coming: _readline's select sees the pipe move
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            _readline(proc)
            assert _readline(proc).strip() == "job 9 result key: unkeyed"
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert "warning: job 9 is unkeyed" in err, err


def test_add_job_draws_a_key_unless_told_and_warns_when_unkeyed() -> None:
    with SoftwareAggregator("127.0.0.1", 0) as agg:
        key = agg.add_job(1, 1, 0, 4, 8, 1, [("127.0.0.1", 5000)])
        assert key != UNKEYED and agg.jobs()[1].key == key
        assert agg.add_job(2, 1, 4, 4, 8, 1, [("127.0.0.1", 5001)], key=77) == 77
        with pytest.warns(RuntimeWarning, match="job 3 is unkeyed"):
            assert agg.add_job(3, 1, 8, 4, 8, 1, [("127.0.0.1", 5002)], key=UNKEYED) == UNKEYED


def test_a_session_needs_a_key_or_opts_out_by_name() -> None:
    from switchagg import Session

    with pytest.raises(ValueError, match="Session needs key="):
        Session(1, 0, 1, ("127.0.0.1", 9))
    with (
        pytest.warns(RuntimeWarning, match="job 1 is unkeyed"),
        Session(1, 0, 1, ("127.0.0.1", 9), key=UNKEYED),
    ):
        pass
