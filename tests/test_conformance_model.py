"""The conformance vectors against a register-level Python model of docs/PROTOCOL.md.

The model also has the leaf role (docs/PROTOCOL.md, Two levels), for tests/vectors/two_level.

Unlike the software aggregator, which gives every installed job fresh slot memory, the model keeps
one pool of registers that survive job removal, as on the switch. So it checks that the vectors
hold for switch semantics too (above all stale_generation), and, with the generation check taken
out, that the vectors notice.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import pytest

from switchagg.conformance import (
    Install,
    JobSpec,
    Remove,
    Send,
    Vector,
    check_counters,
    default_vector_dir,
    describe,
    load_vectors,
    two_level_vector_dir,
)
from switchagg.protocol import (
    DROP_REASONS,
    FLAG_MISMATCH,
    HEADER_FORMAT,
    HEADER_LEN,
    IDENTITY_FLAGS,
    LANE_BITS,
    LANE_FLAGS,
    MISMATCH_INFO_LEN,
    MSG_DATA,
    MSG_RESULT,
    POISON_FLAGS,
    POOL_SET_BIT,
    POOL_SLOT_MASK,
    VERSION,
    Header,
    scale_words,
)


@dataclass
class Slot:
    # Each set's stamp: its installation's generation and its round's session incarnation.
    gen: list[int] = field(default_factory=lambda: [0, 0])
    inc: list[int] = field(default_factory=lambda: [0, 0])
    bitmap: list[int] = field(default_factory=lambda: [0, 0])
    count: list[int] = field(default_factory=lambda: [0, 0])
    exp: list[int] = field(default_factory=lambda: [0, 0])
    value: list[list[int]] = field(default_factory=lambda: [[], []])
    final: list[bool] = field(default_factory=lambda: [False, False])  # leaf: the spine's result
    # The round's identity (its first contribution's) and the poison it got.
    call: list[int] = field(default_factory=lambda: [0, 0])
    total: list[int] = field(default_factory=lambda: [0, 0])
    offset: list[int] = field(default_factory=lambda: [0, 0])
    flags: list[int] = field(default_factory=lambda: [0, 0])
    poison: list[int] = field(default_factory=lambda: [0, 0])


TWO_LEVEL = load_vectors(two_level_vector_dir())


class SwitchModel:
    """One job table and one register pool for all jobs; endpoints stand for ingress ports."""

    def __init__(
        self,
        k: int,
        check_generation: bool = True,
        resend_partial: str = "first",
        lanes: bool = True,
        check_incarnation: bool = True,
    ) -> None:
        """``resend_partial``: which local ranks' resends re-send a waiting leaf's partial: "first"
        (the lowest, as specified), "any" or "none" (the last two for showing the vectors notice).
        ``lanes=False`` adds narrow-lane payloads as int32 words (to show the vectors notice)."""
        self.k = k
        self.check_generation = check_generation
        self.check_incarnation = check_incarnation
        self.lanes = lanes
        self.resend_partial = resend_partial
        self.slots = [Slot() for _ in range(1024)]
        self.jobs: dict[int, JobSpec] = {}
        self.drops = dict.fromkeys(DROP_REASONS, 0)
        self.counters: dict[int, dict[str, int]] = {}

    def install(self, job: JobSpec) -> None:
        self.jobs[job.id] = job
        self.counters[job.id] = dict.fromkeys(job.counter_names, 0)

    def remove(self, job_id: int) -> None:
        del self.jobs[job_id]
        del self.counters[job_id]

    def _drop(self, reason: str) -> list[tuple[int, bytes]]:
        self.drops[reason] += 1
        return []

    def receive(self, endpoint: int, pkt: bytes) -> list[tuple[int, bytes]]:
        if len(pkt) < HEADER_LEN:
            return self._drop("truncated")
        version, type_, flags, exp, job_id, rank, pool, elems, offset, call, total, inc = struct.unpack_from(
            HEADER_FORMAT, pkt
        )
        if version != VERSION:
            return self._drop("bad_version")
        if flags & LANE_FLAGS == LANE_FLAGS:  # LANES = 0x30 names no lane width
            return self._drop("bad_type")
        if type_ == MSG_RESULT:
            return self._receive_result(endpoint, pkt)
        if type_ != MSG_DATA:
            return self._drop("bad_type")
        job = self.jobs.get(job_id)
        if job is None:
            return self._drop("unknown_job")
        if rank >= job.n:
            return self._drop("bad_rank")
        if job.endpoints[rank] is None or job.endpoints[rank] != endpoint:
            return self._drop("spoofed")
        i, s = pool & POOL_SLOT_MASK, 1 if pool & POOL_SET_BIT else 0
        if not job.slot_base <= i < job.slot_base + job.slot_count:
            return self._drop("bad_pool")
        if len(pkt) != HEADER_LEN + 4 * self.k or elems != self.k:
            return self._drop("truncated")
        payload = list(struct.unpack_from(f"!{self.k}i", pkt, HEADER_LEN))
        c, slot, bit = self.counters[job_id], self.slots[i], 1 << rank

        def result(to_rank: int) -> tuple[int, bytes]:
            return self._result(job, slot, i, s, to_rank)

        m = sum(e is not None for e in job.endpoints)  # contributions that complete the slot here
        stamp = (job.generation, inc if self.check_incarnation else 0)
        if self.check_generation and (slot.gen[s], slot.inc[s]) != stamp:
            slot.gen[s], slot.inc[s] = stamp
            slot.bitmap[s], slot.count[s], slot.final[s] = 0, 0, False
        if not slot.bitmap[s] & bit:
            first = slot.bitmap[s] == 0
            slot.bitmap[s] |= bit
            if (slot.gen[1 - s], slot.inc[1 - s]) == stamp or not self.check_generation:
                slot.bitmap[1 - s] &= ~bit  # the other set's round, if it is this session's
            poison = flags & POISON_FLAGS
            if first:
                slot.value[s], slot.exp[s], slot.count[s] = payload, exp, 1
                slot.final[s], slot.offset[s], slot.flags[s] = False, offset, flags
                slot.call[s], slot.total[s], slot.poison[s] = call, total, poison
            else:
                ident = (call, total, offset, flags & IDENTITY_FLAGS)
                if ident != (slot.call[s], slot.total[s], slot.offset[s], slot.flags[s] & IDENTITY_FLAGS):
                    poison |= FLAG_MISMATCH
                if not slot.poison[s] and poison:  # the payload says who differed
                    info = payload if flags & POISON_FLAGS else [rank, call, total, flags]
                    slot.value[s] = [_i32(v) for v in info[:MISMATCH_INFO_LEN]] + slot.value[s][
                        MISMATCH_INFO_LEN:
                    ]
                elif not slot.poison[s]:  # the round's lanes: a contribution that adds has its identity
                    slot.value[s] = _add(slot.value[s], payload, slot.flags[s] if self.lanes else 0)
                slot.poison[s] |= poison
                slot.exp[s] = max(slot.exp[s], exp)
                slot.count[s] += 1
            c["aggregated"] += 1
            if slot.count[s] == m and job.leaf:
                c["upstream"] += 1
                return [self._partial(job, slot, i, s)]
            if slot.count[s] == m:
                c["multicast"] += 1
                return [result(r) for r in range(job.n)]
            return []
        if (job.leaf and slot.final[s]) or (slot.count[s] == m and not job.leaf):
            c["resent"] += 1
            return [result(rank)]
        first_local = next(r for r, e in enumerate(job.endpoints) if e is not None)
        asks = self.resend_partial == "any" or (self.resend_partial == "first" and rank == first_local)
        if slot.count[s] == m and asks:
            c["upstream_resent"] += 1
            return [self._partial(job, slot, i, s)]
        c["retrans_ignored"] += 1
        return []

    def _round(self, job: JobSpec, slot: Slot, i: int, s: int, type_: int, rank: int, key: int) -> bytes:
        """Set s's state as a packet: the round's identity and poison, value and exponent."""
        return Header(
            job=job.id, rank=rank, slot=i, shadow=s, offset=slot.offset[s], exp=slot.exp[s], type=type_,
            flags=slot.flags[s] | slot.poison[s], elems=self.k, call=slot.call[s], total=slot.total[s],
            key=key, values=slot.value[s],
        ).pack()  # fmt: skip

    def _result(self, job: JobSpec, slot: Slot, i: int, s: int, to_rank: int) -> tuple[int, bytes]:
        """RESULT(value[s]) to a local rank, with the job's key."""
        endpoint = job.endpoints[to_rank]
        assert endpoint is not None
        return endpoint, self._round(job, slot, i, s, MSG_RESULT, to_rank, job.key ^ slot.inc[s])

    def _partial(self, job: JobSpec, slot: Slot, i: int, s: int) -> tuple[int, bytes]:
        """A leaf's DATA to its spine: rank = leaf index, the stored partial and round identity."""
        assert job.upstream is not None
        return job.upstream, self._round(job, slot, i, s, MSG_DATA, job.leaf_index, slot.inc[s])

    def _receive_result(self, endpoint: int, pkt: bytes) -> list[tuple[int, bytes]]:
        _, _, flags, exp, job_id, rank, pool, elems, offset, call, total, key = struct.unpack_from(
            HEADER_FORMAT, pkt
        )
        job = self.jobs.get(job_id)
        if job is None or not job.leaf:
            return self._drop("bad_type")
        if rank != job.leaf_index:
            return self._drop("bad_rank")
        if endpoint != job.upstream:
            return self._drop("spoofed")
        i, s = pool & POOL_SLOT_MASK, 1 if pool & POOL_SET_BIT else 0
        if not job.slot_base <= i < job.slot_base + job.slot_count:
            return self._drop("bad_pool")
        if len(pkt) != HEADER_LEN + 4 * self.k or elems != self.k:
            return self._drop("truncated")
        slot, c = self.slots[i], self.counters[job_id]
        m = sum(e is not None for e in job.endpoints)
        waiting = slot.gen[s] == job.generation and slot.count[s] == m and not slot.final[s]
        ours = (key, call, total, offset, flags & IDENTITY_FLAGS) == (
            job.key ^ slot.inc[s],
            slot.call[s],
            slot.total[s],
            slot.offset[s],
            slot.flags[s] & IDENTITY_FLAGS,
        )
        if not waiting or not ours:
            c["stale_results"] += 1
            return []
        slot.value[s] = list(struct.unpack_from(f"!{self.k}i", pkt, HEADER_LEN))
        slot.exp[s], slot.final[s], slot.poison[s] = exp, True, flags & POISON_FLAGS
        c["multicast"] += 1
        return [self._result(job, slot, i, s, r) for r, e in enumerate(job.endpoints) if e is not None]


