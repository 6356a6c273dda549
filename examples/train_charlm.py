"""Train a small causal transformer on characters with AdamW and DDP, summing gradients through switchagg.

    torchrun --nproc-per-node 4 examples/train_charlm.py --backend hook --bits 8

--backend gloo:      plain DDP on gloo (the float32 reference)
--backend switchagg: init_process_group("switchagg"): DDP's allreduces go through the network
--backend hook:      gloo process group, gradients summed by switchagg.torch.allreduce_hook
  --bits 32|16|8:    the lane width of the switchagg paths (the hook's bits=; the backend's
                     SWITCHAGG_WIRE_BITS); error feedback is the hook's default for the width
                     (on at 8 bits) unless --error-feedback on|off says

The corpus is local text, no download: by default the licences Debian ships in
/usr/share/common-licenses (base-files; the same bytes on every Debian 12), else this repository's
README.md and docs/*.md; --corpus names others. It is cut into 1024-character blocks, every tenth
held out for evaluation. Same seed, same batches and same initial weights for every backend, so their
eval losses compare.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import switchagg.torch as satorch

BACKENDS = ("gloo", "switchagg", "hook")
WIRE_BITS = (32, 16, 8)
LICENSES = Path("/usr/share/common-licenses")
REPO = Path(__file__).resolve().parents[1]
BLOCK = 1024  # characters; every EVAL_EVERY-th block is held out
EVAL_EVERY = 10


def default_corpus() -> list[Path]:
    if LICENSES.is_dir():
        files = sorted(p for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink())
        if files:
            return files
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="hook")
    p.add_argument(
        "--bits",
        type=int,
        choices=WIRE_BITS,
        help="switchagg's float32 lanes (default: SWITCHAGG_WIRE_BITS, else 32)",
    )
    p.add_argument("--error-feedback", choices=("default", "on", "off"), default="default", help="the hook's")
    p.add_argument("--corpus", type=Path, nargs="+", help="text files (default: see above)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64, help="the model's width (d_model)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64, help="characters per sequence")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    p.add_argument(
        "--warmup", type=int, default=30, help="steps of linear warm-up, then cosine decay to 10%%"
    )
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations (and the last)")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out sequences per evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="rank 0 writes the evaluations here")
    args = p.parse_args(argv)
    if min(args.layers, args.width, args.heads, args.context, args.batch_size, args.steps) < 1:
        p.error("--layers, --width, --heads, --context, --batch-size and --steps must be positive")
    if args.width % args.heads:
        p.error("--width must be a multiple of --heads")
    if args.backend == "gloo" and (args.bits is not None or args.error_feedback != "default"):
        p.error("--bits and --error-feedback are switchagg's: use them with --backend switchagg or hook")
    if args.backend == "switchagg" and args.error_feedback != "default":
        p.error("--error-feedback is the hook's: use it with --backend hook")
    return args


def method(args: argparse.Namespace) -> str:
    bits = args.bits if args.bits is not None else int(os.environ.get("SWITCHAGG_WIRE_BITS", "32"))
    if args.backend == "gloo":
        return "gloo"
    return f"{args.backend}{bits}" if bits != 32 else args.backend


class Corpus:
    """The characters of the corpus as indices into its sorted alphabet, split into training text
    and held-out blocks."""

    def __init__(self, files: Sequence[Path]) -> None:
        text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        self.chars = len(text)
        self.alphabet = sorted(set(text))
        index = {c: i for i, c in enumerate(self.alphabet)}
        codes = torch.tensor([index[c] for c in text], dtype=torch.int64)
        blocks = list(codes.split(BLOCK))
        self.train = torch.cat([b for i, b in enumerate(blocks) if i % EVAL_EVERY != EVAL_EVERY - 1])
        self.held_out = [b for i, b in enumerate(blocks) if i % EVAL_EVERY == EVAL_EVERY - 1]

    def batch(self, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences of ``context`` characters from ``starts`` in the training text, and the next ones."""
        rows = torch.stack([self.train[s : s + context + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def eval_windows(self, context: int, limit: int) -> torch.Tensor:
        """Up to ``limit`` non-overlapping sequences of context + 1 characters from the held-out blocks."""
        rows = [
            b[i : i + context + 1] for b in self.held_out for i in range(0, len(b) - context, context + 1)
        ]
        return torch.stack(rows[:limit])


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm blocks, a linear head."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of --lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(model: nn.Module, windows: torch.Tensor, rank: int, world: int) -> float:
    """Mean cross-entropy (nats per character) over ``windows``, each rank a stride of them."""
    model.eval()
    mine = windows[rank::world]
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        if len(mine):
            logits = model(mine[:, :-1])
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1), reduction="sum"
            )
            total += torch.tensor([loss.item(), mine[:, 1:].numel()], dtype=torch.float64)
    dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])


