"""The controller against a real bmv2 (simple_switch_grpc) in its own network namespace: push,
idempotent apply, entries and multicast groups read back, counters, mastership, restart
recovery by the supervisor, two jobs at once, and the software fallback. Skipped (with the
reason) where bmv2 or the built P4 program is missing."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from switchagg import jobclient, protocol
from switchagg_controller import p4_program
from switchagg_controller.model import Job, WorkerAddr
from switchagg_controller.p4rt import P4RuntimeError
from switchagg_controller.switch_session import SwitchSession
from switchagg_controller.topology import parse_topology
from switchagg_lab.bmv2.controller_switch import topology_yaml
from switchagg_lab.testbed.bmv2 import Bmv2Switch
from switchagg_lab.testing.controller import SECRET, Controller
from switchagg_lab.testing.kit import wait_until


def _job(job_id: int = 7, generation: int = 5, base: int = 0, count: int = 32, index: int = 0) -> Job:
    workers = (WorkerAddr(0, "10.0.0.1", 40000), WorkerAddr(1, "10.0.0.2", 40001))
    return Job(job_id, f"job{job_id}", 2, base, count, protocol.P4_K, generation, workers, index)


def _job_entries(conn: SwitchSession) -> dict[int, dict[str, int]]:
    """job id -> the job table entry's parameters, as read back from the switch."""
    table = conn.p4info.tables[p4_program.JOB_TABLE]
    out = {}
    for e in conn.read_table_entries():
        if e.table_id != table.id:
            continue
        a = e.action.action
        names = {p.id: p.name for p in conn.p4info.actions[a.action_id].params}
        job_id = int.from_bytes(e.match[0].exact.value, "big")
        out[job_id] = {names[p.param_id]: int.from_bytes(p.value, "big") for p in a.params}
    return out


def _reader(address: str) -> SwitchSession:
    return SwitchSession(address, 0, p4_program.P4INFO, primary=False).open()


def test_apply_is_idempotent_and_reads_back(bmv2: Bmv2Switch) -> None:
    topo = parse_topology(topology_yaml(bmv2.grpc_address))
    job = _job()
    state = p4_program.desired_state(topo, [job])
    with SwitchSession(bmv2.grpc_address, 0, p4_program.P4INFO, p4_program.BMV2_JSON) as conn:
        assert conn.is_primary and not conn.held_state  # a fresh switch: finsy pushed the pipeline
        assert conn.apply(state) == len(state.entries) + len(state.groups)
        assert conn.apply(state) == 0  # nothing differs: nothing is written

        entries = [e for e in conn.read_table_entries() if not e.is_default_action]
        assert len(entries) == len(state.entries)
        params = _job_entries(conn)[job.job_id]
        assert params["n"] == 2 and params["generation"] == 5
        assert (params["slot_base"], params["slot_count"]) == (0, 32)
        groups = {g.multicast_group_id: sorted((r.egress_port, r.instance) for r in g.replicas)
                  for g in conn.read_multicast_groups()}  # fmt: skip
        assert groups == {g.group_id: sorted(g.replicas) for g in state.groups}

        # A reinstall (new generation) modifies exactly the job's entry.
        assert conn.apply(p4_program.desired_state(topo, [replace(job, generation=6)])) == 1
        assert _job_entries(conn)[job.job_id]["generation"] == 6
        # Removing the job deletes its entries and its result group, nothing else.
        l2 = p4_program.desired_state(topo, [])
        assert conn.apply(l2) == (len(state.entries) - len(l2.entries)) + 1
        assert conn.apply(l2) == 0 and _job_entries(conn) == {}

        drops = conn.read_counter(p4_program.DROP_COUNTER)
        assert set(range(len(protocol.DROP_REASONS))) <= set(drops)
        assert all(v == (0, 0) for v in drops.values())  # no traffic was sent
        assert conn.read_counter(p4_program.DROP_COUNTER, 3) == {3: (0, 0)}
        with pytest.raises(KeyError, match="no counter 'nope'"):
            conn.read_counter("nope")


def test_a_second_controller_is_not_primary(bmv2: Bmv2Switch) -> None:
    topo = parse_topology(topology_yaml(bmv2.grpc_address))
    state = p4_program.desired_state(topo, [])
    json_path, p4info = p4_program.BMV2_JSON, p4_program.P4INFO
    with SwitchSession(bmv2.grpc_address, 0, p4info, json_path, election_id=(0, 2)) as first:
        assert first.is_primary
        with SwitchSession(bmv2.grpc_address, 0, p4info, json_path, election_id=(0, 1)) as second:
            assert not second.is_primary  # a backup: the switch refuses its writes
            with pytest.raises(P4RuntimeError, match="PERMISSION_DENIED|not primary|[Mm]aster"):
                second.apply(state)
        assert first.apply(state) > 0 and first.apply(state) == 0  # the primary still writes


