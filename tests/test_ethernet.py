"""A real Ethernet (issue 34): links of MTU 1500 in namespaces, frame loss that drops any frame.

* Nothing is fragmented: workers and the software aggregator send with DF, and a Session without K
  takes the most one frame carries (361 values at MTU 1500); the kernel's fragment counters in
  every namespace stay 0. A K that does not fit fails at once, naming the MTU.
* The testbed's loss drops frames, not datagrams: a datagram of 3 fragments is lost when any of them
  is, so ~(1-p)^3 of them arrive, in each direction; and frames, not GSO trains.
* Loss recovery at 0.1%, 1% and 5% frame loss on every worker link, both ways: every sum exact.

Needs root, iproute2 and nftables; skipped, with the reason, elsewhere."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from switchagg import Session, protocol
from switchagg.aggregator import SoftwareAggregator, new_key
from switchagg_lab.testbed import netns, tools
from switchagg_lab.testbed.rack import AGG_IP, Testbed

REASON = tools.missing_for(["ip", "tc", "nft"], "the Ethernet tests")
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

MTU = 1500


def _snmp_ip(ns: str) -> dict[str, int]:
    """The namespace's IPv4 counters (/proc/net/snmp's Ip lines: FragCreates, ReasmReqds, ...)."""
    lines = [
        line.split()
        for line in netns.sh("cat", "/proc/net/snmp", ns=ns).splitlines()
        if line.startswith("Ip:")
    ]
    return {name: int(value) for name, value in zip(lines[0][1:], lines[1][1:], strict=True)}


@pytest.fixture
def bed(tmp_path: Path) -> Iterator[Testbed]:
    with Testbed(3, tmp_path / "bed", data_plane="soft", mtu=MTU) as b:
        yield b


def _sessions(bed: Testbed, agg: SoftwareAggregator, slots: int, k: int | None = None) -> list[Session]:
    """One session per endpoint, each made in its namespace (its socket and its path MTU are there);
    the job installed with the K the sessions chose."""
    key = new_key()
    workers = []
    for e in bed.endpoints:
        with netns.in_netns(e.ns):
            from switchagg import _core

            workers.append(_core.Worker(e.ip, 0))
    agg.add_job(1, bed.n, 0, slots, k or protocol.k_for_mtu(MTU), 1, [w.address for w in workers], key=key)
    sessions = []
    for r, (e, w) in enumerate(zip(bed.endpoints, workers, strict=True)):
        with netns.in_netns(e.ns):
            sessions.append(
                Session(1, r, bed.n, (AGG_IP, protocol.UDP_PORT), 0, slots, k, timeout=30, key=key, _worker=w)
            )
    return sessions


def _allreduce_all(sessions: list[Session], xs: list[np.ndarray]) -> None:
    errors: list[BaseException] = []

    def run(s: Session, x: np.ndarray) -> None:
        try:
            s.allreduce(x)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s, x)) for s, x in zip(sessions, xs, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "an allreduce did not finish"
    assert not errors, errors


def _run(bed: Testbed, length: int, calls: int, loss: float = 0.0) -> tuple[list[dict[str, int]], int, int]:
    """``calls`` exact int32 allreduces of ``length`` values over the bed at ``loss``% frame loss;
    returns every rank's stats, the K the sessions chose and rank 0's path MTU."""
    with netns.in_netns(bed.switch_ns):
        agg = SoftwareAggregator(host=AGG_IP, port=protocol.UDP_PORT).start()
    for e in bed.endpoints:
        e.set_loss(loss)
    slots = protocol.window_slots(protocol.k_for_mtu(MTU))
    sessions = _sessions(bed, agg, slots)
    try:
        for call in range(calls):
            xs = [np.arange(length, dtype=np.int32) * (call + 1) + r for r in range(bed.n)]
            _allreduce_all(sessions, xs)
            want = (np.arange(length, dtype=np.int64) * (call + 1) * bed.n + bed.n * (bed.n - 1) // 2).astype(
                np.int32
            )
            for x in xs:
                np.testing.assert_array_equal(x, want)
        return [s.stats() for s in sessions], sessions[0].k, sessions[0]._worker.path_mtu
    finally:
        for s in sessions:
            s.close()
        agg.stop()


def test_mtu_1500_nothing_is_fragmented_and_k_is_chosen_by_the_mtu(bed: Testbed) -> None:
    spaces = [bed.switch_ns, *(e.ns for e in bed.endpoints)]
    before = {ns: _snmp_ip(ns) for ns in spaces}
    stats, k, mtu = _run(bed, 200_000, 2)
    assert k == protocol.k_for_mtu(MTU) == 361
    assert mtu == MTU
    for ns in spaces:
        after = _snmp_ip(ns)
        for counter in ("FragCreates", "FragOKs", "FragFails", "ReasmReqds"):
            assert after[counter] == before[ns][counter], (ns, counter, before[ns], after)
    assert all(s["allreduces"] == 2 for s in stats)
    assert all(s["gso_sends"] > 0 for s in stats)  # frame-sized packets, sent in GSO trains
    # every packet is one full frame: datagrams of 28 + 4 * 361 bytes, IP packets of exactly the MTU
    assert protocol.mtu_for_k(k) <= MTU < protocol.mtu_for_k(k + 1)


def test_a_k_above_the_path_mtu_fails_naming_the_mtu(bed: Testbed) -> None:
    with netns.in_netns(bed.switch_ns):
        agg = SoftwareAggregator(host=AGG_IP, port=protocol.UDP_PORT).start()
    try:
        with pytest.raises(
            ValueError, match=r"K=2048 makes 8248-byte IP packets, more than the MTU of 1500 bytes"
        ):
            _sessions(bed, agg, 16, k=2048)
    finally:
        agg.stop()


def test_loss_drops_frames_fragments_included_both_ways(bed: Testbed) -> None:
    """200 datagrams of 3 fragments each at 30% frame loss: about 0.7^3 = 34% arrive (70% if the loss
    hit datagrams or first fragments only), leaving and arriving; the rules count what they dropped."""
    sender, receiver = bed.endpoints[0], bed.endpoints[1]
    count, size, p = 200, 4000, 30
    for lossy, way in ((sender, 0), (receiver, 1)):  # egress at the sender, then ingress at the receiver
        lossy.set_loss(p)
        rx = receiver.udp_socket()
        rx.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE: the burst must not overflow it
        rx.settimeout(2.0)
        with netns.in_netns(sender.ns):
            tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tx.setsockopt(socket.IPPROTO_IP, 10, 0)  # IP_MTU_DISCOVER = IP_PMTUDISC_DONT: fragment
        got = 0
        try:
            for _ in range(count):
                tx.sendto(b"x" * size, rx.getsockname())
            while True:
                try:
                    rx.recv(65536)
                except TimeoutError:
                    break
                got += 1
        finally:
            tx.close()
            rx.close()
        lost = lossy.lost_each_way()[way]
        lossy.set_loss(0)
        print(f"\n30% loss, {('egress', 'ingress')[way]}: {got} of {count} datagrams, {lost} frames lost")
        assert 0.15 * count < got < 0.55 * count, got
        assert lost >= count - got  # every lost datagram lost a frame or more


@pytest.mark.parametrize("loss", [0.1, 1.0, 5.0])
def test_recovery_at_frame_loss_is_exact(bed: Testbed, loss: float) -> None:
    stats, _, _ = _run(bed, 500_000, 2, loss)
    lost = sum(e.lost() for e in bed.endpoints)
    sent = sum(s["sent"] for s in stats)
    resent = sum(s["retransmits"] for s in stats)
    names = ("fast_retransmits", "status_resends", "status_holds", "tail_probes", "timeouts")
    kinds = {k: sum(s[k] for s in stats) for k in names}
    print(
        f"\n{loss}% frame loss: {lost} frames lost of ~{2 * sent}, {resent} resends of {sent} packets {kinds}"
    )
    if loss >= 1:  # frames, not GSO trains of up to 44 packets, met the dice
        assert 0.5 * loss / 100 * 2 * sent < lost < 1.5 * loss / 100 * 2 * sent