def _i32(v: int) -> int:
    return (v + 2**31) % 2**32 - 2**31


def _add(old: list[int], new: list[int], flags: int) -> list[int]:
    """old + new as the data plane adds payloads: int32 words for 32-bit lanes; for narrow lanes
    (docs/PROTOCOL.md, Narrow lanes) byte by byte, unlike the switch's word arithmetic: the scale
    bytes' unsigned max, then each lane's sum wrapped to its width."""
    bits = LANE_BITS[flags & LANE_FLAGS]
    if bits == 32:
        return [_i32(a + b) for a, b in zip(old, new, strict=True)]
    k, width = len(old), bits // 8
    a, b = (struct.pack(f"!{k}i", *words) for words in (old, new))
    head = 4 * scale_words(k, bits)
    out = bytearray(max(x, y) for x, y in zip(a[:head], b[:head], strict=True))
    for at in range(head, 4 * k, width):
        lane = int.from_bytes(a[at : at + width], "big") + int.from_bytes(b[at : at + width], "big")
        out += (lane % (1 << bits)).to_bytes(width, "big")
    return list(struct.unpack(f"!{k}i", out))


def run_on_model(vector: Vector, model: SwitchModel) -> None:
    for job in vector.jobs:
        model.install(job)
    for i, step in enumerate(vector.steps):
        if isinstance(step, Install):
            model.install(step.job)
        elif isinstance(step, Remove):
            model.remove(step.job_id)
        else:
            assert isinstance(step, Send)
            got = model.receive(step.endpoint, step.payload)
            by_endpoint: dict[int, list[bytes]] = {}
            for endpoint, payload in got:
                by_endpoint.setdefault(endpoint, []).append(payload)
            assert by_endpoint == step.expected_by_endpoint(), (
                f"{vector.name} step {i} ({step.note}):\n  got      {[(e, describe(p)) for e, p in got]}\n"
                f"  expected {[(e, describe(p)) for e, p in step.expect]}"
            )
    problems = check_counters(vector, model.drops, model.counters)
    assert not problems, f"{vector.name} counters: {problems}"


