"""Narrow lanes (docs/PROTOCOL.md, Narrow lanes): float32 calls in 16- and 8-bit lanes with one scale
per 32 values, over real UDP through the software aggregator: the bound, no bias, error feedback,
non-finite blocks, identity and bytes on the wire."""

from __future__ import annotations

import numpy as np
import pytest

from switchagg import Session, SwitchaggError, SwitchaggMismatch, protocol
from switchagg.aggregator import SoftwareAggregator
from switchagg.striping import Shard, shard_key
from switchagg_lab.testing.checks import float_bound
from switchagg_lab.testing.kit import local_sessions, on_every_rank

N = 3


def _inputs(n: int, length: int, seed: int = 0) -> list[np.ndarray]:
    """Values of very different magnitudes from block to block, as gradients have."""
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal(length) * np.exp(rng.uniform(-8, 8, length))).astype(np.float32)
        for _ in range(n)
    ]


def _allreduce(
    sessions: list[Session], xs: list[np.ndarray], bits: int, residuals: list[np.ndarray] | None = None
) -> list[np.ndarray]:
    bufs = [x.copy() for x in xs]
    res: list[np.ndarray | None] = list(residuals) if residuals else [None] * len(xs)
    out = on_every_rank(sessions, lambda r, s: s.allreduce(bufs[r], bits=bits, residual=res[r]))
    assert all(o is None for o in out), out
    return bufs


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("k", [64, 361])
def test_narrow_sums_are_the_same_on_every_rank_and_within_the_bound(
    aggregator: SoftwareAggregator, bits: int, k: int
) -> None:
    sessions = local_sessions(aggregator, N, k=k)
    xs = _inputs(N, 50_011)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    results = _allreduce(sessions, xs, bits)
    assert all(np.array_equal(results[0], r) for r in results[1:])
    err = np.abs(results[0].astype(np.float64) - exact)
    bound = float_bound(xs, k, bits)
    assert np.all(err <= bound), f"worst error {float(np.max(err / bound)):.3f} of the bound"
    # The bound is not slack: the coarser lanes use most of it somewhere.
    assert float(np.max(err / bound)) > 0.3


@pytest.mark.parametrize("bits", [16, 8])
def test_stochastic_rounding_has_no_bias(aggregator: SoftwareAggregator, bits: int) -> None:
    """One block of equal values, rounded 20,000 times: round-to-nearest would be off by the same amount
    every time; stochastic rounding's mean error shrinks as 1/sqrt(count)."""
    sessions = local_sessions(aggregator, N, k=361)
    length = 20_000
    # 1.3 of a step each: never a lane value itself, and the largest value of every block pins its scale.
    xs = [np.full(length, 1.3 / protocol.lane_limit(N, bits), np.float32) for _ in range(N)]
    for x in xs:
        x[:: protocol.SCALE_BLOCK] = 1.0
    results = _allreduce(sessions, xs, bits)
    small = np.ones(length, bool)
    small[:: protocol.SCALE_BLOCK] = False
    got, want = results[0][small].astype(np.float64), N * 1.3 / protocol.lane_limit(N, bits)
    step = 1.0 / protocol.lane_limit(N, bits)  # of one rank's lane; N independent roundings per element
    sigma = np.sqrt(N) * step / 2 / np.sqrt(small.sum())
    assert abs(float(np.mean(got)) - want) < 6 * sigma
    assert np.unique(got).size > 1  # it did round both ways


@pytest.mark.parametrize("bits", [16, 8])
def test_error_feedback_carries_what_rounding_took_into_the_next_call(
    aggregator: SoftwareAggregator, bits: int
) -> None:
    """The same gradient summed T times with error feedback: the sum of the T results misses T times the
    exact sum only by what the ranks' residuals hold at the end (less than a step each), so their mean
    converges as 1/T; without the residual it stays off by one rounding."""
    sessions = local_sessions(aggregator, N, k=361)
    xs = _inputs(N, 5_000, seed=3)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    residuals = [np.zeros_like(x) for x in xs]
    total = np.zeros_like(exact)
    rounds = 40
    for _ in range(rounds):
        total += _allreduce(sessions, xs, bits, residuals)[0]
    bound = float_bound(xs, 361, bits)
    drift = np.abs(total - rounds * exact)
    # Each rank's residual is within one step of its block (2^E / M) whatever the number of rounds; E is
    # that of the input plus the residual, at most one more than the input's (hence 2x the input's bound).
    assert np.all(np.abs(np.stack(residuals)) <= 2 * bound / N)
    assert np.all(drift <= 2 * bound + 1e-6 * rounds * np.abs(exact)), float(np.max(drift / bound))
    single = np.abs(_allreduce(sessions, xs, bits)[0] - exact)
    assert float(np.mean(drift / rounds)) < float(np.mean(single)) / 5