def hook_state(model: DDP, args: argparse.Namespace) -> satorch.SwitchaggHookState | None:
    if args.backend != "hook":
        return None
    feedback = None if args.error_feedback == "default" else args.error_feedback == "on"
    state = satorch.SwitchaggHookState(bits=args.bits, error_feedback=feedback)  # None: the defaults
    model.register_comm_hook(state, satorch.allreduce_hook)
    return state


def train(
    model: DDP, corpus: Corpus, args: argparse.Namespace, rank: int, world: int
) -> list[dict[str, Any]]:
    """--steps AdamW steps; an evaluation at step 0, every --eval-every steps and at the last."""
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices decay; biases, norms do not
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    windows = corpus.eval_windows(args.context, args.eval_windows)
    history = [{"step": 0, "eval_loss": evaluate(model, windows, rank, world), "train_s": 0.0}]
    loss_sum, step_time, since = torch.zeros(1), 0.0, 0
    for step in range(args.steps):
        # Every rank draws the same starts and takes its own stride of them.
        g = torch.Generator().manual_seed(args.seed * 100_003 + step)
        starts = torch.randint(
            0, len(corpus.train) - args.context - 1, (args.batch_size * world,), generator=g
        )
        x, y = corpus.batch(starts[rank::world], args.context)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        begin = time.perf_counter()
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()  # DDP sums the gradient buckets here
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step_time += time.perf_counter() - begin
        loss_sum += loss.detach()
        since += 1
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            dist.all_reduce(loss_sum)
            record = {
                "step": step + 1,
                "train_loss": loss_sum.item() / (since * world),
                "eval_loss": evaluate(model, windows, rank, world),
                "train_s": history[-1]["train_s"] + step_time,  # training time so far
                "step_ms": 1000 * step_time / since,
            }
            history.append(record)
            loss_sum, step_time, since = torch.zeros(1), 0.0, 0
            if rank == 0:
                losses = f"train loss {record['train_loss']:.4f}  eval loss {record['eval_loss']:.4f}"
                print(
                    f"[{method(args)}] step {record['step']:5d}  {losses}  step {record['step_ms']:.1f} ms",
                    flush=True,
                )
    return history


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.backend == "switchagg" and args.bits is not None:  # the backend's float32 lanes
        os.environ["SWITCHAGG_WIRE_BITS"] = str(args.bits)
    dist.init_process_group("switchagg" if args.backend == "switchagg" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = Corpus(args.corpus or default_corpus())
    torch.manual_seed(args.seed)
    net = CharLM(len(corpus.alphabet), args.context, args.width, args.layers, args.heads)
    model = DDP(net)
    state = hook_state(model, args)
    history = train(model, corpus, args, rank, world)
    last = history[-1]
    print(f"[{method(args)}] rank {rank}/{world} final: eval loss {last['eval_loss']:.4f}", flush=True)
    if rank == 0 and args.json:
        report = {
            "backend": args.backend,
            "method": method(args),
            "world_size": world,
            "parameters": sum(p.numel() for p in net.parameters()),
            "corpus": {"chars": corpus.chars, "alphabet": len(corpus.alphabet), "sha256": corpus.sha256},
            "lane_bytes": state.stats().get("bytes") if state is not None else None,
            "history": history,
        }
        Path(args.json).write_text(json.dumps(report), encoding="utf-8")
    # Rank 0 may host the embedded aggregator: nobody leaves before everybody is done with it.
    dist.barrier()
    if state is not None:
        state.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