def test_cli_push_twice_changes_nothing_the_second_time(bmv2: Bmv2Switch, tmp_path: Path) -> None:
    topo = tmp_path / "topology.yaml"
    topo.write_text(topology_yaml(bmv2.grpc_address))
    c = Controller(tmp_path, [])
    first = c.ctl("push", "--topology", str(topo)).stdout
    second = c.ctl("push", "--topology", str(topo)).stdout
    assert "0 change(s)" not in first and "change(s)" in first
    assert "0 change(s)" in second
    counters = c.ctl("counters", "--topology", str(topo)).stdout
    assert "bad_version 0" in counters and "spoofed 0" in counters
    (switch,) = json.loads(c.ctl("counters", "--topology", str(topo), "--json").stdout)["switches"]
    assert switch["drops"] == dict.fromkeys(protocol.DROP_REASONS, 0) and switch["jobs"] == []


def _join_pair(address: str, name: str, ports: tuple[int, int]) -> list[jobclient.Assignment]:
    """Two workers (hosts h1 and h2 of the topology) join ``name`` concurrently."""
    out: list[jobclient.Assignment] = []
    errors: list[BaseException] = []

    def one(ip: str, port: int) -> None:
        try:
            out.append(jobclient.join(address, SECRET, name, 2, ip, port, timeout=60))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=a) for a in (("10.0.0.1", ports[0]), ("10.0.0.2", ports[1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    return sorted(out, key=lambda a: a.rank)


def test_restart_recovery_and_two_jobs(bmv2: Bmv2Switch, tmp_path: Path) -> None:
    topo = tmp_path / "topology.yaml"
    topo.write_text(topology_yaml(bmv2.grpc_address))
    c = Controller(tmp_path, ["--topology", str(topo), "--reap-timeout", "600"]).start()
    try:
        a = _join_pair(c.address, "first", (40000, 40001))
        assert {x.data_plane for x in a} == {"p4"} and a[0].k == protocol.P4_K
        assert (a[0].aggregator_ip, a[0].aggregator_port) == ("10.0.0.254", protocol.UDP_PORT)
        reader = _reader(bmv2.grpc_address)
        try:
            assert _job_entries(reader)[a[0].job_id]["generation"] == a[0].generation
        finally:
            reader.close()

        bmv2.kill()  # the switch dies and comes back empty: no pipeline, no entries
        bmv2.start()

        def restored() -> bool:
            try:
                conn = _reader(bmv2.grpc_address)
            except P4RuntimeError:
                return False
            try:
                entry = _job_entries(conn).get(a[0].job_id)
            except P4RuntimeError:  # no pipeline yet
                return False
            finally:
                conn.close()
            return entry is not None and entry["generation"] != a[0].generation

        wait_until(restored, what="the supervisor to reprogram the restarted switch")
        new_gen = jobclient.heartbeat(c.address, SECRET, a[0])
        assert new_gen != a[0].generation

        # A second job while the first runs: its own slots, both on the switch.
        b = _join_pair(c.address, "second", (40002, 40003))
        assert b[0].job_id != a[0].job_id
        assert (
            b[0].slot_base >= a[0].slot_base + a[0].slot_count
            or b[0].slot_base + b[0].slot_count <= a[0].slot_base
        )
        reader = _reader(bmv2.grpc_address)
        try:
            jobs = _job_entries(reader)
            assert set(jobs) == {a[0].job_id, b[0].job_id}
            assert jobs[b[0].job_id]["slot_base"] == b[0].slot_base
            c.ctl("teardown", "first", *c.client_args())
            assert set(_job_entries(reader)) == {b[0].job_id}
        finally:
            reader.close()
        listing = c.ctl("jobs", *c.client_args()).stdout
        assert "second" in listing and "first" not in listing
    finally:
        c.stop()


def test_jobs_that_do_not_fit_on_the_switch_fall_back_to_software(bmv2: Bmv2Switch, tmp_path: Path) -> None:
    topo = tmp_path / "topology.yaml"
    topo.write_text(topology_yaml(bmv2.grpc_address))
    extra = ["--topology", str(topo), "--fallback", "--p4-slots", "600", "--software-listen", "127.0.0.1:0"]
    c = Controller(tmp_path, extra).start()
    try:
        first = _join_pair(c.address, "big1", (40010, 40011))
        second = _join_pair(c.address, "big2", (40012, 40013))
        assert first[0].data_plane == "p4" and first[0].k == protocol.P4_K
        assert second[0].data_plane == "software" and second[0].k == protocol.DEFAULT_SW_K
        assert second[0].aggregator_ip == "127.0.0.1"
        listing = c.ctl("jobs", *c.client_args()).stdout
        assert "p4" in listing and "software" in listing
    finally:
        c.stop()
