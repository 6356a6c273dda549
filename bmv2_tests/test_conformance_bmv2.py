"""Every conformance vector (tests/vectors) through the P4 program on bmv2.

The same vectors the software aggregator passes (tests/test_conformance_software.py): endpoint
i of a vector is namespace endpoint i; packets are built and captured with scapy on raw
sockets. The two-level vectors (tests/vectors/two_level) install the switch as a leaf whose
spine is the vector's ``upstream`` endpoint (its port is the upstream port). Each step ends at
a barrier (bmv2_frames.Wire), so "nothing else arrived" is exact. Result frames (and a leaf's
partials) are also checked for their addresses and IPv4/UDP checksums.
"""

from __future__ import annotations

from typing import Any

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
from switchagg.protocol import P4_K
from switchagg_controller import p4_program
from switchagg_controller.model import Job, WorkerAddr
from switchagg_lab.bmv2.frames import counters, data_frame, delta, frame_problems, result_port
from switchagg_lab.bmv2.switch_jobs import GenerationMap

VECTORS = load_vectors(default_vector_dir())
TWO_LEVEL = load_vectors(two_level_vector_dir())


def _job(spec: JobSpec, bed: Any, gens: GenerationMap, counter_index: int) -> Job:
    """The vector's job with rank r at endpoint ``spec.endpoints[r]`` (a leaf's job: its local ranks)."""
    workers = tuple(
        WorkerAddr(r, e.ip, result_port(e), e.mac, e.port)
        for r, e in ((r, bed.endpoints[i]) for r, i in enumerate(spec.endpoints) if i is not None)
    )
    return Job(
        job_id=spec.id,
        name=f"job{spec.id}",
        n=spec.n,
        slot_base=spec.slot_base,
        slot_count=spec.slot_count,
        k=P4_K,
        generation=gens(spec.generation),
        workers=workers,
        counter_index=counter_index,
        key=spec.key,
    )


def _leaf(spec: JobSpec, bed: Any) -> p4_program.LeafRole | None:
    if spec.upstream is None:
        return None
    spine = bed.endpoints[spec.upstream]
    return p4_program.LeafRole(spec.leaf_index, spine.port, spine.mac, spine.ip, result_port(spine))


def run_vector(vector: Vector, bed: Any, switch: Any, wire: Any) -> None:
    if vector.k != P4_K:
        pytest.skip(f"{vector.name}: K = {vector.k}, the P4 switch has K = {P4_K}")
    if vector.endpoints > len(bed.endpoints):
        pytest.skip(f"{vector.name} needs {vector.endpoints} endpoints, the testbed has {len(bed.endpoints)}")
    gens = GenerationMap()
    all_specs = list(vector.jobs) + [s.job for s in vector.steps if isinstance(s, Install)]
    index_of = {job_id: i for i, job_id in enumerate(dict.fromkeys(s.id for s in all_specs))}
    leaf_jobs = {spec.id for spec in all_specs if spec.leaf}
    installed = {spec.id: _job(spec, bed, gens, index_of[spec.id]) for spec in vector.jobs}
    leaves = {spec.id: role for spec in vector.jobs if (role := _leaf(spec, bed)) is not None}
    topo = bed.topology()

    def apply() -> None:
        switch.apply(p4_program.desired_state(topo, list(installed.values()), leaves))

    apply()
    wire.drain()
    before = counters(switch, index_of, leaf_jobs)
    for i, step in enumerate(vector.steps):
        where = f"{vector.name} step {i}"
        if isinstance(step, Install):
            installed[step.job.id] = _job(step.job, bed, gens, index_of[step.job.id])
            if (role := _leaf(step.job, bed)) is not None:
                leaves[step.job.id] = role
            apply()
            continue
        if isinstance(step, Remove):
            del installed[step.job_id]
            leaves.pop(step.job_id, None)
            apply()
            continue
        assert isinstance(step, Send)
        cap = wire.exchange(step.endpoint, [data_frame(bed.endpoints[step.endpoint], step.payload)])
        expected = step.expected_by_endpoint()
        for e in bed.endpoints:
            got = cap.results(e.index)
            want = expected.get(e.index, [])
            assert [describe(p) for p in got] == [describe(p) for p in want], (
                f"{where} ({step.note}): endpoint {e.index}"
            )
            assert got == want, f"{where} ({step.note}): endpoint {e.index} payload bytes differ"
            for f in cap.frames[e.index]:
                problems = frame_problems(f, e)
                assert not problems, f"{where}: result frame to endpoint {e.index}: {problems}"
    drops, jobs = delta(before, counters(switch, index_of, leaf_jobs))
    problems = check_counters(vector, drops, jobs)
    assert not problems, f"{vector.name} counters: {problems}"


@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
def test_vector(vector: Vector, bed: Any, switch: Any, wire: Any) -> None:
    run_vector(vector, bed, switch, wire)


@pytest.mark.parametrize("vector", TWO_LEVEL, ids=[v.name for v in TWO_LEVEL])
def test_two_level_vector(vector: Vector, bed: Any, switch: Any, wire: Any) -> None:
    """The leaf role of the P4 program: the vectors the software leaf passes, unchanged."""
    run_vector(vector, bed, switch, wire)
