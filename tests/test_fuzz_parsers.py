"""A fuzzer of the C packet parsers (issue 23), bounded in examples so that it runs in `make test`.

The software aggregator's parser: a real ``_core.Aggregator`` is sent arbitrary and structure-aware
mutated datagrams (headers with any field changed, truncated or lengthened, bytes flipped, random
bytes) from the ranks' pinned addresses and from foreign ones, while a victim job is mid-round and
another job is installed half-way. A model of the parser (``classify``, the checks of
aggregator.c's ``process`` in their order) predicts each datagram's fate: the aggregator must count
every malformed one under exactly the drop reason predicted, every well-formed one as work of its
job, never crash, and the victim's round, finished afterwards, must sum exactly.

The worker's result path: a real ``Session`` allreduces against a fake aggregator in this test that
answers each DATA correctly (the job's other rank played by the test) and sends fuzzed RESULTs
around the correct answer: mutated from it (wrong key, call, total, offset, slot, set, flags,
length, ...), replays of earlier answers, random bytes. Every fuzzed RESULT is made so that the
protocol requires the worker to refuse it (a payload mutated under the job's key is what the key
exists to prevent, not something a worker can detect), so the sum must be exact: no forged value
taken, nothing crashes, and each one refused is counted.

Hypothesis explores the structure (shrinking any failure to a small datagram list); a seeded loop
adds volume through the same generator.
"""

from __future__ import annotations

import random
import select
import socket
import struct
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchagg import Session, _core, protocol
from switchagg.aggregator import SoftwareAggregator
from switchagg.protocol import (
    DROP_REASONS,
    FLAG_ABORT,
    FLAG_FLOAT,
    FLAG_HELLO,
    FLAG_LANE8,
    FLAG_MISMATCH,
    FLAG_PRIME,
    HEADER_FORMAT,
    HEADER_LEN,
    IDENTITY_FLAGS,
    LANE_FLAGS,
    MSG_DATA,
    MSG_RESULT,
    MSG_STATUS,
    POISON_FLAGS,
    POOL_SET_BIT,
    POOL_SLOT_MASK,
    VERSION,
    Header,
)
from switchagg_lab.testing.kit import wait_rx
from switchagg_lab.testing.reliability import Reliability

T = TypeVar("T")
WAIT_S = 10.0  # only guards against hangs
U32 = 2**32 - 1
# Hypothesis: no example database in the shared working tree, no per-example deadline (2 busy
# cores), and no health check that only says the examples are slow to generate.
FUZZ: dict[str, Any] = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


class Draw(Protocol):
    """Where a generator takes its choices from: hypothesis, or a seeded random.Random."""

    def integer(self, lo: int, hi: int) -> int: ...
    def choice(self, seq: Sequence[T]) -> T: ...
    def blob(self, n: int) -> bytes: ...


class RandomDraw:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, seq: Sequence[T]) -> T:
        return seq[self.rng.randrange(len(seq))]

    def blob(self, n: int) -> bytes:
        return self.rng.randbytes(n)


class HypothesisDraw:
    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, seq: Sequence[T]) -> T:
        return self.data.draw(st.sampled_from(seq))

    def blob(self, n: int) -> bytes:
        return self.data.draw(st.binary(min_size=n, max_size=n))


