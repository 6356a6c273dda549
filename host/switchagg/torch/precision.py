"""The error bound of a network allreduce per dtype and lane width (docs/TORCH.md, Precision).

bfloat16 and float16 tensors are converted to float32 (exact in it), summed in lanes of 32, 16 or 8 bits
within the bound of docs/PROTOCOL.md (``protocol.lane_error_bound(n, E, bits)``, E the largest exponent
over the ranks of the element's block: its packet of K values in 32-bit lanes, its 32 values within a
packet in narrow lanes) and rounded back once; AVG divides the float32 sum by n before that rounding.
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
    sum of the ranks' values (their mean with ``average``), ``e_max`` the exponent field of the
    element's block over the ranks, ``bits`` the lanes (``protocol.lane_error_bound`` for the float32
    sum; numpy arrays of both work element by element)."""
    fields, where = np.unique(np.asarray(e_max), return_inverse=True)
    sums = np.array([protocol.lane_error_bound(n, int(e), bits) for e in fields])
    bound: Any = sums[where].reshape(np.shape(e_max))
    if average:  # the float32 sum's bound scaled, plus the float32 division's rounding
        bound = bound / n + UNIT_ROUNDOFF[torch.float32] * (abs(exact) + bound / n)
    if dtype == torch.float32:
        return bound + HALF_SUBNORMAL[dtype]
    u = UNIT_ROUNDOFF[dtype]
    return bound + u * (abs(exact) + bound) + HALF_SUBNORMAL[dtype]
