"""Train an MLP on scikit-learn's handwritten digits with DDP, summing gradients through switchagg.

    torchrun --nproc-per-node 4 examples/train_digits.py --backend switchagg

--backend gloo:      plain DDP on gloo (the reference)
  --hook fp16:       ... with torch's fp16_compress_hook (gradients cast to float16 for gloo's ring)
  --hook powersgd:   ... with torch's powerSGD_hook (rank --powersgd-rank, error feedback, warm start)
--backend switchagg: init_process_group("switchagg"): DDP's allreduces go through the network
--backend hook:      gloo process group, gradients summed by switchagg.torch.allreduce_hook
  --bits 32|16|8:    the lane width of the switchagg paths (the hook's bits=; the backend's
                     SWITCHAGG_WIRE_BITS); error feedback is the hook's default for the width
                     (on at 8 bits) unless --error-feedback on|off says
Same seed, same data order and same initial weights for all of them, so their accuracies compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP

import switchagg.torch as satorch

BACKENDS = ("gloo", "switchagg", "hook")
TORCH_HOOKS = ("none", "fp16", "powersgd")  # gloo's: torch's own DDP comm hooks
WIRE_BITS = (32, 16, 8)


def method(args: argparse.Namespace) -> str:
    """A short name of how the gradients are summed: gloo, gloo+fp16, gloo+powersgd, hook16, ..."""
    if args.backend == "gloo":
        return "gloo" if args.hook == "none" else f"gloo+{args.hook}"
    bits = args.bits if args.bits is not None else int(os.environ.get("SWITCHAGG_WIRE_BITS", "32"))
    return f"{args.backend}{bits}" if bits != 32 else args.backend


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="switchagg")
    p.add_argument("--hook", choices=TORCH_HOOKS, default="none", help="torch's comm hook (gloo only)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD's matrix_approximation_rank")
    p.add_argument(
        "--powersgd-start",
        type=int,
        help="PowerSGD's start_powerSGD_iter (default: 10%% of all steps, as torch advises; at least 2)",
    )
    p.add_argument(
        "--bits",
        type=int,
        choices=WIRE_BITS,
        help="switchagg's float32 lane width (default: SWITCHAGG_WIRE_BITS, else 32)",
    )
    p.add_argument(
        "--error-feedback", choices=("default", "on", "off"), default="default", help="the hook's (switchagg)"
    )
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        help="DDP's bucket_cap_mb (default torch's: a 1 MiB first bucket, then 25 MiB); one bucket "
        "for the whole gradient keeps torch 2.13's powerSGD_hook on gloo from deadlocking",
    )
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="rank 0 writes the per-epoch metrics here")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.hidden < 1 or args.lr <= 0:
        p.error("--epochs, --batch-size, --hidden and --lr must be positive")
    if args.hook != "none" and args.backend != "gloo":
        p.error("--hook is torch's comm hook on gloo: use it with --backend gloo")
    if args.backend == "gloo" and (args.bits is not None or args.error_feedback != "default"):
        p.error("--bits and --error-feedback are switchagg's: use them with --backend switchagg or hook")
    if args.backend == "switchagg" and args.error_feedback != "default":
        p.error("--error-feedback is the hook's: use it with --backend hook")
    return args


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return x_tr, y_tr, x_te, y_te


def make_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def data_plane(backend: str, state: satorch.SwitchaggHookState | None) -> str:
    """Where this rank's gradients were summed: the job service's answer (p4 or software)."""
    if backend == "gloo":
        return "gloo ring"
    if state is not None:
        plane = state.plane
    else:
        plane = satorch.backend_of().data_plane
    if plane is None:
        return "closed"
    session = plane.session
    return f"{session.data_plane} (job {session.job})"


def register_hook(model: DDP, args: argparse.Namespace, steps: int) -> satorch.SwitchaggHookState | None:
    """The comm hook ``args`` ask for: torch's (fp16, PowerSGD) or switchagg's; switchagg's state."""
    if args.hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "powersgd":
        start = args.powersgd_start if args.powersgd_start is not None else steps * args.epochs // 10
        ps_state = powerSGD.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=max(2, start),  # error feedback and warm start need 2 at least
            use_error_feedback=True,
            warm_start=True,
            random_seed=args.seed,
        )
        model.register_comm_hook(ps_state, powerSGD.powerSGD_hook)
    elif args.backend == "hook":
        feedback = None if args.error_feedback == "default" else args.error_feedback == "on"
        state = satorch.SwitchaggHookState(bits=args.bits, error_feedback=feedback)  # None: the defaults
        model.register_comm_hook(state, satorch.allreduce_hook)
        return state
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.backend == "switchagg" and args.bits is not None:  # the backend's float32 lanes
        os.environ["SWITCHAGG_WIRE_BITS"] = str(args.bits)
    dist.init_process_group("switchagg" if args.backend == "switchagg" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    model = DDP(make_model(args.hidden), bucket_cap_mb=args.bucket_cap_mb)
    steps = len(x_tr) // (args.batch_size * world)
    state = register_hook(model, args, steps)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # Every rank draws the same permutation and takes its own stride of it (a DistributedSampler
    # without the padding); all ranks run the same number of steps.
    history = []
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_tr), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        mine = order[rank : steps * args.batch_size * world : world]
        model.train()
        loss_sum = torch.zeros(1)
        step_time = 0.0
        for s in range(steps):
            idx = mine[s * args.batch_size : (s + 1) * args.batch_size]
            start = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()  # DDP sums the gradient buckets here
            opt.step()
            step_time += time.perf_counter() - start
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_te).argmax(1) == y_te).float().mean().item()
        record = {
            "epoch": epoch + 1,
            "loss": loss_sum.item() / (steps * world),
            "accuracy": accuracy,
            "step_ms": 1000 * step_time / steps,
            "train_s": step_time,  # this epoch's steps: what time-to-accuracy adds up
        }
        history.append(record)
        if rank == 0:
            print(
                f"[{method(args)}] epoch {record['epoch']:3d}  loss {record['loss']:.4f}  "
                f"test accuracy {100 * accuracy:6.2f}%  step {record['step_ms']:.2f} ms",
                flush=True,
            )
    # Every rank reports, so that a launcher with one log per rank (docker/) shows each outcome.
    last = history[-1]
    print(
        f"[{method(args)}] rank {rank}/{world} final: loss {last['loss']:.4f}  "
        f"test accuracy {100 * last['accuracy']:.2f}%  data plane {data_plane(args.backend, state)}",
        flush=True,
    )
    if rank == 0 and args.json:
        # switchagg's hook: the datagram bytes this rank sent per lane width (where it counts them)
        lane_bytes = state.stats().get("bytes") if state is not None else None
        report = {"backend": args.backend, "method": method(args), "world_size": world, "history": history}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**report, "lane_bytes": lane_bytes}, f)
    # Rank 0 may host the embedded aggregator: nobody leaves before everybody is done with it.
    dist.barrier()
    if state is not None:
        state.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
