"""Seeded inputs that every process can rebuild, and the checks of allreduce results against them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from switchagg import protocol


def inputs(job: int, rank: int, size: int, dtype: str, seed: int) -> np.ndarray:
    """Rank ``rank``'s tensor; int32 values are large enough that sums of 8 wrap around."""
    rng = np.random.default_rng([seed, job, rank])
    if dtype == "int32":
        return rng.integers(-(2**28), 2**28, size, dtype=np.int32)
    return (rng.standard_normal(size) * (rank + 1)).astype(np.float32)


def result_file(out: Path, job: int, rank: int) -> Path:
    return out / f"job{job}_rank{rank}.npz"


def block_exponents(peak: np.ndarray, per_packet: int, bits: int = 32) -> np.ndarray:
    """Per element, the exponent field of its block as the C worker computes it (the block's largest
    |value|: ``peak`` holds the ranks' largest per element): a block is a packet's ``per_packet`` values
    in 32-bit lanes, SCALE_BLOCK values within a packet in narrow lanes. Packets count from the start
    (a staged or striped call's pieces are whole packets)."""
    peak = np.abs(np.asarray(peak, np.float32)).reshape(-1)
    if peak.size == 0:
        return np.zeros(0, np.int64)
    block = per_packet if bits == 32 else protocol.SCALE_BLOCK
    index = np.arange(peak.size)
    ids = (index // per_packet) * -(-per_packet // block) + (index % per_packet) // block
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    top = np.maximum.reduceat(peak, starts)
    frac, e = np.frexp(top)
    e = np.clip(np.where(frac == 0.5, e - 1, e), -126, protocol.EXP_TOP)  # 2^(e-1) holds a power of 2
    e = np.where(top == 0, protocol.EXP_NONE, np.where(np.isfinite(top), e, protocol.EXP_NONFINITE))
    return np.repeat(e, np.diff(np.r_[starts, peak.size]))


def float_bound(xs: list[np.ndarray], k: int, bits: int = 32) -> np.ndarray:
    """protocol.lane_error_bound per element: E is the block's max exponent over all ranks' inputs, a block
    being a packet's values (32-bit lanes) or SCALE_BLOCK values within a packet (narrow lanes)."""
    peak = np.max([np.abs(x) for x in xs], axis=0)
    fields, where = np.unique(
        block_exponents(peak, protocol.lanes_per_packet(k, bits), bits), return_inverse=True
    )
    return np.array([protocol.lane_error_bound(len(xs), int(e), bits) for e in fields])[where]


def dtype_bits(spec: str) -> tuple[str, int]:
    """A tensor spec's dtype and lane width: "float32/16" is float32 in 16-bit lanes, "int32" 32-bit."""
    dtype, _, bits = spec.partition("/")
    return dtype, int(bits or 32)


def check_results(
    job: int, n: int, k: int, tensors: list[tuple[str, int]], out: Path, seed: int = 0
) -> list[dict[str, int]]:
    """Asserts every rank holds the exact int32 sum (float32: within the documented bound, and the
    same bits on every rank); returns each rank's session stats."""
    files = [np.load(result_file(out, job, r)) for r in range(n)]
    for i, (spec, size) in enumerate(tensors):
        dtype, bits = dtype_bits(spec)
        xs = [inputs(job, r, size, dtype, seed + i) for r in range(n)]
        if dtype == "int32":
            want = np.sum([x.astype(np.int64) for x in xs], axis=0).astype(np.int32)  # wraps like int32
        else:
            exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
            bound = float_bound(xs, k, bits)
        for r in range(n):
            got = files[r][f"t{i}"]
            where = f"job {job} rank {r} tensor {i} ({spec}, {size})"
            if dtype == "int32":
                assert np.array_equal(got, want), f"{where}: int32 sum differs"
            else:
                bad = np.abs(got.astype(np.float64) - exact) > bound
                assert not bad.any(), f"{where}: {int(bad.sum())} elements off the bound"
                assert np.array_equal(got, files[0][f"t{i}"]), f"{where}: differs from rank 0's bits"
    return [json.loads(str(f["stats"])) for f in files]


def hello_rounds(stats: Sequence[Mapping[str, int]]) -> int:
    """The rounds of the sessions' hello (docs/PROTOCOL.md, Sessions) in a job's counters: every rank
    ran the same ones (they saw the same rounds), each round one contribution per rank."""
    rounds = {s["hello_rounds"] for s in stats}
    assert len(rounds) == 1, f"the ranks' hellos differ: {rounds}"
    return rounds.pop()


def hello_slots(rounds: int, slot_count: int) -> list[int]:
    """The job's slot (offset from its base) of each of a hello's ``rounds`` rounds: round k on k mod W,
    then the last, in the session's own incarnation, on the first slot (docs/PROTOCOL.md, Sessions)."""
    return [k % slot_count for k in range(rounds - 1)] + [0]
