"""A job striped across several aggregation nodes (docs/PROTOCOL.md, Striping).

Every tensor is cut into M contiguous shards on chunk boundaries; shard s is an independent call
stream on its own node (its own socket, call numbers, slots, result key and pinned addresses), so
loss recovery, call identity and the result key work per node exactly as with one aggregator. A
Session with several shards drives one C worker per shard at once (each releases the GIL) and
fails the whole call, on every rank, when any shard fails, naming the shard.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from switchagg import _core
from switchagg.errors import cause_of
from switchagg.keys import digest32


@dataclass(frozen=True)
class Shard:
    """Where one shard of a striped job is aggregated. ``job`` None: the session's job id."""

    aggregator: tuple[str, int]
    slot_base: int
    slot_count: int
    key: int = 0
    job: int | None = None
    node: str = ""  # the reducer's name, when the job service placed it (error messages)


def shard_bounds(length: int, k: int, shards: int) -> list[tuple[int, int]]:
    """The element range [lo, hi) of each shard of a tensor of ``length`` elements cut into chunks
    of ``k``: shard s owns chunks ceil(s*C/M) .. ceil((s+1)*C/M)-1 of the C = ceil(length/k)
    chunks (contiguous, whole chunks, sizes within one chunk of each other, the larger first; the
    last shards are empty when C < M). Every rank computes the same ranges from the length alone."""
    if shards < 1 or k < 1 or length < 0:
        raise ValueError(f"shard_bounds needs shards >= 1, k >= 1, length >= 0 (got {shards}, {k}, {length})")
    chunks = -(-length // k)
    edges = [min(length, k * -(-s * chunks // shards)) for s in range(shards + 1)]
    return [(edges[s], edges[s + 1]) for s in range(shards)]


def shard_key(key: int, index: int) -> int:
    """Shard ``index``'s result key from the job's: shard 0 keeps the job's key, the others get a
    non-zero 32-bit hash of it (0 stays 0: an unkeyed job)."""
    if key == 0 or index == 0:
        return key
    return digest32(f"{key}:{index}")


class ShardFailure(Exception):
    """Carries the first failing shard and its exception out of a striped call."""


# Which failure of a striped call says why it failed: the aggregator's verdict first (calls differed, a
# rank gave up), then a peer or the job gone, then a timeout; a shard cancelled because another failed last.
_ROOT_ORDER: tuple[type[BaseException], ...] = (
    _core.SwitchaggMismatch,
    _core.SwitchaggAborted,
    _core.SwitchaggPeerGone,
    _core.SwitchaggTeardown,
    _core.SwitchaggTimeout,
)


def _rank(failure: tuple[int, BaseException, bool]) -> tuple[int, int]:
    _, e, secondary = failure
    order = next((i for i, cls in enumerate(_ROOT_ORDER) if isinstance(e, cls)), len(_ROOT_ORDER))
    return (1 if secondary else 0, order)


class Stripes:
    """Runs one call per shard concurrently: shard 0 on the caller's thread, the others on a pool
    of M-1 threads. The first shard to fail cancels the others' calls in progress (and so their
    later calls: the session is out of step once any shard is), with its error's class. The error
    raised is the root cause's (the aggregator's mismatch verdict over a timeout, a shard's own
    failure over one this rank cancelled), of the same type, naming the shard and the whole call."""

    def __init__(self, workers: Sequence[_core.Worker], names: Sequence[str]) -> None:
        self.workers, self.names = list(workers), list(names)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(1, len(self.workers) - 1), thread_name_prefix="switchagg-shard"
        )

    def run(self, call: Callable[[int, _core.Worker], None], what: str = "") -> None:
        """``what``: the whole call in the caller's terms (e.g. its element count), for the error."""
        lock = threading.Lock()
        failures: list[tuple[int, BaseException, bool]] = []  # shard, error, caused by this rank's cancel

        def one(s: int) -> None:
            try:
                call(s, self.workers[s])
            except BaseException as e:
                with lock:
                    failures.append((s, e, bool(failures)))
                    if len(failures) > 1:
                        return
                for other, w in enumerate(self.workers):
                    if other != s:
                        w.cancel(f"shard {s} of this call failed ({self.names[s]})", cause_of(e))

        futures = [self._pool.submit(one, s) for s in range(1, len(self.workers))]
        one(0)
        concurrent.futures.wait(futures)
        if failures:
            s, e, _ = min(failures, key=_rank)
            if isinstance(e, _core.SwitchaggError):
                whole = f", in a call of {what}" if what else ""
                raise type(e)(
                    f"shard {s} of {len(self.workers)} ({self.names[s]}){whole} (lengths below are the "
                    f"shard's): {e}"
                ) from e
            raise e

    def close(self) -> None:
        self._pool.shutdown(wait=True)
