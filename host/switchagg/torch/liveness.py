"""Which peers are alive, as gloo knows it: by TCP connections, held open by the kernel while a process
lives (stopped, swapped or holding the GIL) and closed or reset by it the moment the process dies
(docs/TORCH.md, Slow peers, gone peers).

The group is a star: rank 0 listens, every other rank connects to it once, and rank 0 relays what it
sees of one rank to the others. A rank whose connection ends without a goodbye is gone; one that said
goodbye (``close()``, which carries how many network calls it made) closed its group: a call it
made too is left to complete, a later one fails. TCP keepalive and TCP_USER_TIMEOUT, both set from
SWITCHAGG_TIMEOUT, end the connection of a host that vanished without a reset; all of this is the
kernel's, needing no GIL. The reading thread blocks in ``select``: if this process is stalled it acts
when it resumes. A reason ends the network calls in flight through ``on_gone(reason)``, after a short
grace (a call whose result already arrived completes); nothing is acted on while no call is in
flight, so an idle group is never failed, but a call begun after a peer went fails at once.

The connections also carry the group's secret: rank 0 draws 32 random bytes and sends them down
each connection, which it accepts only from the source address that rank published after connecting
(pinned as the aggregator pins a rank's UDP address: an unprivileged process cannot send from a port
another process holds). The embedded job's result key is derived from it, so a reader of the c10d
store (any local user) learns addresses, never a key.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("switchagg.torch")

SECRET_BYTES = 32
# Seconds a reason waits for the calls in flight: a peer that exits right after the last call of a
# job must not fail a rank whose result is already in its socket.
GRACE = 0.5
# Messages, one line each: rank 0 relays "gone R" and "closed R"; any rank says "closed R" on close().
GONE, CLOSED = b"gone", b"closed"
# How long the start-up waits for the connections once every rank has published its address.
CONNECT_TIMEOUT = 60.0

_live: weakref.WeakSet[PeerWatch] = weakref.WeakSet()


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) holds copies of the connections: closed here, so that
    # the parent's death still reaches its peers at once instead of when its children exit.
    for watch in list(_live):
        watch._drop_fds()


os.register_at_fork(after_in_child=_forget_in_child)


def derive_key(secret: bytes, what: str) -> int:
    """A 32-bit non-zero key for ``what`` from the group's secret (every rank derives the same)."""
    digest = hmac.new(secret, b"switchagg " + what.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:4], "big") or 1


