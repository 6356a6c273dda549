"""A returned sum is always the sum of one call (docs/PROTOCOL.md, Call identity): ranks whose calls
differ fail that call on every rank with what differed; a rank that cannot make a call aborts it on
every rank; NaN and Inf travel as gloo sums them; only the job's aggregator (its key) can answer."""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np
import pytest

from switchagg import Session, SwitchaggError, _core, protocol
from switchagg.aggregator import SoftwareAggregator
from switchagg_lab.testing.kit import local_sessions, on_every_rank

KEY = 0x5EC12E7


@pytest.mark.reliability(
    "mismatched calls",
    "rank 0 allreduces 1M + 1M elements, rank 1 one call of 2M (int32, float32)",
    sums=0,
    outcome="failed cleanly: every rank's error says what differed",
    recovery="at once (the first poisoned round)",
    state="the job's sessions broken (open new ones)",
)
@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_two_calls_against_one_of_twice_the_length_failon_every_rank(
    aggregator: SoftwareAggregator, dtype: type
) -> None:
    """Rank 0 allreduces 1M + 1M elements, rank 1 one 2M call: no partial sum ever comes back."""
    sessions = local_sessions(aggregator, 2)

    def work(rank: int, s: Session) -> list[np.ndarray]:
        if rank == 0:
            a: np.ndarray = np.ones(1_000_000, dtype)
            b: np.ndarray = np.ones(1_000_000, dtype)
            s.allreduce(a)
            s.allreduce(b)
            return [a, b]
        c: np.ndarray = np.full(2_000_000, 2, dtype)
        s.allreduce(c)
        return [c]

    out = on_every_rank(sessions, work)
    for rank, res in enumerate(out):
        assert isinstance(res, SwitchaggError), f"rank {rank} returned {res!r} as a success"
        msg = str(res)
        assert "call 1 of job 1 failed on every rank" in msg, msg
        assert "1000000" in msg and "2000000" in msg, msg
    for s in sessions:  # the job is failed for good, with its reason
        with pytest.raises(SwitchaggError, match="earlier call on this session failed.*call 1"):
            s.allreduce(np.ones(10, dtype))
        s.close()
    assert aggregator.counters()["jobs"][1]["multicast"] > 0


@pytest.mark.reliability(
    "mismatched calls",
    "a skipped call: rank 0's bad argument aborts it, its next call meets its peers' current one, 3 ranks",
    sums=0,
    outcome="failed cleanly: 'rank 0 aborted its call 1' on every rank",
    recovery="at once (the aborted round)",
    state="the job's sessions broken (open new ones)",
)
def test_a_skipped_call_fails_on_every_rank_instead_of_pairing_steps(aggregator: SoftwareAggregator) -> None:
    """Rank 0 cannot make its call (a bad argument); it must not pair its next call with its peers'
    current one: call 1 fails on every rank, saying rank 0 aborted it."""
    sessions = local_sessions(aggregator, 3)

    def work(rank: int, s: Session) -> Any:
        if rank == 0:
            with pytest.raises(TypeError, match="aborted on every rank"):
                s.allreduce(np.ones(1000, np.float64))
            step2 = np.full(1000, 2.0, np.float32)
            s.allreduce(step2)  # must not pair with the peers' step 1
            return step2
        step1 = np.full(1000, 1.0, np.float32)
        s.allreduce(step1)
        return step1

    out = on_every_rank(sessions, work)
    assert isinstance(out[0], SwitchaggError) and "earlier call on this session failed" in str(out[0])
    for rank in (1, 2):
        assert isinstance(out[rank], SwitchaggError), out[rank]
        assert "rank 0 aborted its call 1" in str(out[rank]), out[rank]
    for s in sessions:
        s.close()


@pytest.mark.reliability(
    "mismatched calls",
    "float32 on rank 0 against int32 on rank 1, same length",
    sums=0,
    outcome="failed cleanly: both dtypes named on every rank",
    recovery="at once (the first round)",
    state="the job's sessions broken (open new ones)",
)
def test_a_different_dtype_is_a_different_call(aggregator: SoftwareAggregator) -> None:
    sessions = local_sessions(aggregator, 2)
    out = on_every_rank(sessions, lambda r, s: s.allreduce(np.ones(5000, np.float32 if r == 0 else np.int32)))
    assert all(isinstance(e, SwitchaggError) and "float32" in str(e) and "int32" in str(e) for e in out), out
    for s in sessions:
        s.close()


def test_calls_that_agree_keep_summing_exactly(aggregator: SoftwareAggregator) -> None:
    """The check costs nothing when calls agree: many calls of varied length and dtype, exact."""
    sessions = local_sessions(aggregator, 3, k=64, slots=4)
    sizes = [1, 63, 64, 65, 1000, 257, 0, 4096]

    def work(rank: int, s: Session) -> list[np.ndarray]:
        outs = []
        for i, size in enumerate(sizes):
            x = np.arange(size, dtype=np.int32) * (rank + 1) + i
            s.allreduce(x)
            outs.append(x)
        return outs

    out = on_every_rank(sessions, work)
    for res in out:
        assert not isinstance(res, Exception), res
        for i, size in enumerate(sizes):
            want = sum(np.arange(size, dtype=np.int32) * (r + 1) + i for r in range(3))
            np.testing.assert_array_equal(res[i], want)
    assert sessions[0].stats()["call"] == len(sizes)
    for s in sessions:
        s.close()