def udp(ip: str = "127.0.0.1", port: int = 0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((ip, port))
    s.settimeout(WAIT_S)
    return s


def drain(s: socket.socket) -> int:
    got = 0
    while select.select([s], [], [], 0)[0]:
        s.recv(65536)
        got += 1
    return got


# ---- the aggregator's parser ----


@dataclass
class JobSpec:
    id: int
    n: int
    base: int
    count: int
    k: int
    addrs: list[tuple[str, int] | None]
    key: int = 0
    upstream: tuple[str, int] | None = None  # a leaf's spine
    leaf_index: int = 0

    def install(self, agg: SoftwareAggregator) -> None:
        agg._agg.add_job(
            self.id, self.n, self.base, self.count, self.k, 1, self.addrs,
            upstream=self.upstream, leaf_index=self.leaf_index, key=self.key,
        )  # fmt: skip


def classify(pkt: bytes, src: tuple[str, int], jobs: dict[int, JobSpec]) -> str:
    """What the aggregator must do with ``pkt`` from ``src``: a drop reason (protocol.DROP_REASONS),
    ``data:<job>`` (a contribution, retransmission or late packet of that job), ``result:<job>``
    (a spine's answer that a leaf takes or counts as stale) or ``status:<job>`` (a spine's loss notice
    that a leaf acts on, counts as stale or needs nothing for). aggregator.c's checks, in its order."""
    if len(pkt) < HEADER_LEN:
        return "truncated"
    version, type_, flags, _exp, job_id, rank, pool, elems = struct.unpack_from("!BBBbHHHH", pkt)
    if version != VERSION:
        return "bad_version"
    if flags & LANE_FLAGS == LANE_FLAGS:  # LANES = 3 names no lane width
        return "bad_type"
    job = jobs.get(job_id)

    def slot_and_length(j: JobSpec, words: int) -> str | None:
        slot = pool & POOL_SLOT_MASK
        if not j.base <= slot < j.base + j.count:
            return "bad_pool"
        if len(pkt) != HEADER_LEN + 4 * words or elems != words:
            return "truncated"
        return None

    if type_ in (MSG_RESULT, MSG_STATUS):  # only a leaf takes one, only from its spine
        if job is None or job.upstream is None:
            return "bad_type"
        if rank != job.leaf_index:
            return "bad_rank"
        if src != job.upstream:
            return "spoofed"
        if type_ == MSG_STATUS:
            return slot_and_length(job, 1) or f"status:{job_id}"
        return slot_and_length(job, job.k) or f"result:{job_id}"
    if type_ != MSG_DATA:
        return "bad_type"
    if job is None:
        return "unknown_job"
    if rank >= job.n:
        return "bad_rank"
    if job.addrs[rank] != src:  # also a rank behind another leaf (no address here)
        return "spoofed"
    return slot_and_length(job, job.k) or f"data:{job_id}"


V, F, L, UNKNOWN = 11, 12, 13, 14  # victim, fuzz target (installed mid-stream), leaf, nobody's
KEY_V, KEY_L = 0x7E57AB1E, 0x1EAF0001
K_V, K_F, K_L = 8, 4, 8
SOURCES = ("a0", "a1", "f0", "f1", "l0", "spine", "x", "x2")  # x, x2: foreign (x2: a0's port)


class AggWorld:
    """The sockets of one fuzzing session against one aggregator, and its three jobs."""

    def __init__(self, agg: SoftwareAggregator) -> None:
        self.agg = agg
        self.socks = {name: udp() for name in SOURCES if name != "x2"}
        try:  # the victim's port on another loopback address: only the IP differs
            self.socks["x2"] = udp("127.0.0.2", self.socks["a0"].getsockname()[1])
        except OSError:
            self.socks["x2"] = udp("127.0.0.2")
        self.addr = {name: s.getsockname() for name, s in self.socks.items()}
        a = self.addr
        self.jobs = {
            V: JobSpec(V, 2, 0, 4, K_V, [a["a0"], a["a1"]], key=KEY_V),
            F: JobSpec(F, 2, 4, 2, K_F, [a["f0"], a["f1"]]),
            L: JobSpec(L, 2, 8, 2, K_L, [a["l0"], None], key=KEY_L, upstream=a["spine"]),
        }
        self.totals: Counter[str] = Counter()

    def close(self) -> None:
        for s in self.socks.values():
            s.close()

    def datagram(self, d: Draw) -> tuple[bytes, str]:
        """One datagram and the name of the socket it comes from. Every choice's first option (what
        hypothesis shrinks towards) is the well-formed one, so that mutations stay near validity."""
        form = d.choice(("header", "header", "header", "flipped", "raw"))
        if form == "raw":
            return d.blob(d.integer(0, 3 * HEADER_LEN)), d.choice(SOURCES)
        spec = self.jobs.get(d.choice((V, F, L, UNKNOWN)))
        job_id = spec.id if spec else (UNKNOWN if d.integer(0, 1) == 0 else d.integer(0, 0xFFFF))
        k = spec.k if spec else d.choice((4, 8))
        n = spec.n if spec else 2
        version = VERSION if d.integer(0, 15) else d.choice((0, 1, VERSION + 1, 255))
        type_ = d.choice((MSG_DATA,) * 6 + (MSG_RESULT, MSG_RESULT, MSG_STATUS, 0, 4, 255))
        rank = d.integer(0, n - 1) if d.integer(0, 15) else d.choice((n, 31, 32, 0xFFFF))
        base, count = (spec.base, spec.count) if spec else (0, 16)
        slot = base + d.integer(0, count - 1) if d.integer(0, 15) else d.integer(0, POOL_SLOT_MASK)
        shadow = d.integer(0, 1)
        flags = (
            d.choice(
                (
                    0,
                    FLAG_FLOAT,
                    FLAG_PRIME | FLAG_FLOAT,
                    FLAG_ABORT,
                    FLAG_MISMATCH,
                    FLAG_FLOAT | FLAG_LANE8,
                    LANE_FLAGS,
                )
            )
            if d.integer(0, 3)
            else d.integer(0, 255)
        )
        words = 1 if type_ == MSG_STATUS else k  # a STATUS carries one word
        elems = words if d.integer(0, 15) else d.integer(0, 0xFFFF)
        nvalues = words if d.integer(0, 15) else d.integer(0, 2 * k + 1)
        offset = d.choice((0, k, 2 * k)) if d.integer(0, 1) else d.integer(0, U32)
        call = d.integer(0, 3) if d.integer(0, 1) else d.integer(0, U32)
        total = d.choice((k, 4 * k)) if d.integer(0, 1) else d.integer(0, U32)
        key = d.choice((0, KEY_L, KEY_V)) if d.integer(0, 1) else d.integer(0, U32)
        head = struct.pack(
            HEADER_FORMAT, version, type_, flags, d.integer(-128, 127), job_id, rank,
            (POOL_SET_BIT if shadow else 0) | slot, elems, offset, call, total, key,
        )  # fmt: skip
        pkt = head + d.blob(4 * nvalues)
        cut = d.integer(0, 15)
        if cut == 14:
            pkt = pkt[: d.integer(0, len(pkt) - 1)]
        elif cut == 15:
            pkt += d.blob(d.integer(1, 16))
        if form == "flipped":
            b = bytearray(pkt)
            for _ in range(d.integer(1, 4) if b else 0):
                b[d.integer(0, len(b) - 1)] = d.integer(0, 255)
            pkt = bytes(b)
        # The source: mostly the address the header's job and rank are pinned to (or the
        # leaf's spine for a RESULT), else any of the sockets, foreign ones included.
        src = d.choice(SOURCES)
        if spec is not None and d.integer(0, 3):
            if type_ in (MSG_RESULT, MSG_STATUS) and spec.upstream is not None:
                src = "spine"
            elif rank < n and spec.addrs[rank] is not None:
                src = next(name for name, a in self.addr.items() if a == spec.addrs[rank])
        return pkt, src

    def send(
        self, batch: list[tuple[bytes, str]], jobs: dict[int, JobSpec], fuzzed: bool = True
    ) -> Counter[str]:
        """Sends a batch and waits until the aggregator has read all of it; returns the predicted fate
        of each datagram. A fuzzed well-formed contribution to the victim job from its own rank's
        address would be a real contribution: it is sent from the foreign socket instead."""
        predicted: Counter[str] = Counter()
        rx = self.agg.counters()["rx"]
        for pkt, src in batch:
            fate = classify(pkt, self.addr[src], jobs)
            if fuzzed and fate == f"data:{V}":
                src = "x"
                fate = classify(pkt, self.addr[src], jobs)
            predicted[fate] += 1
            self.socks[src].sendto(pkt, self.agg.address)
        self.wait_rx(rx + len(batch))
        return predicted

    def wait_rx(self, rx: int) -> dict[str, Any]:
        return wait_rx(self.agg, rx, WAIT_S)

    def example(self, d: Draw, sizes: tuple[int, int]) -> None:
        """One round of the victim job with a fuzzed stream in the middle; asserts the model."""
        agg = self.agg
        for s in self.socks.values():
            drain(s)
        self.jobs[V].install(agg)
        self.jobs[L].install(agg)
        try:
            self._example(d, sizes)
        finally:
            for job_id in (V, F, L):
                if job_id in agg.counters()["jobs"]:
                    agg._agg.remove_job(job_id)

    def _example(self, d: Draw, sizes: tuple[int, int]) -> None:
        agg, v = self.agg, self.jobs[V]
        before = agg.counters()
        seed = d.integer(0, U32)
        rng = np.random.default_rng(seed)
        values = rng.integers(-(2**31), 2**31, (2, 4, K_V), dtype=np.int64).astype(np.int32)
        call, total = 1 + seed % 1000, 4 * K_V

        def victim(rank: int, slot: int) -> tuple[bytes, str]:
            h = Header(job=V, rank=rank, slot=slot, offset=slot * K_V, call=call, total=total)
            h.values = [int(x) for x in values[rank, slot]]
            return h.pack(), f"a{rank}"

        installed = {V: v, L: self.jobs[L]}
        predicted = self.send([victim(0, 0), victim(0, 1)], installed, False)  # mid-round: slots 0, 1
        predicted += self.send([self.datagram(d) for _ in range(sizes[0])], installed)
        self.jobs[F].install(agg)  # a job installed while the stream goes on
        installed[F] = self.jobs[F]
        predicted += self.send([self.datagram(d) for _ in range(sizes[1])], installed)
        rest = [victim(0, 2), victim(0, 3)] + [victim(1, s) for s in range(4)]
        predicted += self.send(rest, installed, False)
        after = agg.counters()

        # The victim's round is exact, with its identity and key, and nothing else reached its ranks.
        want = values.astype(np.int64).sum(axis=0).astype(np.int32)
        for rank in (0, 1):
            s = self.socks[f"a{rank}"]
            got = {}
            for _ in range(4):
                h = Header.unpack(s.recv(65536))
                assert (h.type, h.job, h.rank, h.key, h.call, h.total, h.flags) == (
                    MSG_RESULT, V, rank, KEY_V, call, total, 0,
                ), h  # fmt: skip
                assert h.offset == h.slot * K_V and h.slot not in got
                got[h.slot] = np.array(h.values, np.int32)
            self.totals["victim_sums"] += 4
            wrong = [slot for slot in range(4) if not np.array_equal(got[slot], want[slot])]
            self.totals["wrong_sums"] += len(wrong)
            assert not wrong, f"rank {rank}: wrong sums in slots {wrong}"
            assert drain(s) == 0, "the victim's rank got more than its round's results"

        # Every datagram is accounted for: under the drop reason predicted, or as its job's work.
        assert after["rx"] - before["rx"] == sum(predicted.values())
        drops = {r: after["drops"][r] - before["drops"][r] for r in DROP_REASONS}
        assert drops == {r: predicted[r] for r in DROP_REASONS}, (drops, predicted)
        jobs = after["jobs"]
        assert jobs[V]["aggregated"] == 8 and jobs[V]["multicast"] == 4
        assert jobs[V]["resent"] == jobs[V]["retrans_ignored"] == 0
        work = ("aggregated", "resent", "retrans_ignored", "upstream_resent")
        assert sum(jobs[F].get(c, 0) for c in work) == predicted[f"data:{F}"], (jobs[F], predicted)
        # a spine's STATUS makes the leaf resend its partial, or counts as stale, or needs nothing
        resent_up = sum(jobs[L][c] for c in work) - predicted[f"data:{L}"]
        stale = jobs[L]["stale_results"] + jobs[L]["multicast"] - predicted[f"result:{L}"]
        assert 0 <= resent_up and 0 <= stale, (jobs[L], predicted)
        assert resent_up + stale <= predicted[f"status:{L}"], (jobs[L], predicted)
        self.totals["examples"] += 1
        self.totals["datagrams"] += sizes[0] + sizes[1]
        self.totals["malformed"] += sum(predicted[r] for r in DROP_REASONS)


@pytest.fixture(scope="module")
def world() -> Iterator[AggWorld]:
    with SoftwareAggregator() as agg:
        w = AggWorld(agg)
        try:
            yield w
        finally:
            w.close()


AGG_EXAMPLES = 200


@pytest.mark.reliability(
    "fuzzer",
    "aggregator parser: hypothesis, structure-aware datagrams from pinned and foreign addresses",
    outcome="exact; every datagram counted as predicted",
    recovery="none needed",
    state="nothing: the victim's next round is exact",
)
def test_the_aggregator_parser_counts_every_fuzzed_datagram(
    world: AggWorld, reliability: Reliability
) -> None:
    start = Counter(world.totals)

    @settings(max_examples=AGG_EXAMPLES, **FUZZ)
    @given(st.data(), st.integers(0, 20), st.integers(0, 20))
    def run(data: st.DataObject, before: int, after: int) -> None:
        world.example(HypothesisDraw(data), (before, after))

    run()
    t = world.totals - start
    reliability.record(
        tried=f"aggregator parser: {t['examples']} hypothesis examples, {t['datagrams']} datagrams "
        f"({t['malformed']} malformed) from pinned and foreign addresses",
        runs=t["examples"],
        sums=t["victim_sums"],
        wrong=t["wrong_sums"],
    )


@pytest.mark.reliability(
    "malformed packets",
    "seeded volume through the fuzzer's generator",
    outcome="exact; every malformed datagram dropped under the predicted reason",
    recovery="none needed",
    state="nothing: the victim's next round is exact",
)
def test_a_seeded_volume_of_malformed_datagrams(world: AggWorld, reliability: Reliability) -> None:
    start = Counter(world.totals)
    d = RandomDraw(23)
    for _ in range(60):
        world.example(d, (d.integer(50, 200), d.integer(50, 200)))
    t = world.totals - start
    reliability.record(
        tried=f"{t['datagrams']} datagrams ({t['malformed']} malformed) in {t['examples']} victim rounds",
        runs=t["examples"],
        sums=t["victim_sums"],
        wrong=t["wrong_sums"],
    )


def test_the_model_matches_known_cases() -> None:
    """The model itself, on hand-made datagrams (a wrong model would make the fuzzer vacuous)."""
    a, b, x = ("127.0.0.1", 1), ("127.0.0.1", 2), ("127.0.0.1", 3)
    jobs = {
        1: JobSpec(1, 2, 0, 4, 8, [a, b]),
        2: JobSpec(2, 2, 4, 2, 8, [a, None], upstream=x),
    }
    good = Header(job=1, rank=0, slot=3, values=[0] * 8).pack()
    assert classify(good, a, jobs) == "data:1"
    assert classify(good, b, jobs) == "spoofed"
    assert classify(good[:27], a, jobs) == classify(good[:-4], a, jobs) == "truncated"
    assert classify(bytes([3]) + good[1:], a, jobs) == "bad_version"
    assert classify(Header(job=1, rank=2, slot=3, values=[0] * 8).pack(), a, jobs) == "bad_rank"
    assert classify(Header(job=1, rank=0, slot=4, values=[0] * 8).pack(), a, jobs) == "bad_pool"
    assert classify(Header(job=9, rank=0, slot=0, values=[0] * 8).pack(), a, jobs) == "unknown_job"
    assert classify(Header(job=1, rank=0, slot=0, type=MSG_STATUS, values=[0]).pack(), a, jobs) == "bad_type"
    assert classify(Header(job=2, rank=0, slot=5, type=MSG_STATUS, values=[0]).pack(), x, jobs) == "status:2"
    status_of_k = Header(job=2, rank=0, slot=5, type=MSG_STATUS, values=[0] * 8).pack()
    assert classify(status_of_k, x, jobs) == "truncated"
    assert (
        classify(Header(job=1, rank=0, slot=3, flags=LANE_FLAGS, values=[0] * 8).pack(), a, jobs)
        == "bad_type"
    )
    assert (
        classify(Header(job=1, rank=0, slot=3, flags=FLAG_LANE8, values=[0] * 8).pack(), a, jobs) == "data:1"
    )
    result = Header(job=2, rank=0, slot=5, type=MSG_RESULT, values=[0] * 8).pack()
    assert classify(result, x, jobs) == "result:2"
    assert classify(result, a, jobs) == "spoofed"
    assert classify(Header(job=1, rank=0, slot=0, type=MSG_RESULT).pack(), a, jobs) == "bad_type"
    assert classify(Header(job=2, rank=1, slot=4, values=[0] * 8).pack(), b, jobs) == "spoofed"


# ---- the worker's result path ----

FIELDS = protocol.HEADER_FIELDS
OFFSETS = {name: struct.calcsize("!" + HEADER_FORMAT[1 : 1 + i]) for i, name in enumerate(FIELDS)}
CODES = dict(zip(FIELDS, HEADER_FORMAT[1:], strict=True))
WIDTH = {"B": 0xFF, "b": 0xFF, "H": 0xFFFF, "I": U32}
PRIMARY = ("version", "type", "job", "rank", "elems", "key")  # checked before anything else
JOB, SLOT_BASE, SLOTS, K_W, KEY_W = 77, 3, 4, 16, 0x0BADCAFE


def fields(pkt: bytes) -> dict[str, int]:
    return dict(zip(FIELDS, struct.unpack_from(HEADER_FORMAT, pkt), strict=True))


def with_field(pkt: bytes, name: str, value: int) -> bytes:
    code, at = CODES[name], OFFSETS[name]
    value &= WIDTH[code]
    if code == "b":
        value = value - 256 if value > 127 else value
    return pkt[:at] + struct.pack("!" + code, value) + pkt[at + struct.calcsize(code) :]


def surely_refused(pkt: bytes, correct: bytes, strict: bool) -> bool:
    """Must a worker waiting for ``correct`` (it is the answer to one of its outstanding slots)
    refuse ``pkt`` whatever else it waits for? ``strict``: also once that slot has moved on (the
    answer was sent before pkt): then only the checks that do not depend on the slot count."""
    if len(pkt) != len(correct):
        return True
    h, c = fields(pkt), fields(correct)
    if any(h[f] != c[f] for f in PRIMARY):
        return True
    if strict:
        return False
    if h["pool"] & POOL_SLOT_MASK == c["pool"] & POOL_SLOT_MASK and h["pool"] != c["pool"]:
        return True  # the slot's other set: that round is not the one outstanding
    if h["flags"] & POISON_FLAGS:
        return False  # a poisoned answer of the right slot and set ends the call: no identity check
    identity = ("call", "total")
    if any(h[f] != c[f] for f in identity) or (h["flags"] ^ c["flags"]) & IDENTITY_FLAGS:
        return True
    return h["pool"] == c["pool"] and h["offset"] != c["offset"]


def reaches_key_check(pkt: bytes, correct: bytes) -> bool:
    """Would worker.c count this one as bad_key (all checked before the key match, the key not)?"""
    if len(pkt) != len(correct):
        return False
    h, c = fields(pkt), fields(correct)
    return all(h[f] == c[f] for f in PRIMARY if f != "key") and h["key"] != c["key"]


Op = tuple[Any, ...]
Spec = tuple[str, str, list[Op], int]  # (pre|post, current|replay, ops, replay index)

OPS = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(FIELDS), st.integers(0, U32)),
    st.tuples(st.just("xor"), st.sampled_from(FIELDS), st.integers(1, U32)),
    st.tuples(
        st.just("xor"),
        st.sampled_from(("pool", "flags")),
        st.sampled_from((1, 2, 4, 8, 0x10, 0x20, 0x30, POOL_SET_BIT)),
    ),
    st.tuples(
        st.just("add"), st.sampled_from(("call", "offset", "total")), st.sampled_from((1, -1, K_W, -K_W))
    ),
    st.tuples(st.just("truncate"), st.integers(0, 200)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=32)),
    st.tuples(st.just("payload"), st.integers(0, 1000), st.integers(0, U32)),
    st.tuples(st.just("raw"), st.binary(max_size=4 * K_W + 2 * HEADER_LEN)),
)
SPECS = st.tuples(
    st.sampled_from(("pre", "post")),
    st.sampled_from(("current", "current", "current", "replay")),
    st.lists(OPS, min_size=1, max_size=4),
    st.integers(0, 1000),
)
PLANS = st.lists(st.lists(SPECS, max_size=4), min_size=1, max_size=6)


