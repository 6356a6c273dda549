"""The P4 data plane places a job across leaves of one spine on the spine and every leaf it
crosses (docs/CONTROLLER.md, Two levels on P4 switches); the entries each switch gets."""

from __future__ import annotations

import pytest

from switchagg_controller import p4_program as p4
from switchagg_controller.model import Job, SwitchState
from switchagg_controller.planes import DataPlaneError, P4DataPlane
from switchagg_controller.topology import parse_topologies
from switchagg_lab.testing.topologies import LEAVES


def _plane() -> P4DataPlane:
    return P4DataPlane(parse_topologies(LEAVES, "net.yaml"))


def _job(plane: P4DataPlane, ips: list[str], job_id: int = 3) -> Job:
    workers = tuple(plane.worker_addr(r, ip, 40000 + r) for r, ip in enumerate(ips))
    return Job(job_id, "j", len(ips), 32, 8, 64, 9, workers, counter_index=2)


def _job_entry(state: SwitchState, job_id: int) -> tuple[str, dict[str, int | bytes]]:
    e = next(e for e in state.entries if e.table == p4.JOB_TABLE and e.match == (("job", job_id),))
    return e.action, dict(e.params)


def test_a_job_behind_two_leaves_runs_on_both_and_the_spine() -> None:
    plane = _plane()
    job = _job(plane, ["10.0.1.1", "10.0.0.1"])  # rank 0 behind l1, rank 1 behind l0
    assert plane.route(job) == ("spine", ["l0", "l1"])
    assert plane.switches_of(job) == ["spine", "l0", "l1"]
    assert plane.aggregator_of(job, 0) == ("10.0.1.254", 48879)
    assert plane.aggregator_of(job, 1) == ("10.0.0.254", 48879)
    plane.set_jobs([job])

    action, params = _job_entry(plane.desired("spine"), 3)
    assert action == "MyIngress.set_job" and params["n"] == 2 and params["slot_base"] == 32
    spine_workers = {
        dict(e.match)["rank"]: dict(e.params)
        for e in plane.desired("spine").entries
        if e.table == p4.WORKER_TABLE
    }
    assert (
        spine_workers
        == {  # leaf l is rank l, on the spine's port of its uplink, at its aggregator address
            0: {"port": 1, "ip": p4.ip_int("10.0.0.254"), "udp_port": 48879},
            1: {"port": 2, "ip": p4.ip_int("10.0.1.254"), "udp_port": 48879},
        }
    )
    for leaf, index, local in (("l0", 0, 1), ("l1", 1, 0)):
        state = plane.desired(leaf)
        action, params = _job_entry(state, 3)
        assert action == "MyIngress.set_leaf_job"
        assert (params["n"], params["m"], params["first_local"], params["leaf_index"]) == (2, 1, local, index)
        assert (params["up_port"], params["spine_ip"], params["spine_mac"]) == (
            100,
            p4.ip_int("10.0.9.254"),
            p4.mac_int("02:00:00:00:09:fe"),
        )
        assert [dict(e.match)["rank"] for e in state.entries if e.table == p4.WORKER_TABLE] == [local]
    assert not plane.bumped_by_restart(job, "l0")  # its other switches keep their rounds


def test_a_job_on_one_leaf_stays_there() -> None:
    plane = _plane()
    job = _job(plane, ["10.0.0.1"])
    assert plane.route(job) == (None, ["l0"]) and plane.switches_of(job) == ["l0"]
    plane.set_jobs([job])
    assert _job_entry(plane.desired("l0"), 3)[0] == "MyIngress.set_job"
    assert plane.jobs_on("spine") == [] and plane.jobs_on("l1") == []
    assert plane.bumped_by_restart(job, "l0") and not plane.bumped_by_restart(job, "spine")


def test_switches_without_a_common_spine_refuse_the_job() -> None:
    text = LEAVES.replace("    uplink: {switch: spine, port: 100, spine_port: 2}\n", "")
    plane = P4DataPlane(parse_topologies(text, "net.yaml"))
    job = _job(plane, ["10.0.0.1", "10.0.1.1"])
    with pytest.raises(DataPlaneError, match="leaves with uplinks to one spine"):
        plane.route(job)
