"""UDP GSO and GRO in both engines (issue 34): frame-sized packets at the cost of big datagrams. On
loopback (no root): a job of K = 361 (one 1500-byte frame per packet) sends its packets in GSO trains
both ways and receives them coalesced (GRO), with the sums exact; with SWITCHAGG_GSO=0 both engines
fall back to one datagram per send and receive, with the same sums."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from switchagg import Session, _core, protocol
from switchagg.aggregator import SoftwareAggregator, new_key
from switchagg_lab.testing.kit import allreduce_all

N, K = 3, protocol.k_for_mtu(1500)
LENGTH = 300_000  # 831 packets per worker and call


def _run(
    calls: int = 2, threads: int = 1
) -> tuple[list[dict[str, int]], dict[str, Any], list[tuple[int, bool]]]:
    slots = protocol.window_slots(K)
    agg = SoftwareAggregator("127.0.0.1", 0, threads=threads).start()
    workers = [_core.Worker("127.0.0.1", 0) for _ in range(N)]
    key = new_key()
    sessions: list[Session] = []
    try:
        agg.add_job(1, N, 0, slots, K, 1, [w.address for w in workers], key=key)
        sessions = [Session(1, r, N, agg.address, 0, slots, K, key=key, _worker=workers[r]) for r in range(N)]
        offload = [(w.gso, w.gro) for w in workers]
        for call in range(calls):
            xs = [np.arange(LENGTH, dtype=np.int32) * (call + 1) + r for r in range(N)]
            allreduce_all(sessions, xs)
            want = (np.arange(LENGTH, dtype=np.int64) * (call + 1) * N + N * (N - 1) // 2).astype(np.int32)
            for x in xs:
                np.testing.assert_array_equal(x, want)
        stats = [s.stats() for s in sessions]
        counters = agg.counters()
    finally:
        for s in sessions:
            s.close()
        agg.stop()
    assert sum(counters["drops"].values()) == 0, counters["drops"]
    return stats, counters, offload


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gso_trains_and_coalesced_receives_both_ways(threads: int) -> None:
    """The kernel steers a train whole, by its first datagram: a worker's train holds slots of one
    steering class, so with 2 or 3 aggregator threads every datagram reaches its slot's owner's own
    socket (a thread never sums more than it received) and a slot's packets stay in order."""
    stats, counters, offload = _run(threads=threads)
    # 44 packets of 1472 bytes per send: as much as one 64 KiB datagram
    assert offload == [(protocol.MAX_UDP_PAYLOAD // protocol.packet_len(K), True)] * N
    sent = sum(s["sent"] for s in stats)
    assert sum(s["gso_sends"] for s in stats) > 0 and sum(s["gso_sends"] for s in stats) < sent / 4
    assert counters["gro_receives"] > 0  # the aggregator took whole trains
    assert counters["rx"] == sent  # and walked them packet by packet
    assert counters["gso_sends"] > 0  # results went back in trains, one per worker and batch
    assert sum(s["gro_receives"] for s in stats) > 0
    assert not any(t["misrouted"] for t in counters["threads"])
    # no train mixed classes: a thread summed only what reached its own socket (a mixed train would
    # have its owner sum packets another thread received)
    assert all(t["aggregated"] <= t["rx"] for t in counters["threads"]), counters["threads"]
    assert sum(j["aggregated"] for j in counters["jobs"].values()) == sum(
        t["aggregated"] for t in counters["threads"]
    )
    print(
        f"\n{sent} packets in {sum(s['gso_sends'] for s in stats)} GSO sends; aggregator: {counters['rx']} "
        f"in {counters['gro_receives']} coalesced receives, results in {counters['gso_sends']} GSO sends"
    )


def test_switchagg_gso_0_falls_back_to_a_datagram_per_send(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHAGG_GSO", "0")
    stats, counters, offload = _run()
    assert offload == [(0, False)] * N
    assert sum(s["gso_sends"] + s["gro_receives"] for s in stats) == 0
    assert counters["gso_sends"] == counters["gro_receives"] == 0
    assert counters["rx"] == sum(s["sent"] for s in stats)


def test_loopback_k_is_too_big_for_gso() -> None:
    """At the default K a packet is ~64 KiB: one per send, nothing to gain, GSO stays off."""
    agg = SoftwareAggregator("127.0.0.1", 0).start()
    try:
        s = Session(1, 0, 1, agg.address, key=0x5EC)  # no call is made: any key will do
        assert s.k == protocol.DEFAULT_SW_K and s._worker.gso == 0 and s._worker.path_mtu >= 65535
        s.close()
    finally:
        agg.stop()
