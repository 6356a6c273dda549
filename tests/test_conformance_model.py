"""The conformance vectors against a register-level Python model of docs/PROTOCOL.md.

Unlike the software aggregator, which gives every installed job fresh slot memory, the model keeps
one pool of registers that survive job removal, as on the switch. So it checks that the vectors
hold for switch semantics too (above all stale_generation), and, with the generation check taken
out, that the vectors notice.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import pytest
from test_conformance_software import VECTORS

from switchagg.conformance import Install, JobSpec, Remove, Send, Vector, check_counters, describe
from switchagg.protocol import (
    DROP_REASONS,
    HEADER_FORMAT,
    HEADER_LEN,
    JOB_COUNTERS,
    MSG_DATA,
    MSG_RESULT,
    POOL_SET_BIT,
    POOL_SLOT_MASK,
    VERSION,
)


@dataclass
class Slot:
    gen: int = 0
    bitmap: list[int] = field(default_factory=lambda: [0, 0])
    count: list[int] = field(default_factory=lambda: [0, 0])
    exp: list[int] = field(default_factory=lambda: [0, 0])
    value: list[list[int]] = field(default_factory=lambda: [[], []])


class SwitchModel:
    """One job table and one register pool for all jobs; endpoints stand for ingress ports."""

    def __init__(self, k: int, check_generation: bool = True) -> None:
        self.k = k
        self.check_generation = check_generation
        self.slots = [Slot() for _ in range(1024)]
        self.jobs: dict[int, JobSpec] = {}
        self.drops = dict.fromkeys(DROP_REASONS, 0)
        self.counters: dict[int, dict[str, int]] = {}

    def install(self, job: JobSpec) -> None:
        self.jobs[job.id] = job
        self.counters[job.id] = dict.fromkeys(JOB_COUNTERS, 0)

    def remove(self, job_id: int) -> None:
        del self.jobs[job_id]
        del self.counters[job_id]

    def _drop(self, reason: str) -> list[tuple[int, bytes]]:
        self.drops[reason] += 1
        return []

    def receive(self, endpoint: int, pkt: bytes) -> list[tuple[int, bytes]]:
        if len(pkt) < HEADER_LEN:
            return self._drop("truncated")
        version, type_, flags, exp, job_id, rank, pool, elems, offset = struct.unpack_from(HEADER_FORMAT, pkt)
        if version != VERSION:
            return self._drop("bad_version")
        if type_ != MSG_DATA:
            return self._drop("bad_type")
        job = self.jobs.get(job_id)
        if job is None:
            return self._drop("unknown_job")
        if rank >= job.n:
            return self._drop("bad_rank")
        if job.endpoints[rank] != endpoint:
            return self._drop("spoofed")
        i, s = pool & POOL_SLOT_MASK, 1 if pool & POOL_SET_BIT else 0
        if not job.slot_base <= i < job.slot_base + job.slot_count:
            return self._drop("bad_pool")
        if len(pkt) != HEADER_LEN + 4 * self.k or elems != self.k:
            return self._drop("truncated")
        payload = list(struct.unpack_from(f"!{self.k}i", pkt, HEADER_LEN))
        c, slot, bit = self.counters[job_id], self.slots[i], 1 << rank

        def result(to_rank: int) -> tuple[int, bytes]:
            head = struct.pack(
                HEADER_FORMAT, version, MSG_RESULT, flags, slot.exp[s], job_id, to_rank, pool, elems, offset
            )
            return job.endpoints[to_rank], head + struct.pack(f"!{self.k}i", *slot.value[s])

        if self.check_generation and slot.gen != job.generation:
            slot.gen, slot.bitmap, slot.count = job.generation, [0, 0], [0, 0]
        if not slot.bitmap[s] & bit:
            first = slot.bitmap[s] == 0
            slot.bitmap[s] |= bit
            slot.bitmap[1 - s] &= ~bit
            if first:
                slot.value[s], slot.exp[s], slot.count[s] = payload, exp, 1
            else:
                slot.value[s] = [
                    (a + b + 2**31) % 2**32 - 2**31 for a, b in zip(slot.value[s], payload, strict=True)
                ]
                slot.exp[s] = max(slot.exp[s], exp)
                slot.count[s] += 1
            c["aggregated"] += 1
            if slot.count[s] == job.n:
                c["multicast"] += 1
                return [result(r) for r in range(job.n)]
            return []
        if slot.count[s] == job.n:
            c["resent"] += 1
            return [result(rank)]
        c["retrans_ignored"] += 1
        return []


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


@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
def test_vector_on_switch_model(vector: Vector) -> None:
    run_on_model(vector, SwitchModel(vector.k))


def test_vectors_catch_a_missing_generation_check() -> None:
    (stale,) = [v for v in VECTORS if v.name == "stale_generation"]
    with pytest.raises(AssertionError, match="stale_generation step"):
        run_on_model(stale, SwitchModel(stale.k, check_generation=False))
