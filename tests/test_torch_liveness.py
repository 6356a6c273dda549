"""liveness.PeerWatch over real TCP connections, its ranks as threads of this process: who is gone,
who closed, what rank 0 relays, who gets the group's secret, and what the c10d store shows."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from switchagg.torch.backend import EXCHANGE_PREFIX, StoreExchange  # noqa: E402
from switchagg.torch.dataplane import open_data_plane  # noqa: E402
from switchagg.torch.liveness import SECRET_BYTES, PeerWatch  # noqa: E402
from switchagg_lab.testing.kit import free_port  # noqa: E402


class ThreadExchange:
    """dataplane.Exchange for ranks that are threads; ``after(round, values)`` runs once per round
    before any rank sees its values."""

    def __init__(self, size: int, after: Callable[[int, list[str]], None] = lambda r, v: None) -> None:
        self.values = [""] * size
        self.round = 0
        self._after = after
        self._barrier = threading.Barrier(size, action=self._action, timeout=30)
        self._done = threading.Barrier(size, timeout=30)

    def _action(self) -> None:
        self.round += 1
        self._after(self.round, list(self.values))

    def gather(self, rank: int, value: str) -> list[str]:
        self.values[rank] = value
        self._barrier.wait()
        values = list(self.values)
        self._done.wait()  # nobody writes the next round's value before everyone read this one
        return values

    def settle(self) -> None:
        pass


class RankExchange:
    def __init__(self, shared: ThreadExchange, rank: int) -> None:
        self.shared, self.rank = shared, rank

    def gather(self, value: str) -> list[str]:
        return self.shared.gather(self.rank, value)

    def settle(self) -> None:
        pass


def loopback() -> str:
    return "127.0.0.1"


def connect_all(
    size: int, gone_after: float = 5.0, after: Any = None
) -> tuple[list[PeerWatch], list[list[str]]]:
    shared = ThreadExchange(size, after) if after else ThreadExchange(size)
    reasons: list[list[str]] = [[] for _ in range(size)]
    watches = [PeerWatch(r, size, gone_after, reasons[r].append) for r in range(size)]
    with concurrent.futures.ThreadPoolExecutor(size) as pool:
        list(pool.map(lambda r: watches[r].connect(RankExchange(shared, r), loopback), range(size)))
    for w in watches:
        w.start()
    return watches, reasons


def wait_until(check: Callable[[], bool], seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


def test_every_rank_gets_the_same_secret() -> None:
    watches, _ = connect_all(3)
    try:
        assert len(watches[0].secret) == SECRET_BYTES
        assert all(w.secret == watches[0].secret for w in watches)
    finally:
        for w in watches:
            w.close()


def test_a_stray_connection_is_refused_and_learns_nothing() -> None:
    """A local process that reads rank 0's address from the exchange and connects before every rank
    is not a published source address: rank 0 closes it unread and sends it no secret."""
    strays: list[socket.socket] = []

    def connect_first(round: int, values: list[str]) -> None:
        if round == 1:  # rank 0's listening address is out; no rank has connected yet
            host, _, port = values[0].split(" ")[0].rpartition(":")
            strays.append(socket.create_connection((host, int(port)), timeout=10))

    watches, _ = connect_all(2, after=connect_first)
    try:
        stray = strays[0]
        stray.settimeout(10)
        assert stray.recv(SECRET_BYTES) == b""  # closed by rank 0, nothing sent
        assert watches[1].secret == watches[0].secret
    finally:
        for w in watches:
            w.close()


def in_flight(watch: PeerWatch) -> concurrent.futures.Future[None]:
    call: concurrent.futures.Future[None] = concurrent.futures.Future()
    watch.track(call)
    return call


def test_a_rank_whose_connection_ends_is_gone_and_rank_0_relays_it() -> None:
    """Rank 2's connection ends without a goodbye (as when its process is killed): rank 0 sees it,
    rank 1 hears it from rank 0; each fails the call it has in flight, naming rank 2."""
    watches, reasons = connect_all(3)
    try:
        calls = [in_flight(watches[0]), in_flight(watches[1])]
        watches[2]._drop_fds()  # what the kernel does when the process dies
        assert wait_until(lambda: bool(reasons[0]) and bool(reasons[1]))
        assert reasons[0] == [
            "rank 2 is gone: its process ended (its liveness connection closed without a goodbye)"
        ]
        assert reasons[1] == ["rank 2 is gone: its process ended (rank 0 saw its liveness connection end)"]
        for call in calls:
            call.set_result(None)
    finally:
        for w in watches:
            w.close()


def test_a_closed_rank_fails_nothing_while_idle_but_fails_a_later_call() -> None:
    watches, reasons = connect_all(3)
    try:
        watches[2].close()
        time.sleep(1.0)  # longer than the grace: an idle group is never failed
        assert reasons == [[], [], []]
        call = in_flight(watches[1])  # a call rank 2 never made cannot complete: it fails at once
        assert wait_until(lambda: bool(reasons[1]), 5)
        assert reasons[1] == [
            "rank 2 closed its switchagg process group after 0 network calls (this is call 1)"
        ]
        call.set_result(None)
    finally:
        for w in watches:
            w.close()


def test_a_call_the_closed_rank_made_is_left_to_complete() -> None:
    """Rank 1 made two calls and closed (its results were in); rank 0, slower, still has the second
    in flight: that one can complete (the aggregator holds its sum), so nothing fires for it, even
    after the grace; a third call, which rank 1 never made, fails at once."""
    watches, reasons = connect_all(2)
    try:
        for _ in range(2):
            in_flight(watches[1]).set_result(None)
        first = in_flight(watches[0])
        first.set_result(None)
        second = in_flight(watches[0])
        watches[1].close()
        time.sleep(watches[0].grace * 3)
        assert reasons[0] == []
        second.set_result(None)
        third = in_flight(watches[0])
        assert wait_until(lambda: bool(reasons[0]), 5)
        assert reasons[0] == [
            "rank 1 closed its switchagg process group after 2 network calls (this is call 3)"
        ]
        third.set_result(None)
    finally:
        for w in watches:
            w.close()


def test_a_call_that_completes_within_the_grace_is_not_failed() -> None:
    """A peer that exits right after the last call: this rank's result is already in, so the call
    completes before the grace ends and nothing fires."""
    watches, reasons = connect_all(2)
    try:
        call = in_flight(watches[0])
        watches[1]._drop_fds()
        time.sleep(watches[0].grace / 5)
        call.set_result(None)
        time.sleep(watches[0].grace * 2)
        assert reasons[0] == []
    finally:
        for w in watches:
            w.close()


def test_the_embedded_key_is_not_in_the_store() -> None:
    """Two ranks open the embedded data plane over a real TCPStore: they share a non-zero result key,
    and no value of the start-up exchange holds it (what any local user can read there)."""
    port = free_port(socket.SOCK_STREAM)
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
    stores = [server, client]

    def open_rank(rank: int) -> Any:
        watch = PeerWatch(rank, 2, 5.0, lambda _: None)
        plane = open_data_plane(rank, 2, StoreExchange(stores[rank], rank, 2), "g1", 30.0, watch=watch)
        return plane, watch

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        opened = list(pool.map(open_rank, range(2)))
    try:
        keys = [plane.session.shards[0].key for plane, _ in opened]
        assert keys[0] == keys[1] != 0
        values = []
        for round in range(1, 20):
            for rank in range(2):
                name = f"{EXCHANGE_PREFIX}{round}/{rank}"
                if server.check([name]):
                    values.append(server.get(name).decode())
        assert len(values) >= 8, values  # the liveness rounds and the data plane's
        key = keys[0]
        for text in (str(key), f"{key:x}", f"{key:#x}"):
            assert not any(text in v for v in values), (text, values)
    finally:
        for plane, watch in opened:
            watch.close()
            plane.close()


def test_the_kernel_watches_a_vanished_host() -> None:
    """A host that stops answering without a reset is the kernel's to find: keepalive probes from
    SWITCHAGG_TIMEOUT/2 and TCP_USER_TIMEOUT of SWITCHAGG_TIMEOUT on every liveness connection."""
    watches, _ = connect_all(2, gone_after=8.0)
    try:
        for w in watches:
            for sock in w._conns.values():
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 4
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 8000
    finally:
        for w in watches:
            w.close()
