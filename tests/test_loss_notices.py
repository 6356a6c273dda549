"""Loss notices (docs/PROTOCOL.md, Loss notices): the software aggregator tells a rank that skipped a
round to resend (MSG_STATUS, its bit clear) and the ranks the round has to wait (their bits set),
over real UDP; end to end, a lost contribution is then resent by the rank that lost it, not by all."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from switchagg import protocol
from switchagg.aggregator import SoftwareAggregator, format_counters, metrics_sample
from switchagg.aggregator_control import RemoteAggregator
from switchagg.protocol import MSG_RESULT, MSG_STATUS, STATUS_LAG, STEER_CLASSES, Header
from switchagg_lab.testing.control import ControlledAggregator
from switchagg_lab.testing.kit import local_sessions, on_every_rank, wait_rx

KEY = 0x5EC12E7
JOB, K, SLOTS = 3, 4, 64
WAIT_S = 10.0  # the sockets fixture's timeout


def data(rank: int, slot: int, offset: int, call: int = 1) -> bytes:
    return Header(
        job=JOB, rank=rank, slot=slot, offset=offset, call=call, total=1000, values=[rank + 1] * K
    ).pack()


def received(s: socket.socket) -> list[Header]:
    """Every datagram waiting on s (after the first, 0.3 s of quiet ends it)."""
    out = [Header.unpack(s.recv(65536))]
    s.settimeout(0.3)
    try:
        while True:
            out.append(Header.unpack(s.recv(65536)))
    except TimeoutError:
        return out
    finally:
        s.settimeout(WAIT_S)


def class_slots(count: int) -> list[int]:
    """The first `count` slots of steering class 0: rounds one rank sends in order."""
    return [STEER_CLASSES * i for i in range(count)]


def start(agg: SoftwareAggregator, socks: list[socket.socket], n: int = 2) -> None:
    agg.add_job(JOB, n, 0, SLOTS, K, 1, [s.getsockname() for s in socks[:n]], key=KEY)


def test_a_rank_past_a_round_it_skipped_is_told_to_resend_and_the_others_to_wait(
    socks: list[socket.socket],
) -> None:
    with SoftwareAggregator() as agg:
        start(agg, socks)
        slots = class_slots(STATUS_LAG + 1)
        for i, slot in enumerate(slots):  # rank 0 starts every round of the class, in order
            socks[0].sendto(data(0, slot, offset=K * i), agg.address)
        for i, slot in list(enumerate(slots))[1:]:  # rank 1 skips the first
            socks[1].sendto(data(1, slot, offset=K * i), agg.address)
        wait_rx(agg, 2 * len(slots) - 1)
        for rank, s in enumerate(socks[:2]):
            got = received(s)
            status = [h for h in got if h.type == MSG_STATUS]
            assert [h.slot for h in got if h.type == MSG_RESULT] == slots[1:]
            assert len(status) == 1, got  # rank 1: resend; rank 0: wait
            h = status[0]
            assert (h.slot, h.shadow, h.offset, h.call, h.total) == (slots[0], 0, 0, 1, 1000)
            assert (h.rank, h.key, h.elems, h.values) == (rank, KEY, 1, [0b01])  # the round has rank 0 only
        c = agg.counters()
        assert (c["status_resend"], c["status_hold"]) == (1, 1)
        assert metrics_sample(agg).loss_notices == {"resend": 1, "hold": 1}  # switchagg_loss_notices_total
        assert "loss notices: resend 1  hold 1" in format_counters(c)
        # rank 1's resend completes the round: its result goes to both, no further notice
        socks[1].sendto(data(1, slots[0], offset=0), agg.address)
        for s in socks[:2]:
            h = Header.unpack(s.recv(65536))
            assert (h.type, h.slot, h.values) == (MSG_RESULT, slots[0], [3] * K)
        assert agg.counters()["status_resend"] == 1


def test_no_notice_before_the_lag_nor_for_another_class_nor_when_turned_off(
    socks: list[socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    for notices in ("1", "0"):
        monkeypatch.setenv("SWITCHAGG_LOSS_NOTICES", notices)
        with SoftwareAggregator() as agg:
            start(agg, socks)
            slots = class_slots(STATUS_LAG + 1)
            for i, slot in enumerate(slots):
                socks[0].sendto(data(0, slot, offset=K * i), agg.address)
            # rank 1 skips slot 0 but sends only LAG - 1 later rounds of its class, and rounds of others
            later = slots[1:STATUS_LAG] + [1, 2, 3] if notices == "1" else slots[1:]
            for slot in later:
                socks[1].sendto(data(1, slot, offset=K * (slot // STEER_CLASSES)), agg.address)
            wait_rx(agg, len(slots) + len(later))
            c = agg.counters()
            assert (c["status_resend"], c["status_hold"]) == (0, 0)
            assert all(h.type != MSG_STATUS for h in received(socks[1]))


def skip_a_round(agg: Any, socks: list[socket.socket]) -> None:
    """The first test's traffic: rank 1 skips the first of four rounds rank 0 started."""
    slots = class_slots(STATUS_LAG + 1)
    for i, slot in enumerate(slots):
        socks[0].sendto(data(0, slot, offset=K * i), agg.address)
    for i, slot in list(enumerate(slots))[1:]:
        socks[1].sendto(data(1, slot, offset=K * i), agg.address)
    wait_rx(agg, 2 * len(slots) - 1)


