"""The controller's mapping onto p4/switchagg.p4 (and p4/include/): entries, groups, refusals, and
names that exist."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from switchagg import protocol
from switchagg_controller import p4_program as p4
from switchagg_controller.model import HostPort, Job, Topology, WorkerAddr


def _topology(n: int = 3) -> Topology:
    hosts = tuple(
        HostPort(f"h{i}", i + 1, f"02:00:00:00:00:{i + 1:02x}", f"10.9.0.{i + 1}") for i in range(n)
    )
    return Topology("127.0.0.1:50051", 0, hosts, "10.9.0.254", "02:00:00:00:00:fe")


def _job(n: int = 3, **kw: object) -> Job:
    workers = tuple(WorkerAddr(r, f"10.9.0.{r + 1}", 40000 + r) for r in range(n))
    base = Job(
        job_id=7,
        name="j",
        n=n,
        slot_base=16,
        slot_count=8,
        k=64,
        generation=5,
        workers=workers,
        key=0xC0FFEE01,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_l2_entries_cover_hosts_broadcast_and_aggregator() -> None:
    topo = _topology()
    entries = p4.l2_entries(topo)
    unicast = {e.match[0][1]: dict(e.params)["port"] for e in entries if e.action == "MyIngress.l2_unicast"}
    assert unicast == {0x020000000001: 1, 0x020000000002: 2, 0x020000000003: 3}
    bcast = [e for e in entries if e.action == "MyIngress.l2_broadcast"]
    assert [e.match for e in bcast] == [(("dst_mac", 0xFFFFFFFFFFFF),)]
    agg = [e for e in entries if e.table == p4.AGGREGATOR_TABLE]
    assert agg[0].match == (("dst_ip", 0x0A0900FE),) and agg[0].params == (("mac", 0x0200000000FE),)
    assert p4.l2_groups(topo)[0].replicas == ((1, 0), (2, 0), (3, 0))


def test_job_state_resolves_ports_and_macs_from_topology() -> None:
    entries, groups = p4.job_state(_job(), _topology())
    job_entry = next(e for e in entries if e.table == p4.JOB_TABLE)
    assert dict(job_entry.params) == {
        "n": 3,
        "mgrp": p4.JOB_GROUP_BASE,
        "slot_base": 16,
        "slot_count": 8,
        "generation": 5,
        "counter_index": 0,
        "key": 0xC0FFEE01,  # the job's result key, written into every RESULT
    }
    workers = {dict(e.match)["rank"]: dict(e.params) for e in entries if e.table == p4.WORKER_TABLE}
    assert workers[2] == {"port": 3, "ip": 0x0A090003, "udp_port": 40002}
    results = {dict(e.match)["rank"]: dict(e.params) for e in entries if e.table == p4.RESULT_TABLE}
    assert results[1] == {"mac": 0x020000000002, "ip": 0x0A090002, "udp_port": 40001}
    assert groups[0].group_id == p4.JOB_GROUP_BASE and groups[0].replicas == ((1, 0), (2, 1), (3, 2))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"k": 128}, "K = 64"),
        ({"slot_base": 1020}, "outside the pool"),
        ({"generation": 0}, "generation"),
        ({"key": 2**32}, "result key"),
        ({"counter_index": p4.MAX_JOBS}, "counter index"),
        ({"n": 4, "workers": _job(3).workers}, "each rank"),
        ({"n": 33}, "outside 1..32"),
    ],
)
def test_refuses_jobs_the_program_cannot_run(change: dict[str, object], message: str) -> None:
    with pytest.raises(p4.ProgramError, match=message):
        p4.job_state(_job(**change), _topology())  # type: ignore[arg-type]


def test_refuses_rank_on_unknown_host() -> None:
    job = _job(
        workers=(WorkerAddr(0, "10.9.0.1", 1), WorkerAddr(1, "10.9.0.1", 2), WorkerAddr(2, "10.1.1.1", 3))
    )
    with pytest.raises(p4.ProgramError, match="not a host in the topology"):
        p4.job_state(job, _topology())


def test_desired_state_refuses_collisions() -> None:
    topo = _topology()
    a = _job()
    b = replace(a, job_id=8, counter_index=1, slot_base=24)
    state = p4.desired_state(topo, [a, b])
    assert {g.group_id for g in state.groups} == {
        p4.BROADCAST_GROUP,
        p4.JOB_GROUP_BASE,
        p4.JOB_GROUP_BASE + 1,
    }
    assert len({e.key for e in state.entries}) == len(state.entries)
    with pytest.raises(p4.ProgramError, match="overlap"):
        p4.desired_state(topo, [a, replace(b, slot_base=20)])
    with pytest.raises(p4.ProgramError, match="counter index"):
        p4.desired_state(topo, [a, replace(b, counter_index=0)])
    with pytest.raises(p4.ProgramError, match="twice"):
        p4.desired_state(topo, [a, replace(b, job_id=7)])


def _declared_in_p4(name: str) -> bool:
    """Declared in p4/switchagg.p4's own controls, or in a control of p4/include/ that keeps the
    name with @name(".MyIngress.x") (the instance's name would otherwise prefix it)."""
    local = name.split(".", 1)[1]
    declaration = rf"\b(table|action|counter|register)\b[^;{{]*\b{local}\b"
    if re.search(declaration, p4.P4_SOURCE.read_text()):
        return True
    included = "\n".join(f.read_text() for f in sorted((p4.P4_SOURCE.parent / "include").glob("*.p4")))
    return re.search(rf'@name\("\.{re.escape(name)}"\)\s*{declaration}', included) is not None


def _p4_sources() -> str:
    files = [p4.P4_SOURCE, *sorted((p4.P4_SOURCE.parent / "include").glob("*.p4"))]
    return "\n".join(f.read_text() for f in files)


def test_names_exist_in_the_p4_source() -> None:
    topo = _topology()
    state = p4.desired_state(topo, [_job()])
    names = {e.table for e in state.entries} | {e.action for e in state.entries}
    names |= {p4.DROP_COUNTER, *p4.JOB_COUNTER_NAMES.values(), *p4.REGISTERS}
    for name in names:
        assert _declared_in_p4(name), name
    src = _p4_sources()
    assert f"const bit<32> MAX_JOBS    = {p4.MAX_JOBS};" in src
    for reason, index in protocol.DROP_INDEX.items():
        assert re.search(rf"const bit<32> DROP_{reason.upper()}\s*= {index};", src), reason


LEAF = p4.LeafRole(
    index=1, up_port=9, spine_mac="02:00:00:00:01:fe", spine_ip="10.9.1.254", spine_udp_port=48879
)


def _leaf_job() -> Job:
    """Job 7 of n = 5 with ranks 2 and 4 behind this switch (hosts h1 and h2)."""
    return _job(n=5, workers=(WorkerAddr(4, "10.9.0.3", 40004), WorkerAddr(2, "10.9.0.2", 40002)))


def test_leaf_job_entry_names_local_count_first_rank_and_spine() -> None:
    entries, groups = p4.job_state(_leaf_job(), _topology(), LEAF)
    job_entry = next(e for e in entries if e.table == p4.JOB_TABLE)
    assert job_entry.action == "MyIngress.set_leaf_job"
    assert dict(job_entry.params) == {
        "n": 5,
        "m": 2,
        "first_local": 2,
        "leaf_index": 1,
        "mgrp": p4.JOB_GROUP_BASE,
        "slot_base": 16,
        "slot_count": 8,
        "generation": 5,
        "counter_index": 0,
        "up_port": 9,
        "spine_mac": 0x0200000001FE,
        "spine_ip": 0x0A0901FE,
        "spine_udp_port": 48879,
        "key": 0xC0FFEE01,
    }
    # Only the local ranks have worker and result entries and multicast replicas.
    assert sorted(dict(e.match)["rank"] for e in entries if e.table == p4.WORKER_TABLE) == [2, 4]
    assert sorted(dict(e.match)["rank"] for e in entries if e.table == p4.RESULT_TABLE) == [2, 4]
    assert groups[0].replicas == ((2, 2), (3, 4))


def test_desired_state_installs_leaf_roles_by_job_id() -> None:
    state = p4.desired_state(_topology(), [_leaf_job()], {7: LEAF})
    assert [e.action for e in state.entries if e.table == p4.JOB_TABLE] == ["MyIngress.set_leaf_job"]
    with pytest.raises(p4.ProgramError, match="not installed"):
        p4.desired_state(_topology(), [_leaf_job()], {8: LEAF})
    with pytest.raises(p4.ProgramError, match="each rank"):
        p4.desired_state(_topology(), [_leaf_job()])  # without its role the job lacks ranks


@pytest.mark.parametrize(
    ("role", "workers", "message"),
    [
        (LEAF, (), "local ranks"),
        (LEAF, (WorkerAddr(5, "10.9.0.2", 1),), "local ranks"),
        (replace(LEAF, index=32), None, "leaf index"),
        (replace(LEAF, up_port=511), None, "upstream port"),
        (replace(LEAF, spine_udp_port=0), None, "spine UDP port"),
        (replace(LEAF, spine_mac="nope"), None, "bad MAC"),
    ],
)
def test_refuses_leaf_roles_the_program_cannot_run(
    role: p4.LeafRole, workers: tuple[WorkerAddr, ...] | None, message: str
) -> None:
    job = _leaf_job() if workers is None else replace(_leaf_job(), workers=workers)
    with pytest.raises(p4.ProgramError, match=message):
        p4.job_state(job, _topology(), role)


def test_leaf_names_exist_in_the_p4_source() -> None:
    state = p4.desired_state(_topology(), [_leaf_job()], {7: LEAF})
    names = {e.action for e in state.entries} | set(p4.LEAF_COUNTER_NAMES.values())
    for name in names:
        assert _declared_in_p4(name), name
    assert set(p4.LEAF_COUNTER_NAMES) == set(protocol.LEAF_COUNTERS)
