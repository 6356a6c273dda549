"""Jobs for the bmv2 tests, with generations that are fresh for the whole session.

The switch's registers outlive a test, so two tests that used the same job, slots and
generation would see each other's slot state. Handing out a new generation per job (and
mapping a vector's own generation numbers consistently) keeps every test independent.
"""

from __future__ import annotations

import itertools

from switchagg import protocol
from switchagg_controller.model import Job, WorkerAddr
from switchagg_lab.bmv2.frames import result_port
from switchagg_lab.testbed import Endpoint

_generations = itertools.count(1)


def fresh_generation() -> int:
    g = next(_generations)
    if g > 0xFFFF:
        raise RuntimeError("ran out of 16-bit generations in one session")
    return g


class GenerationMap:
    """Maps one vector's generation numbers onto fresh ones, equal to equal."""

    def __init__(self) -> None:
        self._map: dict[int, int] = {}

    def __call__(self, g: int) -> int:
        if g not in self._map:
            self._map[g] = fresh_generation()
        return self._map[g]


def make_job(
    job_id: int,
    endpoints: list[Endpoint],
    slot_base: int,
    slot_count: int,
    counter_index: int,
    generation: int | None = None,
    udp_ports: list[int] | None = None,
) -> Job:
    """A K=64 job whose rank r is ``endpoints[r]``, receiving on ``udp_ports[r]`` (default: result_port)."""
    ports = udp_ports or [result_port(e) for e in endpoints]
    return Job(
        job_id=job_id,
        name=f"job{job_id}",
        n=len(endpoints),
        slot_base=slot_base,
        slot_count=slot_count,
        k=protocol.P4_K,
        generation=generation or fresh_generation(),
        workers=tuple(WorkerAddr(r, e.ip, ports[r], e.mac, e.port) for r, e in enumerate(endpoints)),
        counter_index=counter_index,
    )
