"""Result keys (docs/PROTOCOL.md, Security): every job has one unless it opts out, by name."""

from __future__ import annotations

import hashlib
import secrets
import warnings

# A job without a result key: its workers take any RESULT from the aggregator's address, so a
# process that takes over that port while the aggregator is down can forge sums. Only by asking.
UNKEYED = 0


def new_key() -> int:
    """A fresh result key for a job: random (``secrets``), 32 bits, non-zero (0 is UNKEYED)."""
    while True:
        key = secrets.randbits(32)
        if key:
            return key


def digest32(text: str) -> int:
    """A non-zero 32-bit digest of ``text`` (blake2s): the keys derived for shards, the tags of calls."""
    return int.from_bytes(hashlib.blake2s(text.encode(), digest_size=4).digest(), "big") or 1


def warn_unkeyed(what: str, stacklevel: int = 3) -> None:
    warnings.warn(
        f"switchagg: {what} is unkeyed (key=UNKEYED): its workers accept any RESULT from the "
        "aggregator's address, so a process that takes over that port while the aggregator is down "
        "can forge sums (docs/PROTOCOL.md, Security)",
        RuntimeWarning,
        stacklevel=stacklevel,
    )
