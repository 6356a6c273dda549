"""The identity of a torch-level network call: what every rank must agree on, in the user's terms.

The wire numbers the data plane's calls, but the torch layer cuts a user's call into several (staging:
chunks of a few MB; lanes: chunks on different sessions), so two ranks whose user calls differ can still
send wire calls of the same length and kind (a bfloat16 tensor of 2M elements staged as two chunks
against two float32 calls of 1M). So every wire call of a user's call carries a tag: a digest of the
user's call (op, dtype, each tensor's element count, the lane width) and of which chunk of it this is.
Ranks whose tags differ fail the call on every rank as a mismatch (docs/PROTOCOL.md, Call identity),
never as a sum.

The wire can only say that the tags differed; to say how, each rank, on its group's first mismatch,
writes the descriptions of its recent calls to the c10d store and reads its peers' (a bounded wait),
and the error names the first call whose descriptions differ, per rank.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict

import torch
import torch.distributed as dist

from switchagg.errors import SwitchaggMismatch
from switchagg.keys import digest32
from switchagg.torch.widths import in_lanes

KEY = "switchagg/mismatch/"
# Calls remembered for the explanation: the failed one is among the last few on every rank (a rank
# issues at most a window of calls ahead of the slowest before it waits for a result).
HISTORY = 64
# How long a rank waits for its peers' descriptions, in all, before it explains with what it has (they
# fail the same call within a round trip; the wait covers a loaded machine).
EXPLAIN_WAIT = 10.0


def describe(op: str, tensors: list[torch.Tensor], bits: int = 32) -> str:
    """A user's call as every rank must agree on it, e.g. ``SUM of float32 [1047552]`` or, for a list of
    tensors in 16-bit lanes, ``AVG of bfloat16 [4096, 10] in 16-bit lanes`` (a rank whose
    SWITCHAGG_WIRE_BITS differs is told so)."""
    dtype = str(tensors[0].dtype).removeprefix("torch.")
    return f"{op} of {dtype} [{', '.join(str(t.numel()) for t in tensors)}]{in_lanes(bits)}"


def tag(description: str, chunk: int, chunks: int) -> int:
    """The wire tag of chunk ``chunk`` of ``chunks`` of a call: a non-zero 32-bit digest."""
    return digest32(f"{description}|{chunk}/{chunks}")


class CallIdentity:
    """Numbers one group's network calls on this rank and explains a mismatch in the user's terms."""

    def __init__(self, store: dist.Store, rank: int, size: int, group: str) -> None:
        self.store, self.rank, self.size, self.group = store, rank, size, group
        self._lock = threading.Lock()
        self._index = 0
        self._recent: OrderedDict[int, str] = OrderedDict()
        self._explained: BaseException | None = None

    def next(self, op: str, tensors: list[torch.Tensor], bits: int = 32) -> str:
        """The next call's description, remembered under its number in this group (1, 2, ...). Calls are
        issued in the same order on every rank (as c10d requires), so equal numbers name the same call."""
        description = describe(op, tensors, bits)
        with self._lock:
            self._index += 1
            self._recent[self._index] = description
            while len(self._recent) > HISTORY:
                self._recent.popitem(last=False)
        return description

    def explain(self, error: BaseException) -> BaseException:
        """``error`` as the user should see it: a mismatch restated as which call differed how, per rank
        (the same words on every rank). Only the group's first failure is explained; later ones (a
        session fails every call after its first failure) get the same explanation."""
        if not isinstance(error, SwitchaggMismatch):
            return error
        with self._lock:
            if self._explained is None:
                self._explained = SwitchaggMismatch(self._compare(error))
            first = self._explained
        return type(first)(str(first))

    def _compare(self, error: BaseException) -> str:
        mine = dict(self._recent)
        try:
            self.store.set(f"{KEY}{self.rank}", json.dumps(mine))
            said = self._gather(f"{KEY}", time.monotonic() + EXPLAIN_WAIT)
            calls = {r: {int(i): d for i, d in json.loads(v).items()} for r, v in said.items()}
        except Exception as e:  # noqa: BLE001 (the store is gone: say what the wire said)
            return f"{error} (the ranks' calls could not be compared through the c10d store: {e})"
        try:  # nobody leaves (the store's host may be one of us) before everyone who spoke has read
            self.store.set(f"{KEY}read/{self.rank}", "1")
            self._gather(f"{KEY}read/", time.monotonic() + EXPLAIN_WAIT, wanted=set(said))
        except Exception:  # noqa: BLE001 (the last to read found the store's host gone: it has read)
            pass
        missing = [r for r in range(self.size) if r not in calls]
        lowest = max(min(c) for c in calls.values() if c) if all(calls.values()) else 0
        highest = max((max(c) for c in calls.values() if c), default=0)
        for index in range(lowest, highest + 1):
            seen = {r: c.get(index, "no such call") for r, c in sorted(calls.items())}
            if len(set(seen.values())) > 1:
                per_rank = "; ".join(f"rank {r}: {d}" for r, d in seen.items())
                silent = f"; rank(s) {', '.join(map(str, missing))} did not say" if missing else ""
                return (
                    f"network allreduce #{index} of {self.group} differed between ranks, so it failed on "
                    f"every rank and nothing was summed: {per_rank}{silent} (the data plane said: {error})"
                )
        return str(error)  # the descriptions agree: the wire's words are the best there are

    def _gather(self, prefix: str, deadline: float, wanted: set[int] | None = None) -> dict[int, str]:
        """Each rank's value under ``prefix`` (of ``wanted``, default all) that exists by ``deadline``."""
        ranks = sorted(wanted if wanted is not None else range(self.size))
        keys = {r: f"{prefix}{r}" for r in ranks}
        present: list[int] = []
        while True:  # bounded by the deadline
            present = [r for r in ranks if self.store.check([keys[r]])]
            if len(present) == len(ranks) or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        values = self.store.multi_get([keys[r] for r in present]) if present else []
        return {r: v.decode() for r, v in zip(present, values, strict=True)}
