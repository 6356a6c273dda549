"""The error bound of a network allreduce per dtype and lane width (docs/TORCH.md, Precision).

bfloat16 and float16 tensors are converted to float32 (exact in it), summed in lanes of 32, 16 or 8 bits
within the bound of docs/PROTOCOL.md (``protocol.lane_error_bound(n, E, bits)``, E the largest exponent
over the ranks of the element's block: its packet of K values in 32-bit lanes, its 32 values in narrow
lanes) and rounded back once; AVG divides the float32 sum by n before that rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from switchagg import protocol

# Round to nearest: half an ulp, relative (the unit roundoff), and half the smallest subnormal, absolute.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
HALF_SUBNORMAL = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}


def error_bound(
    dtype: torch.dtype, n: int, e_max: Any, exact: Any, average: bool = False, bits: int = 32
) -> Any:
    """Bound on |result - exact| for one element (or a numpy array of them): ``exact`` is the exact
    sum of the ranks' values (their mean with ``average``), ``e_max`` the block's exponent field
    (block_exponents), ``bits`` the lanes (``protocol.lane_error_bound`` for the float32 sum; numpy
    arrays of both work element by element)."""
    e = np.asarray(e_max)
    top = np.where(e >= protocol.EXP_TOP, 128, e)
    bound: Any = n * np.exp2(top - 22.0)
    if bits != 32:  # n stochastic roundings of less than a step of 2^E / M each
        bound = bound + n * np.exp2(top.astype(np.float64)) / protocol.lane_limit(n, bits)
    if average:  # the float32 sum's bound scaled, plus the float32 division's rounding
        bound = bound / n + UNIT_ROUNDOFF[torch.float32] * (abs(exact) + bound / n)
    if dtype == torch.float32:
        return bound + HALF_SUBNORMAL[dtype]
    u = UNIT_ROUNDOFF[dtype]
    return bound + u * (abs(exact) + bound) + HALF_SUBNORMAL[dtype]


def block_exponents(peak: Any, per_packet: int, bits: int = 32) -> np.ndarray:
    """Per element, the exponent field of its block (what the C worker computes, over the ranks when
    ``peak`` is the ranks' largest |value| per element): a block is a packet of ``per_packet`` values in
    32-bit lanes, SCALE_BLOCK values within a packet in narrow lanes. A staged call's chunks are whole
    packets, so packets are counted from the tensor's start."""
    peak = np.abs(np.asarray(peak, np.float32)).reshape(-1)
    if peak.size == 0:
        return np.zeros(0, np.int64)
    block = per_packet if bits == 32 else protocol.SCALE_BLOCK
    index = np.arange(peak.size)
    ids = (index // per_packet) * -(-per_packet // block) + (index % per_packet) // block
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    top = np.maximum.reduceat(peak, starts)
    frac, e = np.frexp(top)
    e = np.where(frac == 0.5, e - 1, e)  # an exact power of two needs no extra bit
    e = np.clip(e, -126, protocol.EXP_TOP)
    e = np.where(top == 0, protocol.EXP_NONE, np.where(np.isfinite(top), e, protocol.EXP_NONFINITE))
    return np.repeat(e, np.diff(np.r_[starts, peak.size]))
