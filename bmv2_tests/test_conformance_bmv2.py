"""Every conformance vector (tests/vectors) through the P4 program on bmv2.

The same vectors the software aggregator passes (tests/test_conformance_software.py): endpoint
i of a vector is namespace endpoint i; packets are built and captured with scapy on raw
sockets. Each step ends at a barrier (bmv2_frames.Wire), so "nothing else arrived" is exact.
Result frames are also checked for their addresses and IPv4/UDP checksums.
"""

from __future__ import annotations

from typing import Any

import pytest
from bmv2_frames import counters, data_frame, delta, frame_problems
from bmv2_jobs import GenerationMap, make_job

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
)
from switchagg.protocol import P4_K
from switchagg_controller import p4_program
from switchagg_controller.model import Job

VECTORS = load_vectors(default_vector_dir())


def _job(spec: JobSpec, bed: Any, gens: GenerationMap, counter_index: int) -> Job:
    return make_job(
        spec.id,
        [bed.endpoints[e] for e in spec.endpoints],
        spec.slot_base,
        spec.slot_count,
        counter_index,
        generation=gens(spec.generation),
    )


def run_vector(vector: Vector, bed: Any, switch: Any, wire: Any) -> None:
    if vector.k != P4_K:
        pytest.skip(f"{vector.name}: K = {vector.k}, the P4 switch has K = {P4_K}")
    if vector.endpoints > len(bed.endpoints):
        pytest.skip(f"{vector.name} needs {vector.endpoints} endpoints, the testbed has {len(bed.endpoints)}")
    gens = GenerationMap()
    all_specs = list(vector.jobs) + [s.job for s in vector.steps if isinstance(s, Install)]
    index_of = {job_id: i for i, job_id in enumerate(dict.fromkeys(s.id for s in all_specs))}
    installed = {spec.id: _job(spec, bed, gens, index_of[spec.id]) for spec in vector.jobs}
    topo = bed.topology()
    switch.apply(p4_program.desired_state(topo, list(installed.values())))
    wire.drain()
    before = counters(switch, index_of)
    for i, step in enumerate(vector.steps):
        where = f"{vector.name} step {i}"
        if isinstance(step, Install):
            installed[step.job.id] = _job(step.job, bed, gens, index_of[step.job.id])
            switch.apply(p4_program.desired_state(topo, list(installed.values())))
            continue
        if isinstance(step, Remove):
            del installed[step.job_id]
            switch.apply(p4_program.desired_state(topo, list(installed.values())))
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
    drops, jobs = delta(before, counters(switch, index_of))
    problems = check_counters(vector, drops, jobs)
    assert not problems, f"{vector.name} counters: {problems}"


@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
def test_vector(vector: Vector, bed: Any, switch: Any, wire: Any) -> None:
    run_vector(vector, bed, switch, wire)
