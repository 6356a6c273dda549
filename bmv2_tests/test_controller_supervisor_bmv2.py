"""The supervisor against a real bmv2, in this process: a restart is never reported as ready
before the restarted switch holds the whole desired state again.

The bug this covers: a measuring run (16 jobs of 8 workers, 282 entries) saw ``wait_ready()``
return True after a bmv2 restart with the push counter still at 1. The old supervisor polled the
switch every 0.5 s, and its readiness flag stayed set from the switch's death until the next
poll; a restart shorter than that (bmv2 --no-p4 is back within a few hundred milliseconds) was
reported ready at once. Here the stale window is made certain, not left to timing: the event
loop is kept busy (the kill and restart are blocking calls made on it, as a long apply would
hold it) from before the kill until after the new switch answers, so nothing can have noticed
the restart when ``wait_ready`` is asked.
"""

from __future__ import annotations

import asyncio

from switchagg import protocol
from switchagg_controller import p4_program, p4rt
from switchagg_controller.model import Job, WorkerAddr
from switchagg_controller.supervisor import RETRY_MAX, SwitchFleet, SwitchSupervisor
from switchagg_controller.topology import parse_topology
from switchagg_lab.bmv2.controller_switch import topology_yaml
from switchagg_lab.testbed.bmv2 import Bmv2Switch

HOSTS, JOBS = 8, 16


def _jobs() -> list[Job]:
    workers = tuple(WorkerAddr(r, f"10.0.0.{r + 1}", 40000 + r) for r in range(HOSTS))
    return [Job(j + 1, f"j{j}", HOSTS, 64 * j, 64, protocol.P4_K, j + 1, workers, j) for j in range(JOBS)]


async def _entries(address: str) -> int:
    async with p4rt.Reader(address, 0, p4_program.P4INFO) as r:
        return len([e for e in await p4rt.read_table_entries(r) if not e.is_default_action])


async def test_ready_after_a_restart_means_reprogrammed(bmv2: Bmv2Switch) -> None:
    topo = parse_topology(topology_yaml(bmv2.grpc_address, hosts=HOSTS))
    jobs = _jobs()
    state = p4_program.desired_state(topo, jobs)
    assert len(state.entries) == 282  # the measuring run's size
    restarts: list[int] = []
    sup = SwitchSupervisor(
        topo,
        p4_program.BMV2_JSON,
        p4_program.P4INFO,
        desired=lambda: p4_program.desired_state(topo, jobs),
        on_restart=lambda: restarts.append(sup.pushes),
    )
    async with SwitchFleet([sup]):
        assert await sup.wait_ready(60) and sup.pushes == 1 and sup.programmed == 1
        assert await _entries(bmv2.grpc_address) == 282
        # Blocking calls on the loop: nothing else runs on it meanwhile.
        bmv2.kill()
        bmv2.start()  # back, empty, and answering on the same unix socket path
        assert sup.ready  # stale, and nothing could have seen the restart yet
        assert await sup.wait_ready(120)
        assert sup.pushes == 2 and sup.programmed == 2 and restarts == [1, 2]
        assert await _entries(bmv2.grpc_address) == 282
        assert await sup.push() == 0  # the state is all there: a push changes nothing


async def test_a_switch_away_for_a_while_is_reprogrammed_when_it_is_back(bmv2: Bmv2Switch) -> None:
    """The supervisor's own connection loop: attempts that fail while the switch is away (its
    backoff grows to RETRY_MAX meanwhile) do not end it; the switch, back empty, gets everything."""
    topo = parse_topology(topology_yaml(bmv2.grpc_address, hosts=HOSTS))
    jobs = _jobs()
    sup = SwitchSupervisor(
        topo, p4_program.BMV2_JSON, p4_program.P4INFO, desired=lambda: p4_program.desired_state(topo, jobs)
    )
    async with SwitchFleet([sup]):
        assert await sup.wait_ready(60) and sup.programmed == 1
        bmv2.kill()
        await asyncio.sleep(3 * RETRY_MAX)  # several failed attempts, the backoff at its cap
        assert not sup.ready and sup.programmed == 1 and sup.last_error is not None
        bmv2.start()
        assert await sup.wait_ready(120)
        assert sup.pushes == 2 and sup.programmed == 2 and sup.reconnects >= 2
        assert await _entries(bmv2.grpc_address) == 282
