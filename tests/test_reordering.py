"""Reordering is not loss: results held back on one slot (a relay that delays them, as one thread of a
multi-threaded aggregator running behind another does) make the workers fast-retransmit, and each
such resend, answered a second time, is found spurious and widens RACK's reordering window
(docs/PROTOCOL.md, Loss recovery). Sums stay exact."""

from __future__ import annotations

import numpy as np

from switchagg import Session, _core
from switchagg.aggregator import SoftwareAggregator, new_key
from switchagg_lab.testing.delaying_relay import DelayingRelay
from switchagg_lab.testing.kit import allreduce_all

N, K, SLOTS, CALLS = 2, 64, 8, 30
LENGTH = K * SLOTS * 4  # four rounds on every slot per call


def test_held_back_results_are_found_spurious_and_sums_stay_exact() -> None:
    agg = SoftwareAggregator("127.0.0.1", 0).start()
    workers = [_core.Worker("127.0.0.1", 0) for _ in range(N)]
    relay = DelayingRelay(agg.address, [w.address for w in workers], slow_slots={0}, delay=0.02).start()
    key = new_key()
    sessions = []
    try:
        agg.add_job(1, N, 0, SLOTS, K, 1, relay.addresses, key=key)
        sessions = [
            Session(1, r, N, relay.addresses[r], 0, SLOTS, K, timeout=30, key=key, _worker=workers[r])
            for r in range(N)
        ]
        for call in range(CALLS):
            xs = [np.arange(LENGTH, dtype=np.int32) * (call + 1) + r for r in range(N)]
            allreduce_all(sessions, xs)
            want = np.arange(LENGTH, dtype=np.int64) * (call + 1) * N + N * (N - 1) // 2
            for x in xs:
                np.testing.assert_array_equal(x, want.astype(np.int32))
        stats = [s.stats() for s in sessions]
    finally:
        for s in sessions:
            s.close()
        relay.stop()
        agg.stop()
    assert relay.held > 0
    fast = sum(s["fast_retransmits"] for s in stats)
    spurious = sum(s["spurious_retransmits"] for s in stats)
    print(f"\n{relay.held} results held back: {fast} fast retransmits, {spurious} found spurious")
    assert fast > 0  # the held-back results looked like losses at first
    assert 0 < spurious <= fast  # and their second answers showed they were not
