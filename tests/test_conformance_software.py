"""Every conformance vector (tests/vectors) against a real SoftwareAggregator over UDP on 127.0.0.1.

One socket per endpoint; jobs are installed with those sockets' addresses, so spoofing is
detectable. Steps are serialised on the aggregator's rx counter: a step's datagram has been
processed (and its results sent) once rx counts it, so the next step cannot overtake it.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Iterator

import pytest

from switchagg.aggregator import SoftwareAggregator
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
from switchagg.protocol import P4_K, P4_NUM_SLOTS
from switchagg_lab.testing.kit import wait_rx

VECTORS = load_vectors(default_vector_dir())
TWO_LEVEL = load_vectors(two_level_vector_dir())  # the leaf role; the endpoint `upstream` plays the spine
WAIT_S = 10.0  # generous: only guards against a hang
QUIET_S = 0.2  # final check that nothing else arrives


@pytest.fixture
def aggregator() -> Iterator[SoftwareAggregator]:
    with SoftwareAggregator() as agg:
        yield agg


def _install(agg: SoftwareAggregator, job: JobSpec, k: int, socks: list[socket.socket]) -> None:
    addrs = [None if e is None else socks[e].getsockname() for e in job.endpoints]
    upstream = None if job.upstream is None else socks[job.upstream].getsockname()
    agg.add_job(
        job.id, job.n, job.slot_base, job.slot_count, k, job.generation, addrs,
        upstream=upstream, leaf_index=job.leaf_index, key=job.key,
    )  # fmt: skip


def _recv(sock: socket.socket, timeout: float) -> bytes | None:
    ready, _, _ = select.select([sock], [], [], timeout)
    return sock.recv(65536) if ready else None


def _pending(socks: list[socket.socket], timeout: float) -> dict[int, bytes]:
    """Datagrams already waiting (or arriving within ``timeout``), one per endpoint at most."""
    ready, _, _ = select.select(socks, [], [], timeout)
    return {socks.index(s): s.recv(65536) for s in ready}


def run_vector(vector: Vector, agg: SoftwareAggregator) -> None:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(vector.endpoints)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        for job in vector.jobs:
            _install(agg, job, vector.k, socks)
        sent = 0
        for i, step in enumerate(vector.steps):
            where = f"{vector.name} step {i}"
            if isinstance(step, Install):
                _install(agg, step.job, vector.k, socks)
                continue
            if isinstance(step, Remove):
                agg.remove_job(step.job_id)
                continue
            assert isinstance(step, Send)
            socks[step.endpoint].sendto(step.payload, agg.address)
            sent += 1
            wait_rx(agg, sent)
            expected = step.expected_by_endpoint()
            for endpoint, payloads in expected.items():
                for n, want in enumerate(payloads):
                    got = _recv(socks[endpoint], WAIT_S)
                    assert got is not None, f"{where} ({step.note}): endpoint {endpoint} got no packet {n}"
                    assert got == want, (
                        f"{where} ({step.note}): endpoint {endpoint} packet {n}\n"
                        f"  got      {describe(got)}\n  expected {describe(want)}"
                    )
            # Results of this step were sent before rx counted it; anything else here is extra.
            extra = _pending(socks, 0.0)
            assert not extra, (
                f"{where} ({step.note}): unexpected {[(e, describe(p)) for e, p in extra.items()]}"
            )
        extra = _pending(socks, QUIET_S)
        assert not extra, f"{vector.name} end: unexpected {[(e, describe(p)) for e, p in extra.items()]}"
        c = agg.counters()
        problems = check_counters(vector, c["drops"], c["jobs"])
        assert not problems, f"{vector.name} counters: {problems}"
        assert c["rx"] == sent
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
def test_vector(vector: Vector, aggregator: SoftwareAggregator) -> None:
    run_vector(vector, aggregator)


@pytest.mark.parametrize("vector", TWO_LEVEL, ids=[v.name for v in TWO_LEVEL])
def test_two_level_vector(vector: Vector, aggregator: SoftwareAggregator) -> None:
    run_vector(vector, aggregator)


def test_vectors_fit_the_p4_switch() -> None:
    """The bmv2 suite runs these vectors unchanged: K = 64, n <= 4, slots inside the P4 pool (the
    two-level ones too, for the P4 leaf role)."""
    for v in VECTORS + TWO_LEVEL:
        assert v.k == P4_K, v.name
        jobs = list(v.jobs) + [s.job for s in v.steps if isinstance(s, Install)]
        for j in jobs:
            assert j.n <= 4 and j.slot_base + j.slot_count <= P4_NUM_SLOTS, (v.name, j)
        assert v.endpoints <= 4, v.name


def test_vectors_cover_every_drop_reason() -> None:
    seen = {r for v in VECTORS for r, n in v.drops.items() if n}
    assert seen == set(v for v in VECTORS[0].drops)