@pytest.mark.parametrize("where", ["here", "control service"])
def test_a_job_installed_without_loss_notices_gets_none(
    socks: list[socket.socket], tmp_path: Path, where: str
) -> None:
    """A software spine over P4 leaves is installed so: they take no STATUS (their parser would count
    it as a bad_type drop). Locally and through the aggregator's control service."""
    addrs = [s.getsockname() for s in socks[:2]]
    if where == "here":
        with SoftwareAggregator() as agg:
            agg.add_job(JOB, 2, 0, SLOTS, K, 1, addrs, key=KEY, loss_notices=False)
            skip_a_round(agg, socks)
            c = agg.counters()
    else:
        with (
            ControlledAggregator(tmp_path, "agg", "s3cret") as proc,
            RemoteAggregator(proc.target, "s3cret") as agg,
        ):
            agg.add_job(JOB, 2, 0, SLOTS, K, 1, addrs, key=KEY, loss_notices=False)
            skip_a_round(agg, socks)
            c = agg.counters()
    assert (c["status_resend"], c["status_hold"]) == (0, 0)
    assert all(h.type != MSG_STATUS for h in received(socks[1]))


def test_a_rank_that_sends_one_round_out_of_the_leaders_order_is_not_accused(
    socks: list[socket.socket],
) -> None:
    """Rank 0 (the leader, its own result of a round before late) starts four rounds of a class; rank 1,
    in the order results really came, first starts a fifth, then sends the four: one jump ahead,
    which a single-contribution rule would take for four losses."""
    with SoftwareAggregator() as agg:
        start(agg, socks)
        slots = class_slots(5)
        for i, slot in enumerate(slots[1:]):
            socks[0].sendto(data(0, slot, offset=K * (i + 1)), agg.address)
        socks[1].sendto(data(1, slots[0], offset=0), agg.address)
        for i, slot in enumerate(slots[1:]):
            socks[1].sendto(data(1, slot, offset=K * (i + 1)), agg.address)
        wait_rx(agg, 9)
        c = agg.counters()
        assert (c["status_resend"], c["status_hold"]) == (0, 0)
        assert [h.slot for h in received(socks[1])] == slots[1:]  # four results, no notice


def test_a_status_sent_to_the_aggregator_is_dropped(socks: list[socket.socket]) -> None:
    """Only an aggregator sends a STATUS: one from a worker is malformed and changes nothing."""
    with SoftwareAggregator() as agg:
        start(agg, socks)
        bogus = Header(type=MSG_STATUS, job=JOB, rank=0, slot=0, values=[0]).pack()
        socks[0].sendto(bogus, agg.address)
        wait_rx(agg, 1)
        assert agg.counters()["drops"]["bad_type"] == 1