def _keepalive(sock: socket.socket, gone_after: float) -> None:
    """The kernel ends the connection of a host that stopped answering after about ``gone_after`` s."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(gone_after / 2))
    interval = max(1, int(gone_after / 6))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # unacknowledged data (a relay) to a vanished host
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(gone_after * 1000)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _address(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RuntimeError(f"{what} is {text!r}, not HOST:PORT")
    return host.strip("[]"), int(port)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("rank 0 closed the connection before sending the group's secret")
        data += chunk
    return data


class PeerWatch:
    """One rank's view of its group's liveness: ``connect(exchange)`` (collective) builds the star
    and hands out the group's ``secret``; ``start()`` watches; ``track(future)`` marks a network call
    in flight; ``close()`` says goodbye."""

    def __init__(
        self,
        rank: int,
        size: int,
        gone_after: float,
        on_gone: Callable[[str], None],
    ) -> None:
        self.rank, self.size, self.gone_after = rank, size, gone_after
        self.grace = min(GRACE, gone_after / 2)
        self._on_gone = on_gone
        self.secret = b""
        self._conns: dict[int, socket.socket] = {}  # rank 0: every other rank's; others: {0: rank 0's}
        self._buffers: dict[int, bytes] = {}
        self._said_closed: set[int] = set()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)  # a full pipe already wakes the watcher: never block a caller
        self._lock = threading.Lock()
        self._calls = 0  # network calls tracked so far: the same sequence on every rank
        self._pending: set[int] = set()  # the indices of those in flight
        self._gone = ""  # why a peer is gone, and since when
        self._gone_at = 0.0
        self._closed_after: dict[int, int] = {}  # a rank that said goodbye: how many calls it made
        self._fired = False
        self._closed = False
        self._thread: threading.Thread | None = None
        _live.add(self)

    # Start-up (collective).

    def connect(self, exchange: Any, bind: Callable[[], str]) -> None:
        """Rank 0 listens on ``bind()``. Three rounds of ``exchange`` (dataplane.Exchange): rank 0's
        listening address; every other rank's source address, published once it is connected;
        whether every rank got the secret. Any rank's failure fails every rank, naming it."""
        from switchagg.torch.dataplane import FAILED_MARK, _gathered, check_reachable, network_identity

        listener: socket.socket | None = None
        try:
            mine = "-"
            if self.rank == 0:
                where = "its address"
                try:
                    where = bind()
                    listener = socket.create_server((where, 0), backlog=max(16, self.size))
                    mine = "{}:{} {}".format(*listener.getsockname()[:2], network_identity())
                except (OSError, ValueError) as e:
                    mine = f"{FAILED_MARK}rank 0 cannot listen on {where} for the liveness connections: {e}"
            root, _, network = _gathered(exchange, mine, "open their liveness connections")[0].partition(" ")
            mine = "-"
            if self.rank != 0:
                try:
                    address = _address(root, "rank 0's liveness address")
                    check_reachable(address[0], network, network_identity())
                    mine = self._connect_to_root(address)
                except (OSError, RuntimeError) as e:
                    mine = f"{FAILED_MARK}rank {self.rank} cannot connect to rank 0 at {root}: {e}"
            sources = _gathered(exchange, mine, "open their liveness connections")
            try:
                if self.rank == 0:
                    assert listener is not None
                    self.secret = secrets.token_bytes(SECRET_BYTES)
                    self._accept_all(listener, sources)
                else:
                    deadline = time.monotonic() + CONNECT_TIMEOUT
                    self.secret = _recv_exact(self._conns[0], SECRET_BYTES, deadline)
                    self._conns[0].settimeout(None)
                ok = "ok"
            except (OSError, RuntimeError) as e:
                ok = f"{FAILED_MARK}rank {self.rank} could not set up its liveness connections: {e}"
            _gathered(exchange, ok, "set up their liveness connections")
        except BaseException:
            self._drop_fds()
            exchange.settle()
            raise
        finally:
            if listener is not None:
                listener.close()

    def _connect_to_root(self, root: tuple[str, int]) -> str:
        sock = socket.create_connection(root, timeout=CONNECT_TIMEOUT)
        _keepalive(sock, self.gone_after)
        self._conns[0] = sock
        return "{}:{}".format(*sock.getsockname()[:2])

    def _accept_all(self, listener: socket.socket, sources: list[str]) -> None:
        """Accepts rank r's connection only from the address it published; anything else is closed."""
        want = {_address(s, f"rank {r}'s liveness address"): r for r, s in enumerate(sources) if r != 0}
        deadline = time.monotonic() + CONNECT_TIMEOUT
        strays = 0
        while len(self._conns) < self.size - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(want.values()) - set(self._conns))
                raise RuntimeError(
                    f"no liveness connection from ranks {missing} within {CONNECT_TIMEOUT:g} s "
                    f"({strays} connections from other addresses refused: a NAT between the ranks "
                    "hides the address each rank published)"
                )
            listener.settimeout(remaining)
            sock, peer = listener.accept()
            r = want.get((peer[0], peer[1]))
            if r is None or r in self._conns:
                strays += 1
                sock.close()
                continue
            _keepalive(sock, self.gone_after)
            self._conns[r] = sock
        for sock in self._conns.values():
            sock.settimeout(CONNECT_TIMEOUT)
            sock.sendall(self.secret)
            sock.settimeout(None)

    # Watching.

    def start(self) -> PeerWatch:
        for sock in self._conns.values():
            sock.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="switchagg-peers", daemon=True)
        self._thread.start()
        return self

    def track(self, pending: Any) -> None:
        """A network call is in flight until ``pending`` (a concurrent.futures.Future) is done."""
        with self._lock:
            index = self._calls
            self._calls += 1
            self._pending.add(index)
            wake = bool(self._gone or self._closed_after) and not self._fired
        if wake:  # a peer is gone or closed already: the watcher judges this call at once
            self._wake()
        pending.add_done_callback(lambda _: self._done(index))

    def _done(self, index: int) -> None:
        with self._lock:
            self._pending.discard(index)

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"!")
        except OSError:
            pass

    def close(self) -> None:
        """Says goodbye with the number of calls this rank made (the peers read ``closed``, not
        ``gone``, and fail only a call beyond that number) and stops watching."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            line = CLOSED + b" %d %d\n" % (self.rank, self._calls)
        for sock in list(self._conns.values()):
            try:
                sock.setblocking(True)
                sock.settimeout(1.0)
                sock.sendall(line)
            except OSError:
                pass
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._drop_fds()

    def _drop_fds(self) -> None:
        for sock in (*self._conns.values(), self._wake_r, self._wake_w):
            try:
                sock.close()
            except OSError:
                pass
        self._conns = {}

    def _note_gone(self, reason: str) -> None:
        with self._lock:
            if not self._gone:
                self._gone, self._gone_at = reason, time.monotonic()
        log.info("switchagg: rank %d: %s", self.rank, reason)

    def _relay(self, line: bytes, about: int) -> None:
        """Rank 0 tells the other ranks what it saw of rank ``about`` (best effort: non-blocking,
        one short line into an all but empty socket buffer)."""
        for r, sock in self._conns.items():
            if r != about:
                try:
                    sock.send(line)
                except OSError:
                    pass

    def _ended(self, r: int, error: OSError | None) -> None:
        """Rank ``r``'s connection ended (``r`` 0 on the other ranks: rank 0's)."""
        if r in self._said_closed:
            return  # the goodbye was read already
        if error is not None and error.errno == errno.ETIMEDOUT:
            how = (
                f"its host stopped answering (no TCP keepalive answer for ~{self.gone_after:g} s, "
                "SWITCHAGG_TIMEOUT)"
            )
        else:
            how = "its process ended (its liveness connection closed without a goodbye)"
        self._note_gone(f"rank {r} is gone: {how}")
        if self.rank == 0:
            self._relay(GONE + b" %d\n" % r, r)

    def _line(self, r: int, line: bytes) -> None:
        """``closed R CALLS`` (from R itself, or relayed by rank 0) or ``gone R`` (relayed)."""
        words = line.split()
        if len(words) < 2 or not all(w.isdigit() for w in words[1:3]):
            return
        about = int(words[1])
        if words[0] == CLOSED and len(words) == 3:
            if about == r:
                self._said_closed.add(r)
            with self._lock:
                self._closed_after.setdefault(about, int(words[2]))
            log.info(
                "switchagg: rank %d: rank %d closed its group after %d calls", self.rank, about, int(words[2])
            )
            if self.rank == 0 and about == r:
                self._relay(line + b"\n", r)
        elif words[0] == GONE and self.rank != 0:
            self._note_gone(
                f"rank {about} is gone: its process ended (rank 0 saw its liveness connection end)"
            )

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            sel.register(self._wake_r, selectors.EVENT_READ, -1)
            for r, sock in self._conns.items():
                sel.register(sock, selectors.EVENT_READ, r)
            while not self._closed:
                timeout = None
                with self._lock:
                    if self._gone and not self._fired and self._pending:
                        timeout = max(0.0, self._gone_at + self.grace - time.monotonic())
                for key, _ in sel.select(timeout):
                    r = key.data
                    if r == -1:
                        try:
                            self._wake_r.recv(4096)
                        except OSError:
                            pass
                        continue
                    self._read(sel, r, key.fileobj)  # type: ignore[arg-type]
                self._maybe_fire()
        except (OSError, ValueError):  # the sockets were closed under us by close()
            pass
        finally:
            sel.close()

    def _read(self, sel: selectors.BaseSelector, r: int, sock: socket.socket) -> None:
        error: OSError | None = None
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError as e:
            data, error = b"", e
        if data:
            buffer = self._buffers.get(r, b"") + data
            *lines, rest = buffer.split(b"\n")
            self._buffers[r] = rest[-64:]
            for line in lines:
                self._line(r, line.strip())
            return
        sel.unregister(sock)
        self._ended(r, error)

    def _due(self) -> str:
        """Why the calls in flight cannot complete, or "" (called with the lock held)."""
        if self._fired or not self._pending:
            return ""
        if self._gone and time.monotonic() >= self._gone_at + self.grace:
            return self._gone
        last = max(self._pending)
        for r, calls in sorted(self._closed_after.items()):
            if last >= calls:  # a call that rank never made: it cannot complete
                return (
                    f"rank {r} closed its switchagg process group after {calls} network calls "
                    f"(this is call {last + 1})"
                )
        return ""

    def _maybe_fire(self) -> None:
        with self._lock:
            reason = self._due()
            if reason:
                self._fired = True
        if reason:
            log.warning("switchagg: rank %d gives up its network calls: %s", self.rank, reason)
            self._on_gone(reason)