def test_a_nonfinite_value_makes_its_block_nan_on_every_rank(aggregator: SoftwareAggregator) -> None:
    sessions = local_sessions(aggregator, N, k=64)
    xs = [np.ones(1000, np.float32) for _ in range(N)]
    xs[1][70] = np.inf
    results = _allreduce(sessions, xs, 8)
    for r in results:
        block = slice(64, 96)  # value 70 is in the third block of 32
        assert np.all(np.isnan(r[block]))
        rest = np.ones(1000, bool)
        rest[block] = False
        assert np.all(np.abs(r[rest] - N) <= protocol.lane_error_bound(N, 1, 8))


def test_ranks_whose_lanes_differ_fail_on_every_rank(aggregator: SoftwareAggregator) -> None:
    sessions = local_sessions(aggregator, N, k=256)
    xs = _inputs(N, 3000)
    out = on_every_rank(sessions, lambda r, s: s.allreduce(xs[r].copy(), bits=16 if r == 1 else 32))
    assert all(isinstance(o, SwitchaggMismatch) for o in out), out
    assert any("16-bit lanes" in str(o) for o in out), out


def test_narrow_lanes_move_a_half_and_a_quarter_of_the_bytes(aggregator: SoftwareAggregator) -> None:
    sessions = local_sessions(aggregator, 2, k=361)
    xs = _inputs(2, 200_000)
    for bits in protocol.WIRE_BITS:
        _allreduce(sessions, xs, bits)
    stats = sessions[0].stats()
    wide = stats["bytes_lanes32"]
    assert abs(stats["bytes_lanes16"] / wide - 0.5) < 0.01
    assert abs(stats["bytes_lanes8"] / wide - 0.25) < 0.01


def test_int32_and_unknown_widths_are_refused(aggregator: SoftwareAggregator) -> None:
    (s,) = local_sessions(aggregator, 1)
    with pytest.raises(TypeError, match="16 bits are not for int32"):
        s.allreduce(np.ones(10, np.int32), bits=16)
    with pytest.raises(SwitchaggError):  # the refused call was aborted: the session is broken
        s.allreduce(np.ones(10, np.float32))
    (s2,) = local_sessions(aggregator, 1, job=2, slot_base=8)
    with pytest.raises(TypeError, match="lanes of 12 bits"):
        s2.allreduce(np.ones(10, np.float32), bits=12)


def test_a_striped_call_in_8_bit_lanes_sums_every_shard() -> None:
    aggs = [SoftwareAggregator("127.0.0.1", 0) for _ in range(2)]
    for a in aggs:
        a.start()
    try:
        k, slots, key = 128, 4, 0x1234567
        shards = [Shard(a.address, 0, slots, shard_key(key, s)) for s, a in enumerate(aggs)]
        sessions = [Session(1, r, N, k=k, key=key, shards=shards) for r in range(N)]
        for s_index, a in enumerate(aggs):
            addrs = [s.local_addresses[s_index] for s in sessions]
            a._agg.add_job(1, N, 0, slots, k, 1, addrs, key=shard_key(key, s_index))
        xs = _inputs(N, 10_007)
        exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
        residuals = [np.zeros_like(x) for x in xs]
        bufs = [x.copy() for x in xs]
        out = on_every_rank(sessions, lambda r, s: s.allreduce(bufs[r], bits=8, residual=residuals[r]))
        assert all(o is None for o in out), out
        assert all(np.array_equal(bufs[0], b) for b in bufs)
        assert np.all(np.abs(bufs[0] - exact) <= float_bound(xs, k, 8))
        assert all(a.counters()["jobs"][1]["multicast"] > 0 for a in aggs)
    finally:
        for a in aggs:
            a.stop()


@pytest.mark.parametrize("bits", [16, 8])
def test_the_smallest_blocks_are_summed_not_made_nan(aggregator: SoftwareAggregator, bits: int) -> None:
    """Blocks whose largest value is as small as float32's normal range goes (E = -126) or a few binades
    above it, where 2^-E * M overflows float32: finite sums within the bound and finite residuals (their
    NaN once reached a DDP model's weights through error feedback)."""
    sessions = local_sessions(aggregator, N, k=361)
    rng = np.random.default_rng(7)
    scales = np.repeat(2.0 ** np.arange(-126, -100, dtype=np.float64), protocol.SCALE_BLOCK)
    xs = [(rng.uniform(-1, 1, scales.size) * scales).astype(np.float32) for _ in range(N)]
    residuals = [np.zeros_like(x) for x in xs]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    results = _allreduce(sessions, xs, bits, residuals)
    assert np.all(np.isfinite(results[0])) and all(np.all(np.isfinite(r)) for r in residuals)
    assert np.all(np.abs(results[0] - exact) <= float_bound(xs, 361, bits))