def mutate(correct: bytes, ops: list[Op]) -> bytes:
    pkt = correct
    for op in ops:
        kind = op[0]
        if kind == "raw":
            pkt = op[1]
        elif len(pkt) < HEADER_LEN:
            continue
        elif kind == "set":
            pkt = with_field(pkt, op[1], op[2])
        elif kind == "xor":
            pkt = with_field(pkt, op[1], fields(pkt)[op[1]] ^ op[2])
        elif kind == "add":
            pkt = with_field(pkt, op[1], fields(pkt)[op[1]] + op[2])
        elif kind == "truncate":
            pkt = pkt[: min(op[1], len(pkt) - 1)]
        elif kind == "extend":
            pkt = pkt + op[1]
        elif kind == "payload" and len(pkt) > HEADER_LEN + 4:
            at = HEADER_LEN + 4 * (op[1] % ((len(pkt) - HEADER_LEN) // 4))
            pkt = pkt[:at] + struct.pack("!I", op[2]) + pkt[at + 4 :]
    return pkt


class FakeAggregator:
    """The worker's aggregator, played by the test: every DATA answered as the software aggregator
    answers it (the other rank's contribution added for int32), and the first answer of each round
    surrounded by the fuzzed RESULTs of the plan's next entry."""

    def __init__(self, kind: str, n: int, plan: list[list[Spec]], rounds: int) -> None:
        self.sock = udp()
        self.sock.settimeout(0.05)
        self.kind, self.n, self.plan, self.rounds = kind, n, plan, rounds
        self.seen: set[tuple[int, int, int, int]] = set()
        self.history: list[bytes] = []
        self.fuzzed = self.bad_key = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        address: tuple[str, int] = self.sock.getsockname()
        return address

    def __enter__(self) -> FakeAggregator:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        self.sock.close()
        if self.error is not None:
            raise self.error

    @staticmethod
    def peer(call: int, offset: int) -> np.ndarray:
        """The other rank's int32 chunk at ``offset`` of call ``call``."""
        g = np.arange(offset, offset + K_W, dtype=np.int64)
        return ((g * 2654435761 + call * 97) % 2**32 - 2**31).astype(np.int32)

    def answer(self, pkt: bytes) -> bytes:
        h = fields(pkt)
        payload = np.frombuffer(pkt[HEADER_LEN:], ">i4").astype(np.int32)
        if h["flags"] & FLAG_HELLO and self.n == 2:
            # the other rank's hello word: it vouches from the second round on (docs/PROTOCOL.md, Sessions)
            payload = payload.copy()
            payload[1] = 0x5EED0000 | (1 if h["key"] else 0)
        elif self.kind == "i" and self.n == 2:
            payload = (payload.astype(np.int64) + self.peer(h["call"], h["offset"])).astype(np.int32)
        head = pkt[:HEADER_LEN]
        # a result answers the session of the DATA's incarnation (its key field)
        head = with_field(with_field(head, "type", MSG_RESULT), "key", KEY_W ^ h["key"])
        return head + payload.astype(">i4").tobytes()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    pkt, src = self.sock.recvfrom(65536)
                except TimeoutError:
                    continue
                self._handle(pkt, src)
        except BaseException as e:  # reported by __exit__
            self.error = e

    def _handle(self, pkt: bytes, src: tuple[str, int]) -> None:
        h = fields(pkt)
        assert h["type"] == MSG_DATA and len(pkt) == HEADER_LEN + 4 * K_W, h
        correct = self.answer(pkt)
        rid = (h["call"], h["offset"], h["flags"] & FLAG_PRIME, h["key"])  # hello rounds differ in key
        specs: list[Spec] = []
        if rid not in self.seen and h["flags"] & FLAG_HELLO:  # the session's hello: answered plainly
            self.seen.add(rid)
        elif rid not in self.seen:  # a retransmission is answered again, plainly
            self.seen.add(rid)
            specs = self.plan[(len(self.seen) - 1) % len(self.plan)]
        last = len(self.seen) == self.rounds  # nothing after the last answer: the worker is done
        pre = [self._fuzzed(s, correct) for s in specs if s[0] == "pre"]
        post = [self._fuzzed(s, correct) for s in specs if s[0] == "post" and not last]
        for p in [*pre, correct, *post]:
            self.sock.sendto(p, src)
        self.history.append(correct)

    def _fuzzed(self, spec: Spec, correct: bytes) -> bytes:
        when, base, ops, index = spec
        self.fuzzed += 1
        if base == "replay" and self.history:  # an earlier answer: its round is over
            replay = self.history[index % len(self.history)]
            self.bad_key += reaches_key_check(replay, correct)  # a hello round's answer: another key
            return replay
        pkt = mutate(correct, ops)
        if not surely_refused(pkt, correct, strict=when == "post"):
            # Left as it is, the protocol would take it (it is the aggregator's word): make it what
            # only a forger could send, a RESULT without the job's key.
            pkt = with_field(pkt, "key", fields(correct)["key"] ^ 0x80000001)
        self.bad_key += reaches_key_check(pkt, correct)
        return pkt


def float_reference(x: np.ndarray) -> np.ndarray:
    """What a world of one gets back for x: quantized and dequantized, block by block."""
    blocks = (x.size + K_W - 1) // K_W
    q = np.zeros(blocks * K_W, np.uint32)
    e = np.zeros(blocks, np.int8)
    _core.quantize(x, q, e, 1, K_W)
    y = np.empty_like(x)
    _core.dequantize(q, e, y, 1, K_W)
    return y


def worker_example(
    kind: str, lengths: list[int], plan: list[list[Spec]], seed: int, totals: Counter[str]
) -> None:
    n = 2 if kind == "i" else 1  # float32: a world of one, whose exact answer float_reference knows
    chunks = [(length + K_W - 1) // K_W for length in lengths]
    # float32: each slot's first round carries only exponents (later ones ride on the data rounds)
    rounds = sum(c + (min(c, SLOTS) if kind == "f" else 0) for c in chunks)
    rounds += 3  # the session's hello: a first round, one that every rank vouches for, the session's own
    rng = np.random.default_rng(seed)
    with FakeAggregator(kind, n, plan, rounds) as fake:
        with Session(JOB, 0, n, fake.address, SLOT_BASE, SLOTS, K_W, timeout=WAIT_S, rto=0.5, key=KEY_W) as s:
            for call, length in enumerate(lengths, start=1):
                if kind == "i":
                    x = rng.integers(-(2**31), 2**31, length, dtype=np.int64).astype(np.int32)
                    padded = np.zeros(chunks[call - 1] * K_W, np.int32)
                    for c in range(chunks[call - 1]):
                        padded[c * K_W : (c + 1) * K_W] = FakeAggregator.peer(call, c * K_W)
                    want = (x.astype(np.int64) + padded[:length]).astype(np.int32)
                else:
                    x = (rng.standard_normal(length) * 10.0 ** rng.integers(-20, 20)).astype(np.float32)
                    want = float_reference(x)
                s.allreduce(x)
                totals["sums"] += 1
                if not np.array_equal(x, want):
                    totals["wrong_sums"] += 1
                    raise AssertionError(f"call {call}: a forged or misplaced value was taken")
            stats = s.stats()
    # Every fuzzed RESULT came before the last correct answer, so the worker read and refused all.
    assert stats["stale"] >= fake.fuzzed, (stats, fake.fuzzed)
    assert stats["bad_key"] == fake.bad_key, (stats, fake.bad_key)
    assert stats["allreduces"] == len(lengths)
    totals["examples"] += 1
    totals["fuzzed"] += fake.fuzzed


WORKER_EXAMPLES = 200


@pytest.mark.reliability(
    "fuzzer",
    "worker result path: hypothesis, fuzzed RESULTs around the correct answers",
    outcome="exact; every fuzzed RESULT refused",
    recovery="none needed",
    state="nothing: the session goes on",
)
def test_the_worker_takes_no_fuzzed_result(reliability: Reliability) -> None:
    totals: Counter[str] = Counter()

    @settings(max_examples=WORKER_EXAMPLES, **FUZZ)
    @given(
        st.sampled_from(("i", "f")),
        st.lists(st.integers(1, 6 * K_W + 3), min_size=1, max_size=2),
        PLANS,
        st.integers(0, U32),
    )
    def run(kind: str, lengths: list[int], plan: list[list[Spec]], seed: int) -> None:
        worker_example(kind, lengths, plan, seed, totals)

    run()
    reliability.record(
        tried=f"worker result path: {totals['examples']} hypothesis examples, {totals['fuzzed']} fuzzed "
        "RESULTs (key, call, total, offset, slot, set, flags, length, replays, random bytes)",
        runs=totals["examples"],
        sums=totals["sums"],
        wrong=totals["wrong_sums"],
    )


def test_a_poisoned_answer_under_the_key_fails_the_call_cleanly() -> None:
    """The other side of the line surely_refused draws: the aggregator's own poisoned RESULT (it
    knows the key) ends the call with an error on the worker, never a sum."""
    plan: list[list[Spec]] = [[]]
    with FakeAggregator("i", 2, plan, 10**6) as fake:
        original = fake.answer

        def poisoned(pkt: bytes) -> bytes:
            out = original(pkt)
            if fields(out)["flags"] & FLAG_HELLO:  # the session opens; its call's answer is poisoned
                return out
            return with_field(out, "flags", fields(out)["flags"] | FLAG_MISMATCH)

        fake.answer = poisoned  # type: ignore[method-assign]
        with Session(JOB, 0, 2, fake.address, SLOT_BASE, SLOTS, K_W, timeout=WAIT_S, key=KEY_W) as s:
            x = np.arange(40, dtype=np.int32)
            with pytest.raises(_core.SwitchaggError, match="failed on every rank"):
                s.allreduce(x)
            assert (x == np.arange(40, dtype=np.int32)).all()
