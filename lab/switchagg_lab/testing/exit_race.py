"""A torchrun script that leaves while gloo's worker threads may still be freeing Python tensors.

Many async all_reduces whose tensors and works Python drops at once, a barrier (gloo frees the
works still in flight when it began in a worker thread, after it completes), then a normal exit
with the GIL kept (no switch on request). Without switchagg.torch.leaving.settle a rank then
sometimes aborts at exit with "terminate called without an active exception" (docs/TORCH.md,
Leaving the process, has the rates); ``--no-settle`` unregisters it to show that.

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
SIZE = 2000


def main() -> int:
    if "--no-settle" in sys.argv[1:]:
        atexit.unregister(leaving.settle)
    dist.init_process_group("gloo")
    for _ in range(CALLS):
        dist.all_reduce(torch.ones(SIZE), async_op=True)  # the tensor and the work dropped at once
    dist.barrier()
    # Keep the GIL until exit (no switch on request): a gloo thread that is to free a tensor now
    # waits for it until the interpreter finalizes, unless something at exit releases it.
    sys.setswitchinterval(100.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
