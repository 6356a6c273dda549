"""The error bound of a network allreduce per dtype (docs/TORCH.md, Precision).

bfloat16 and float16 tensors travel as float32 (exact in it), are summed within the float32 bound of
docs/PROTOCOL.md (``protocol.error_bound(n, E)``, E the block's largest exponent over the ranks) and
rounded back once; AVG divides the float32 sum by n before that rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from switchagg import protocol

# Round to nearest: half an ulp, relative (the unit roundoff), and half the smallest subnormal, absolute.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
HALF_SUBNORMAL = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}


def error_bound(dtype: torch.dtype, n: int, e_max: Any, exact: Any, average: bool = False) -> Any:
    """Bound on |result - exact| for one element (or a numpy array of them): ``exact`` is the exact
    sum of the ranks' values (their mean with ``average``), ``e_max`` the block's exponent field
    (``protocol.error_bound`` for the float32 sum; numpy arrays of both work element by element)."""
    e = np.asarray(e_max)
    bound: Any = n * np.exp2(np.where(e >= protocol.EXP_TOP, 128, e) - 22.0)
    if average:  # the float32 sum's bound scaled, plus the float32 division's rounding
        bound = bound / n + UNIT_ROUNDOFF[torch.float32] * (abs(exact) + bound / n)
    if dtype == torch.float32:
        return bound + HALF_SUBNORMAL[dtype]
    u = UNIT_ROUNDOFF[dtype]
    return bound + u * (abs(exact) + bound) + HALF_SUBNORMAL[dtype]
