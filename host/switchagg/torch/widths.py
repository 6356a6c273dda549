"""Which lanes a torch call travels in (docs/TORCH.md, Lane widths), and how that reads in messages.

A float tensor may travel in 32-, 16- or 8-bit lanes (docs/PROTOCOL.md, Narrow lanes). Unless told
(SWITCHAGG_WIRE_BITS, the hook's ``bits``), each dtype travels in the lanes of its own width: float32
in 32-bit lanes, bfloat16 and float16 in 16-bit lanes, so that no value takes more bytes on the wire
than in memory. int32 is summed exactly, always in 32-bit lanes.
"""

from __future__ import annotations

import torch

from switchagg import protocol

# The lanes of each float dtype when nothing says otherwise.
DEFAULT_BITS = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}


def lane_bits(dtype: torch.dtype, chosen: int | None = None) -> int:
    """The lane width of a call of ``dtype``: ``chosen`` (SWITCHAGG_WIRE_BITS or the hook's ``bits``)
    for a float dtype if given, else the dtype's own width; 32 for int32 (exact sums only)."""
    if dtype not in DEFAULT_BITS:
        return 32
    if chosen is None:
        return DEFAULT_BITS[dtype]
    return checked(chosen, "bits")


def checked(bits: int, what: str) -> int:
    """``bits`` if it is a lane width, else a ValueError naming ``what``."""
    if bits not in protocol.WIRE_BITS:
        widths = ", ".join(map(str, protocol.WIRE_BITS))
        raise ValueError(f"{what}={bits!r}: lanes are {widths} bits wide")
    return bits


def in_lanes(bits: int) -> str:
    """How a call's width reads after its description: nothing for 32-bit lanes, the plain case."""
    return "" if bits == 32 else f" in {bits}-bit lanes"


def feedback_default(bits: int) -> bool:
    """Error feedback unless told: on for 8-bit lanes (whose rounding is coarse), off otherwise."""
    return bits == 8


def lane_bytes(stats: dict[str, int]) -> dict[str, int]:
    """Datagram bytes of completed calls per lane width, from a session's (or lanes') stats():
    ``{"lanes32": ..., "lanes16": ..., "lanes8": ...}``."""
    return {f"lanes{b}": int(stats.get(f"bytes_lanes{b}", 0)) for b in protocol.WIRE_BITS}
