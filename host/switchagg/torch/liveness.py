"""Which peers are alive: heartbeats in the c10d store, so that a call waits for a slow live peer up to
the process group's timeout but fails within SWITCHAGG_TIMEOUT when a peer is gone (docs/TORCH.md).

Every rank of a group bumps its own counter in the group's store every ``interval`` seconds from a
daemon thread, on a connection of its own (``Store.clone()``), and reads its peers' counters. A peer
whose counter has not moved for ``gone_after`` seconds (measured on this rank's clock: no clocks are
compared across hosts), that wrote ``closed``, or a store that cannot be reached for that long, ends the
network calls in flight through ``on_gone(reason)``; the reason names the rank. Nothing is acted on
while no call is in flight, so an idle group is never failed, but a call begun after a peer went fails
at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger("switchagg.torch")

CLOSED = "closed"
KEY = "switchagg/alive/"


def _own_connection(store: dist.Store, timeout: float) -> dist.Store:
    """A connection of its own, so a long blocking get() of the main thread does not stall the beats."""
    try:
        clone: dist.Store = store.clone()  # type: ignore[attr-defined]  # not in the stubs
    except Exception:  # noqa: BLE001 (stores without clone(): share the caller's; TCPStore ops are locked)
        return store
    try:
        clone.set_timeout(timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001
        pass
    return clone


class PeerWatch:
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        gone_after: float,
        on_gone: Callable[[str], None],
        what: str = "the c10d store",
    ) -> None:
        self.rank, self.size, self.gone_after = rank, size, gone_after
        self.interval = min(1.0, gone_after / 4)
        self._on_gone = on_gone
        self._what = what
        self._store = _own_connection(store, max(gone_after, 1.0))
        self._beat = 0
        self._keys = [f"{KEY}{r}" for r in range(size)]
        # Published before the data plane's start-up exchange, so every key exists once the group is up
        # (multi_get on a missing key would block).
        self._store.set(self._keys[rank], "0")
        self._in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fired = False
        self._thread: threading.Thread | None = None

    def start(self) -> PeerWatch:
        self._thread = threading.Thread(target=self._run, name="switchagg-peers", daemon=True)
        self._thread.start()
        return self

    def track(self, pending: Any) -> None:
        """A network call is in flight until ``pending`` (a concurrent.futures.Future) is done."""
        with self._lock:
            self._in_flight += 1
        pending.add_done_callback(self._done)

    def _done(self, _: Any) -> None:
        with self._lock:
            self._in_flight -= 1

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._in_flight > 0

    def close(self) -> None:
        """Stop beating; the peers read ``closed`` (best effort: the store may be gone)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)
        try:
            self._store.set(self._keys[self.rank], CLOSED)
        except Exception:  # noqa: BLE001
            pass

    def _run(self) -> None:
        now = time.monotonic()
        seen: dict[int, tuple[bytes, float]] = {r: (b"", now) for r in range(self.size) if r != self.rank}
        store_ok = now
        store_error = ""
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                self._beat += 1
                self._store.set(self._keys[self.rank], str(self._beat))
                values = self._store.multi_get(self._keys)
                store_ok = now
            except Exception as e:  # noqa: BLE001 (the store's host is gone, or slow: judged below)
                store_error = str(e).splitlines()[0] if str(e) else type(e).__name__
                values = []
            reason = ""
            for r, value in enumerate(values):
                if r == self.rank:
                    continue
                last, since = seen[r]
                if value != last:
                    seen[r] = (value, now)
                    since = now
                if value == CLOSED.encode():
                    reason = reason or f"rank {r} closed its switchagg process group"
                elif now - since > self.gone_after:
                    reason = reason or (
                        f"rank {r} is gone: its heartbeat in {self._what} has not moved for "
                        f"{now - since:.1f} s (SWITCHAGG_TIMEOUT={self.gone_after:g})"
                    )
            if not values and now - store_ok > self.gone_after:
                reason = (
                    f"{self._what} has been unreachable for {now - store_ok:.1f} s ({store_error}): the "
                    "process serving it (rank 0, or torchrun's agent) is gone"
                )
            if reason and self.busy and not self._fired:
                self._fired = True
                log.warning("switchagg: rank %d gives up its network calls: %s", self.rank, reason)
                self._on_gone(reason)