def test_a_leaf_resends_the_partial_its_spine_waits_for(socks: list[socket.socket]) -> None:
    """socks[2] plays the spine: a STATUS without the leaf's bit makes the leaf send its partial again;
    one with it (the spine has the partial) or of another round changes nothing."""
    spine = socks[2]
    with SoftwareAggregator() as leaf:
        leaf.add_job(JOB, 2, 0, SLOTS, K, 1, [socks[0].getsockname(), socks[1].getsockname()],
                     upstream=spine.getsockname(), leaf_index=1, key=KEY)  # fmt: skip
        for r in range(2):
            socks[r].sendto(data(r, 0, offset=0), leaf.address)
        partial = Header.unpack(spine.recv(65536))
        assert (partial.rank, partial.values) == (1, [3] * K)

        def status(have: int, offset: int = 0) -> bytes:
            return Header(type=MSG_STATUS, job=JOB, rank=1, slot=0, offset=offset, call=1, total=1000,
                          key=KEY, values=[have]).pack()  # fmt: skip

        for have in (0b10, 0b01):  # has the leaf's partial (no resend), then does not (resend)
            spine.sendto(status(have), leaf.address)
        spine.sendto(status(0b01, offset=K), leaf.address)  # another round: stale
        again = Header.unpack(spine.recv(65536))
        assert again == partial
        wait_rx(leaf, 5)
        assert leaf.counters()["jobs"][JOB]["upstream_resent"] == 1
        assert leaf.counters()["jobs"][JOB]["stale_results"] == 1


def run_lossy(
    n: int, calls: int, drop: float, size: int = 200_000
) -> tuple[dict[str, Any], list[dict[str, int]]]:
    """n ranks of one job on a loopback aggregator that drops `drop` of the contributions it receives;
    every sum exact. Returns the aggregator's counters and each rank's stats."""
    with SoftwareAggregator(drop_in=drop, seed=11) as agg:
        sessions = local_sessions(agg, n, k=256, slots=64)
        xs = [np.arange(size, dtype=np.int32) * (r + 1) for r in range(n)]
        want = np.arange(size, dtype=np.int64) * (n * (n + 1) // 2)

        def call(r: int, s: Any) -> np.ndarray:
            x = xs[r].copy()
            s.allreduce(x)  # in place
            return x

        for _ in range(calls):
            outs = on_every_rank(sessions, call)
            for out in outs:
                assert not isinstance(out, Exception), out
                np.testing.assert_array_equal(out, want.astype(np.int32))
        stats = [s.stats() for s in sessions]
        for s in sessions:
            s.close()
        return agg.counters(), stats


@pytest.mark.reliability(
    "loss",
    "2% of the contributions dropped by the aggregator's fault injector, loopback, 4 ranks x 3 allreduces, "
    "with loss notices and without",
    sums=24,
    recovery="the rank that lost a contribution is told to resend it; the others are told to wait",
    state="nothing: every sum exact",
)
def test_a_lost_contribution_is_resent_by_the_rank_that_lost_it(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 4
    counters, stats = run_lossy(n, calls=3, drop=0.02)
    lost = counters["faults"]["dropped_in"]
    assert lost > 0 and counters["status_resend"] > 0 and counters["status_hold"] > 0
    assert sum(s["status_resends"] for s in stats) > 0 and sum(s["status_holds"] for s in stats) > 0
    resent = sum(s["retransmits"] for s in stats)
    # Without notices every rank resends the lost one's round (n per loss); with them about one.
    monkeypatch.setenv("SWITCHAGG_LOSS_NOTICES", "0")
    counters_off, stats_off = run_lossy(n, calls=3, drop=0.02)
    assert counters_off["status_resend"] == counters_off["status_hold"] == 0
    resent_off = sum(s["retransmits"] for s in stats_off)
    per_loss, per_loss_off = resent / lost, resent_off / counters_off["faults"]["dropped_in"]
    print(f"resends per lost contribution: {per_loss:.2f} with notices, {per_loss_off:.2f} without")
    assert per_loss < per_loss_off


def test_protocol_py_names_the_status_message() -> None:
    assert protocol.MSG_NAMES[MSG_STATUS] == "STATUS"
