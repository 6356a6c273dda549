"""A torchrun script that leaves while gloo's worker threads may still be freeing Python tensors.

Many async all_reduces whose tensors and works Python drops at once, a barrier (gloo frees the
works still in flight when it began in a worker thread, after it completes), then a normal exit.
Without switchagg.torch.leaving.settle a rank then aborts at exit with "terminate called without
an active exception" in about a third of runs (2 ranks, torch 2.13, Python 3.11); ``--no-settle``
unregisters it to show that.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m switchagg_lab.testing.exit_race
"""

from __future__ import annotations

import atexit
import sys

import torch
import torch.distributed as dist

import switchagg.torch  # noqa: F401 (registers leaving.settle at exit)
from switchagg.torch import leaving

CALLS = 300


def main() -> int:
    if "--no-settle" in sys.argv[1:]:
        atexit.unregister(leaving.settle)
    dist.init_process_group("gloo")
    for _ in range(CALLS):
        dist.all_reduce(torch.ones(2000), async_op=True)  # the tensor and the work dropped at once
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
