"""Train an MLP on scikit-learn's handwritten digits with DDP, summing gradients through switchagg.

    torchrun --nproc-per-node 4 examples/train_digits.py --backend switchagg

--backend gloo:      plain DDP on gloo (the reference)
--backend switchagg: init_process_group("switchagg"): DDP's allreduces go through the network
--backend hook:      gloo process group, gradients summed by switchagg.torch.allreduce_hook
Same seed, same data order and same initial weights for all three, so their accuracies compare.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel as DDP

import switchagg.torch as satorch

BACKENDS = ("gloo", "switchagg", "hook")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="switchagg")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="rank 0 writes the per-epoch metrics here")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.hidden < 1 or args.lr <= 0:
        p.error("--epochs, --batch-size, --hidden and --lr must be positive")
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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("switchagg" if args.backend == "switchagg" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    model = DDP(make_model(args.hidden))
    state = None
    if args.backend == "hook":
        state = satorch.SwitchaggHookState()
        model.register_comm_hook(state, satorch.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # Every rank draws the same permutation and takes its own stride of it (a DistributedSampler
    # without the padding); all ranks run the same number of steps.
    steps = len(x_tr) // (args.batch_size * world)
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
                f"[{args.backend}] epoch {record['epoch']:3d}  loss {record['loss']:.4f}  "
                f"test accuracy {100 * accuracy:6.2f}%  step {record['step_ms']:.2f} ms",
                flush=True,
            )
    # Every rank reports, so that a launcher with one log per rank (docker/) shows each outcome.
    last = history[-1]
    print(
        f"[{args.backend}] rank {rank}/{world} final: loss {last['loss']:.4f}  "
        f"test accuracy {100 * last['accuracy']:.2f}%  data plane {data_plane(args.backend, state)}",
        flush=True,
    )
    if rank == 0 and args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"backend": args.backend, "world_size": world, "history": history}, f)
    # Rank 0 may host the embedded aggregator: nobody leaves before everybody is done with it.
    dist.barrier()
    if state is not None:
        state.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