VECTORS = load_vectors(default_vector_dir())


@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
def test_vector_on_switch_model(vector: Vector) -> None:
    run_on_model(vector, SwitchModel(vector.k))


@pytest.mark.parametrize("vector", TWO_LEVEL, ids=[v.name for v in TWO_LEVEL])
def test_two_level_vector_on_switch_model(vector: Vector) -> None:
    run_on_model(vector, SwitchModel(vector.k))


@pytest.mark.parametrize(("resend", "step"), [("none", 4), ("any", 3)])
def test_two_level_vectors_catch_a_leaf_that_resends_its_partial_wrongly(resend: str, step: int) -> None:
    """Without the re-send upstream a lost partial or spine result would hang the job; with one
    per worker's resend a loss would cost the uplink m re-sends."""
    (v,) = [v for v in TWO_LEVEL if v.name == "leaf_retransmission"]
    with pytest.raises(AssertionError, match=f"leaf_retransmission step {step} "):
        run_on_model(v, SwitchModel(v.k, resend_partial=resend))


@pytest.mark.parametrize("name", ["lanes16", "lanes8", "leaf_lanes"])
def test_vectors_catch_int32_adds_of_narrow_lanes(name: str) -> None:
    """A data plane that adds narrow payloads as int32 words carries from lane to lane and adds scale
    bytes instead of taking their max."""
    (v,) = [v for v in VECTORS + TWO_LEVEL if v.name == name]
    with pytest.raises(AssertionError, match=f"{name} step 1 "):
        run_on_model(v, SwitchModel(v.k, lanes=False))


def test_vectors_catch_a_missing_generation_check() -> None:
    (stale,) = [v for v in VECTORS if v.name == "stale_generation"]
    with pytest.raises(AssertionError, match="stale_generation step"):
        run_on_model(stale, SwitchModel(stale.k, check_generation=False))


@pytest.mark.parametrize("name", ["session_incarnation", "leaf_session"])
def test_vectors_catch_a_missing_incarnation_check(name: str) -> None:
    """A data plane that stamps a set with its generation alone answers a new session's first packet
    with an earlier session's stored sum (docs/PROTOCOL.md, Sessions)."""
    (v,) = [v for v in VECTORS + TWO_LEVEL if v.name == name]
    with pytest.raises(AssertionError, match=f"{name} step"):
        run_on_model(v, SwitchModel(v.k, check_incarnation=False))
