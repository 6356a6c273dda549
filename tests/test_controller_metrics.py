"""`switchagg-ctl serve --metrics-port`: scraped over HTTP while a real job runs on the embedded
software aggregator (worker processes driven round by round, so each scrape knows what the
counters must say), and with a P4 switch that is not there (a `switchagg_switch_up 0` gauge, not
a failed or hanging scrape). Every scrape is validated by promtool where it is installed."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client", reason="the metrics need prometheus-client (pip install .[metrics])")
pytest.importorskip("finsy", reason="the controller needs its extra (pip install .[controller])")

from switchagg import protocol  # noqa: E402
from switchagg_controller import allocation  # noqa: E402
from switchagg_lab.testing.controller import SECRET, Controller, ctl_json, metrics_address  # noqa: E402
from switchagg_lab.testing.kit import free_port  # noqa: E402
from switchagg_lab.testing.prom import scrape, scrape_until, value  # noqa: E402
from switchagg_lab.testing.stepped import LENGTH, leave, read_line, step, stepped_worker  # noqa: E402

WAIT_S = 60.0


def test_metrics_move_as_a_job_runs_on_the_software_aggregator(software_controller: Controller) -> None:
    address = metrics_address(software_controller)
    idle = scrape(address)
    assert value(idle, "switchagg_service_jobs", state="active") == 0
    assert value(idle, "switchagg_service_jobs", state="pending") == 0
    assert value(idle, "switchagg_switch_up", data_plane="software") == 1
    assert value(idle, "switchagg_slots_free", data_plane="software") == allocation.SW_POOL_SLOTS
    assert value(idle, "process_cpu_seconds_total") > 0

    n, name = 2, "metrics-job"
    first = stepped_worker(software_controller, name, n)
    procs = [first]
    try:
        scrape_until(
            address, lambda s: value(s, "switchagg_service_jobs", state="pending") == 1, "a pending job"
        )
        (pending,) = ctl_json(software_controller, "jobs")["jobs"]
        assert pending["state"] == "pending" and pending["name"] == name and pending["world_size"] == n
        assert pending["job_id"] is None and len(pending["workers"]) == 1
        procs.append(stepped_worker(software_controller, name, n))
        joined = [read_line(p) for p in procs]
        job_id, k = joined[0]["job_id"], joined[0]["k"]
        chunks = -(-LENGTH // k)
        job = {"switchagg_job": name, "job_id": str(job_id), "data_plane": "software"}
        now = scrape(address)
        assert value(now, "switchagg_service_jobs", state="active") == 1
        assert value(now, "switchagg_service_jobs", state="pending") == 0
        assert value(now, "switchagg_job_aggregated_total", **job) == 0
        assert value(now, "switchagg_job_workers", **job) == n
        slots = value(now, "switchagg_job_slots", **job)
        assert slots == protocol.DEFAULT_SW_SLOTS
        assert value(now, "switchagg_slots_free", data_plane="software") == allocation.SW_POOL_SLOTS - slots
        assert value(now, "switchagg_join_seconds_count", outcome="ok") == n

        for round_ in (1, 2):
            hello = step(procs, n)  # the sessions' hello rounds count as rounds too
            now = scrape(address)  # the results came back: every contribution was counted
            assert value(now, "switchagg_job_aggregated_total", **job) == (round_ * chunks + hello) * n
            assert value(now, "switchagg_job_multicast_total", **job) == round_ * chunks + hello
            assert value(now, "switchagg_drops_total", data_plane="software") == 0
            assert (
                value(now, "switchagg_packets_received_total", data_plane="software") >= round_ * n * chunks
            )
        # The CLI's JSON says the same.
        (listed,) = ctl_json(software_controller, "jobs")["jobs"]
        assert listed["job_id"] == job_id and listed["state"] == "active" and listed["k"] == k
        assert listed["slot_count"] == slots and sorted(w["rank"] for w in listed["workers"]) == [0, 1]
        assert not any(w["left"] for w in listed["workers"])
        (plane,) = ctl_json(software_controller, "counters")["data_planes"]
        assert plane["data_plane"] == "software" and set(plane["drops"]) == set(protocol.DROP_REASONS)
        counts = {"job_id": job_id, "aggregated": (2 * chunks + hello) * n, "multicast": 2 * chunks + hello}
        # No resend count is asserted: on a loaded machine a loss-free run still resends when a timer
        # fires early (a tail probe while a peer is descheduled), answered from the stored result or
        # ignored, never counted as a contribution (the exact counts above).
        (listed_job,) = plane["jobs"]
        assert {name: listed_job[name] for name in counts} == counts
        assert set(listed_job) == {*counts, "resent", "retrans_ignored"}
        assert plane["total"]["rx"] >= 2 * n * chunks
        leave(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    gone = scrape_until(
        address, lambda s: value(s, "switchagg_service_jobs", state="active") == 0, "the job is removed"
    )
    assert not [key for key in gone if dict(key[1]).get("job_id") == str(job_id)]
    assert value(gone, "switchagg_slots_free", data_plane="software") == allocation.SW_POOL_SLOTS


def test_a_failed_join_is_observed_with_its_status(software_controller: Controller) -> None:
    from switchagg import jobclient

    address = metrics_address(software_controller)
    with pytest.raises(Exception, match="world size"):
        jobclient.join(software_controller.address, SECRET, "bad", 0, "127.0.0.1", 5000)
    assert value(scrape(address), "switchagg_join_seconds_count", outcome="invalid_argument") == 1


def test_a_switch_that_is_not_there_is_down_and_the_scrape_still_answers(tmp_path: Path) -> None:
    from switchagg_controller import p4_program
    from switchagg_controller.topology import load_topologies

    if not p4_program.BMV2_JSON.exists() or not p4_program.P4INFO.exists():
        pytest.skip(f"compiled P4 program missing ({p4_program.BMV2_JSON})")
    topo = tmp_path / "topo.yaml"
    example = (Path(__file__).parents[1] / "controller" / "topology.example.yaml").read_text()
    topo.write_text(example.replace("127.0.0.1:9559", f"127.0.0.1:{free_port()}"))  # nothing listens
    switch = load_topologies(str(topo))[0].name
    ctl = Controller(
        tmp_path,
        [
            "--topology", str(topo), "--fallback", "--switch-wait", "0.2", "--metrics-port", "0",
            "--software-listen", f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}",
        ],
    )  # fmt: skip
    ctl.start()
    try:
        address = metrics_address(ctl)
        for _ in range(3):  # again and again: a dead switch never makes a scrape fail
            s = scrape(address)
            assert value(s, "switchagg_switch_up", switch=switch, data_plane="p4") == 0
            assert value(s, "switchagg_switch_primary", switch=switch) == 0
            assert value(s, "switchagg_switch_up", data_plane="software") == 1
            assert not [
                key for key in s if key[0] == "switchagg_drops_total" and ("data_plane", "p4") in key[1]
            ]
            assert value(s, "switchagg_switch_programmed_total", switch=switch) == 0
    finally:
        ctl.stop()


def test_two_level_nodes_run_elsewhere_are_scraped_and_one_away_is_down(tmp_path: Path) -> None:
    """Spine and leaves as separate aggregator processes (read through their control services):
    each node's job counters say what the two-level algorithm did; a leaf that is killed is
    `switchagg_switch_up 0` while the scrape still answers for the others."""
    from switchagg_lab.testing.remote_nodes import remote_nodes, remote_nodes_spec
    from switchagg_lab.testing.topologies import LOOPBACK_WORKER_IPS as WORKER_IPS

    names = ("spine", "rack0", "rack1")  # remote_nodes' order
    nodes = remote_nodes(tmp_path)
    for a in nodes:
        a.start()
    ctl = Controller(
        tmp_path, ["--two-level", str(remote_nodes_spec(tmp_path, nodes)), "--metrics-port", "0"]
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        ctl.start()
        address = metrics_address(ctl)
        plane = {"data_plane": allocation.TWO_LEVEL}
        idle = scrape(address)
        for node in names:
            assert value(idle, "switchagg_switch_up", switch=node, **plane) == 1
            assert value(idle, "switchagg_slots_free", switch=node, **plane) == allocation.SW_POOL_SLOTS

        n, name = len(WORKER_IPS), "racks"
        procs = [stepped_worker(ctl, name, n, ip) for ip in WORKER_IPS]
        job_id, k = read_line(procs[0])["job_id"], read_line(procs[1])["k"]
        for p in procs[2:]:
            read_line(p)
        chunks = -(-LENGTH // k)
        chunks += step(procs, n)  # the sessions' hello rounds go up and down like the call's chunks
        s = scrape(address)
        job = {"switchagg_job": name, "job_id": str(job_id), **plane}
        # Each leaf sums its two workers and sends one partial up per chunk; the spine sums the
        # two leaves' partials and multicasts one result per chunk.
        for leaf in ("rack0", "rack1"):
            assert value(s, "switchagg_job_aggregated_total", switch=leaf, **job) == 2 * chunks
            assert value(s, "switchagg_job_upstream_total", switch=leaf, **job) == chunks
            assert value(s, "switchagg_job_workers", switch=leaf, **job) == n
        assert value(s, "switchagg_job_aggregated_total", switch="spine", **job) == 2 * chunks
        assert value(s, "switchagg_job_multicast_total", switch="spine", **job) == chunks
        for node in names:
            assert value(s, "switchagg_drops_total", switch=node, **plane) == 0

        nodes[2].kill()  # rack1 is away: down, its counters left out, the others still read
        s = scrape(address)
        assert value(s, "switchagg_switch_up", switch="rack1", **plane) == 0
        assert not [key for key in s if ("switch", "rack1") in key[1] and key[0] != "switchagg_switch_up"]
        assert value(s, "switchagg_switch_up", switch="spine", **plane) == 1
        assert value(s, "switchagg_job_upstream_total", switch="rack0", **job) == chunks
    finally:
        for p in procs:
            p.kill()
        ctl.stop()
        for a in nodes:
            a.stop()
