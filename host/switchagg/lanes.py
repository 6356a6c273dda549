"""Several calls of one group on the wire at once: L lanes, each an independent call stream.

A lane is a whole Session of its own (its own worker socket, slot range, call numbering and result
key: on the aggregator, a job of its own), run on its own thread. Lanes carry whole calls, where
striping's shards carry parts of one: call i of the group, in issue order, goes to lane i mod L, so
every rank that issues the same calls in the same order puts each one on the same lane with the
same call number there, and the call identity checks (docs/PROTOCOL.md, Call identity) work per
lane as they do per session. Calls on different lanes overlap; calls on one lane run in order.

A call that fails on any lane (a mismatch, an abort, a timeout, a cancel) cancels every other lane
of this rank, so the group fails as a single session does: every later call raises at once.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any

from switchagg.errors import SwitchaggAborted, SwitchaggError, cause_of
from switchagg.session import Session

# Lanes a group may have ($SWITCHAGG_LANES is checked against it).
MAX_LANES = 16
# Slots a lane needs at least (a slot's next round waits for its previous result: one slot would
# leave nothing in flight while a result travels back).
MIN_LANE_SLOTS = 2


def lane_slots(window: int, lanes: int) -> int:
    """Each lane's slot count when a job's window of ``window`` slots is split over ``lanes``:
    ceil(window / lanes), at least MIN_LANE_SLOTS (as striping splits it over shards)."""
    if lanes < 1 or window < 1:
        raise ValueError(f"lane_slots needs lanes >= 1 and window >= 1 (got {lanes}, {window})")
    return max(MIN_LANE_SLOTS, -(-window // lanes))


class Lanes:
    """Sessions of one group, one per lane, that take the group's calls in turn.

    ``allreduce_async`` is the only way calls enter (``allreduce`` waits for it), so the lane of a
    call depends only on how many calls this rank issued before it."""

    def __init__(self, sessions: Sequence[Session]) -> None:
        if not sessions:
            raise ValueError("Lanes needs at least one session")
        self.sessions = list(sessions)
        self._issue = threading.Lock()
        self._issued = 0
        self._failed = False

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def k(self) -> int:
        return self.sessions[0].k

    def values_per_packet(self, bits: int = 32) -> int:
        return self.sessions[0].values_per_packet(bits)

    @property
    def issued(self) -> int:
        """Calls issued so far on this rank (the next one goes to lane ``issued % len(self)``)."""
        return self._issued

    def allreduce_async(
        self,
        tensor: Any,
        ready: Callable[[], object] | None = None,
        tag: int = 0,
        bits: int = 32,
        residual: Any = None,
    ) -> concurrent.futures.Future[None]:
        """Session.allreduce_async on the next lane. A call refused for its argument (TypeError) still
        takes its lane's turn: the session aborts it on every rank, which the peers' same call meets."""
        with self._issue:
            lane = self._issued % len(self.sessions)
            self._issued += 1
            try:
                pending = self.sessions[lane].allreduce_async(tensor, ready, tag, bits, residual)
            except BaseException:
                self._fail(lane, "a call was refused", SwitchaggAborted)
                raise
        if len(self.sessions) > 1:
            pending.add_done_callback(lambda done: self._check(lane, done))
        return pending

    def allreduce(self, tensor: Any) -> None:
        self.allreduce_async(tensor).result()

    def _check(self, lane: int, done: concurrent.futures.Future[None]) -> None:
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            self._fail(lane, f"{type(error).__name__}: {error}", cause_of(error))

    def _fail(self, lane: int, what: str, cause: type[SwitchaggError]) -> None:
        """Every other lane ends its call in progress and refuses later ones (the peers do the same when
        they see the failure), so no lane goes on alone with the group out of step; their calls raise the
        same class as the failure (a mismatch on one lane is a mismatch on all)."""
        if self._failed or len(self.sessions) == 1:
            return
        self._failed = True
        reason = f"lane {lane} of {len(self.sessions)} failed: {what}"
        for other, session in enumerate(self.sessions):
            if other != lane:
                session.cancel(reason, cause)

    def cancel(self, reason: str, cause: type[SwitchaggError] = SwitchaggError) -> None:
        """From any thread: end every lane's call in progress and refuse every later call (raising
        ``cause``, see Session.cancel)."""
        for session in self.sessions:
            session.cancel(reason, cause)

    def stats(self) -> dict[str, int]:
        """The lanes' packet and call counters, summed (``allreduces``: the group's calls)."""
        total: dict[str, int] = {}
        for session in self.sessions:
            for name, value in session.stats().items():
                total[name] = total.get(name, 0) + value
        return total

    def close(self) -> None:
        for session in self.sessions:
            session.close()
