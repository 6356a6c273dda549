"""The C quantization kernels against the rules of docs/PROTOCOL.md "Quantization"."""

from __future__ import annotations

import numpy as np
import pytest

from switchagg import _core, protocol

K = 64


def quantize(x: np.ndarray, n: int, k: int = K) -> tuple[np.ndarray, np.ndarray]:
    blocks = (len(x) + k - 1) // k
    q = np.zeros(blocks * k, np.uint32)
    e = np.zeros(blocks, np.int8)
    _core.quantize(x, q, e, n, k)
    return q.byteswap().view(np.int32), e  # big-endian on the wire; host order here


def dequantize(q: np.ndarray, e: np.ndarray, n: int, size: int, k: int = K) -> np.ndarray:
    y = np.empty(size, np.float32)
    _core.dequantize(q.astype(np.int32).byteswap().view(np.uint32), e, y, n, k)
    return y


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 7.9, 1e6, 1e30])
@pytest.mark.parametrize("n", [1, 2, 5, 32])
def test_round_trip_within_bound(scale: float, n: int) -> None:
    x = (np.random.default_rng(n).standard_normal(1000) * scale).astype(np.float32)
    q, e = quantize(x, n)
    y = dequantize(q, e, n, len(x))
    for b in range(len(e)):
        blk = slice(b * K, (b + 1) * K)
        assert 2.0 ** int(e[b]) >= np.max(np.abs(x[blk]))  # 2^e >= max|x|
        assert 2.0 ** (int(e[b]) - 1) < np.max(np.abs(x[blk]))  # and the smallest such e
        # one worker's share of the bound: the n-way bound is n times this
        assert np.max(np.abs(y[blk] - x[blk])) <= protocol.error_bound(n, int(e[b])) / n


def test_exponent_of_exact_powers_of_two_and_zero_blocks() -> None:
    x = np.zeros(3 * K, np.float32)
    x[0] = 4.0  # 2^2 >= 4 exactly
    x[K] = -4.000001
    q, e = quantize(x, 1)
    assert list(e) == [2, 3, protocol.EXP_NONE]
    assert not q[2 * K :].any()


@pytest.mark.parametrize("n", [2, 3, 32])
def test_an_n_way_sum_of_extremes_cannot_overflow(n: int) -> None:
    x = np.full(K, 2.0**5, np.float32)  # every element at the block maximum 2^e
    q, _ = quantize(x, n)
    assert int(q.astype(np.int64).max()) * n <= protocol.INT32_MAX
    qn, _ = quantize(-x, n)
    assert int(qn.astype(np.int64).min()) * n >= -protocol.INT32_MAX


def test_summed_blocks_dequantize_to_the_sum_within_the_n_way_bound() -> None:
    n = 4
    rng = np.random.default_rng(3)
    xs = []
    for _ in range(n):
        x = rng.uniform(-1, 1, 10 * K).astype(np.float32)
        x[::K] = 1.0  # the same block maximum everywhere: each local exponent is the shared max
        xs.append(x)
    quantized = [quantize(x, n) for x in xs]
    e = quantized[0][1]
    assert all(np.array_equal(qe[1], e) for qe in quantized)
    total = np.sum([qe[0].astype(np.int64) for qe in quantized], axis=0)
    assert np.abs(total).max() <= protocol.INT32_MAX  # no int32 overflow in the data plane
    y = dequantize(total.astype(np.int32), e, n, 10 * K)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    assert np.max(np.abs(y - exact)) <= protocol.error_bound(n, int(e.max()))


def test_non_finite_blocks_carry_class_counts_that_sum_as_ieee_does() -> None:
    """A block with NaN/Inf: EXP_NONFINITE (the largest exponent, so the max over ranks keeps it);
    each element is sent as a class count (+Inf 1, -Inf 2^8, NaN 2^16, finite 0), and a sum of
    counts decodes to IEEE's sum: NaN absorbs, +Inf + -Inf = NaN, finite elements NaN."""
    x = np.ones(2 * K, np.float32)
    x[[1, 2, 3]] = [np.inf, -np.inf, np.nan]
    q, e = quantize(x, 2)
    assert list(e) == [protocol.EXP_NONFINITE, 0]
    assert list(q[:5]) == [0, 1, 1 << 8, 1 << 16, 0]
    sums = np.zeros(K, np.int32)
    sums[[1, 2, 3, 4, 5]] = [2, 1 + (1 << 8), 2 << 8, (1 << 16) + 1, 0]
    y = dequantize(sums, np.array([protocol.EXP_NONFINITE], np.int8), 2, K)
    assert y[1] == np.inf and np.isnan(y[2]) and y[3] == -np.inf and np.isnan(y[4]) and np.isnan(y[5])


def test_finite_values_up_to_float32_max_are_accepted() -> None:
    x = np.full(K, 3.0e38, np.float32)
    x[1] = -np.finfo(np.float32).max
    q, e = quantize(x, 1)
    assert e[0] == protocol.EXP_TOP
    y = dequantize(q, e, 1, K)
    assert np.all(np.abs(y.astype(np.float64) - x) <= protocol.error_bound(1, int(e[0])))


def test_argument_checks() -> None:
    x = np.ones(10, np.float32)
    with pytest.raises(TypeError, match="float32"):
        _core.quantize(np.ones(10), np.zeros(64, np.uint32), np.zeros(1, np.int8), 2, K)
    with pytest.raises(ValueError, match="too small"):
        _core.quantize(x, np.zeros(8, np.uint32), np.zeros(1, np.int8), 2, K)
    with pytest.raises(ValueError, match="n must be in 1..32"):
        _core.quantize(x, np.zeros(64, np.uint32), np.zeros(1, np.int8), 33, K)