@pytest.mark.reliability(
    "caught Inf",
    "+Inf, +Inf against -Inf, NaN and floats above 2^127 in float32 tensors, 2 ranks",
    sums=2,
    outcome="exact: non-finite where gloo's sum is (its block NaN), within the bound elsewhere",
    recovery="none needed: no error",
    state="nothing: the session goes on",
)
def test_nan_and_inf_go_through_the_network_as_gloo_sums_them(aggregator: SoftwareAggregator) -> None:
    """A non-finite value on one rank is never an error and never a finite number: the element gets
    IEEE's sum (NaN absorbs, +Inf + -Inf = NaN), the other elements of its block (K of them) NaN,
    other blocks their usual sum. Finite values up to 3.4e38 are accepted."""
    k = 64
    sessions = local_sessions(aggregator, 2, k=k, slots=4)
    base = [np.linspace(-1, 1, 10 * k).astype(np.float32) * (r + 1) for r in range(2)]
    base[0][5] = np.inf  # block 0
    base[1][5] = 1.0
    base[0][k + 3] = np.inf  # block 1: +Inf + -Inf
    base[1][k + 3] = -np.inf
    base[1][2 * k + 7] = np.nan  # block 2
    base[0][3 * k] = np.float32(3.0e38)  # block 3: finite, above 2^127
    base[1][3 * k] = np.float32(-1.0e38)
    xs = [b.copy() for b in base]
    out = on_every_rank(sessions, lambda r, s: s.allreduce(xs[r]))
    assert out == [None, None], out
    with np.errstate(invalid="ignore"):  # inf + -inf
        exact = base[0].astype(np.float64) + base[1].astype(np.float64)
    for y in xs:
        assert y[5] == np.inf
        assert np.isnan(y[k + 3]) and np.isnan(y[2 * k + 7])
        for b in (0, 1, 2):  # the rest of a non-finite block did not travel
            blk = y[b * k : (b + 1) * k]
            assert not np.isfinite(blk).any()
        finite = slice(3 * k, None)
        e = np.frexp(np.maximum(np.abs(base[0][finite]), np.abs(base[1][finite])).reshape(-1, k).max(1))[1]
        bound = np.repeat([protocol.error_bound(2, int(x)) for x in e], k)
        assert np.all(np.abs(y[finite] - exact[finite]) <= bound)
        assert abs(y[3 * k] - 2.0e38) <= protocol.error_bound(2, 128)
    np.testing.assert_array_equal(xs[0], xs[1])  # the same on every rank, NaN where NaN
    for s in sessions:
        s.close()


def test_quantize_marks_nonfinite_blocks() -> None:
    k = 8
    x = np.zeros(3 * k, np.float32)
    x[1] = np.nan
    x[k] = 2.0**126 * 1.5
    q = np.zeros(3 * k, np.uint32)
    e = np.zeros(3, np.int8)
    _core.quantize(x, q, e, 2, k)
    assert list(e) == [protocol.EXP_NONFINITE, protocol.EXP_TOP, protocol.EXP_NONE]


def _squat(port: int, ready: int, n: int) -> None:
    """As uid/gid 65534 (no privilege): bind the dead aggregator's port and echo every DATA header
    back as a RESULT of 42s, with the call identity the worker expects. Runs in a forked child."""
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", port))
    os.write(ready, b"b")
    s.settimeout(10)
    for _ in range(n):  # bounded in count and time
        try:
            data, src = s.recvfrom(65536)
        except OSError:
            break
        h = protocol.Header.unpack(data)
        h.type, h.flags = protocol.MSG_RESULT, h.flags & protocol.IDENTITY_FLAGS
        h.values = [42] * len(h.values)
        s.sendto(h.pack(), src)


@pytest.mark.reliability(
    "squatter",
    "an unprivileged process (uid 65534) binds the dead aggregator's port and answers every DATA with "
    "a RESULT of 42s, 2 ranks",
    sums=2,
    outcome="failed cleanly: no forged sum taken (bad key), the session timeout",
    recovery="the session timeout (2 s)",
    state="sessions broken; nothing forged written",
)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the squatter as another user (uid 65534)")
def test_a_squatter_on_the_dead_aggregators_port_cannot_answer() -> None:
    """The aggregator dies; an unprivileged process binds its port and echoes every DATA header
    back as a RESULT with 42 everywhere. Not one forged sum is taken: the workers time out."""
    agg = SoftwareAggregator("127.0.0.1", 0)
    agg.start()
    port = agg.address[1]
    sessions = local_sessions(agg, 2, k=64, slots=4, timeout=2.0)
    good = [np.full(1000, r + 1, np.int32) for r in range(2)]
    assert on_every_rank(sessions, lambda r, s: s.allreduce(good[r])) == [None, None]
    assert all((g == 3).all() for g in good)
    agg.stop()  # closes its socket: the port is free for anyone
    r_fd, w_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the squatter
        try:
            _squat(port, w_fd, 2000)
        finally:
            os._exit(0)
    try:
        assert os.read(r_fd, 1) == b"b"
        xs = [np.full(1000, r + 1, np.int32) for r in range(2)]
        out = on_every_rank(sessions, lambda r, s: s.allreduce(xs[r]))
        for r, res in enumerate(out):
            assert isinstance(res, SwitchaggError) and "no result from the aggregator" in str(res), res
            assert not (xs[r] == 42).any() and (xs[r] == r + 1).all()  # nothing forged was written
            assert sessions[r].stats()["bad_key"] > 0
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r_fd)
        os.close(w_fd)
        for s in sessions:
            s.close()


def test_header_carries_call_identity_and_key() -> None:
    h = protocol.Header(job=1, rank=2, slot=3, call=7, total=2_000_000, key=0xDEADBEEF, values=[1])
    raw = h.pack()
    assert len(raw) == protocol.HEADER_LEN + 4 == 32
    assert raw[16:28] == (7).to_bytes(4, "big") + (2_000_000).to_bytes(4, "big") + bytes.fromhex("DEADBEEF")
    assert protocol.Header.unpack(raw).call == 7
