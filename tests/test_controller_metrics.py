"""`switchagg-ctl serve --metrics-port`: scraped over HTTP while a real job runs on the embedded
software aggregator (worker processes driven round by round, so each scrape knows what the
counters must say), and with a P4 switch that is not there (a `switchagg_switch_up 0` gauge, not
a failed or hanging scrape). Every scrape is validated by promtool where it is installed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client", reason="the metrics need prometheus-client (pip install .[metrics])")
pytest.importorskip("finsy", reason="the controller needs its extra (pip install .[controller])")

from controller_support import SECRET, Controller, free_port  # noqa: E402
from test_metrics import Samples, scrape, value  # noqa: E402

from switchagg import protocol  # noqa: E402
from switchagg_controller import allocation  # noqa: E402

WAIT_S = 60.0
LENGTH = 3 * protocol.DEFAULT_SW_K + 5  # 4 chunks per int32 allreduce

# Joins, then one allreduce per line read from stdin (printing a line after each); leaves at EOF.
STEPPED_WORKER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from switchagg import Session
    service, secret, name = sys.argv[1:4]
    n, length, ip = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    with Session.from_job_service(service, secret, name, n, bind=(ip, 0), join_timeout=60.0) as s:
        print(json.dumps({"job_id": s.assignment.job_id, "k": s.assignment.k}), flush=True)
        for _ in sys.stdin:
            x = np.full(length, s.assignment.rank + 1, dtype=np.int32)
            s.allreduce(x)
            print(json.dumps({"sum": int(x[0])}), flush=True)
    """
)


def metrics_address(ctl: Controller) -> tuple[str, int]:
    url = ctl.banner.split("metrics on http://")[1].split("/")[0]
    host, _, port = url.rpartition(":")
    return host, int(port)


def ctl_json(ctl: Controller, command: str, *args: str) -> dict[str, Any]:
    out = ctl.ctl(command, *ctl.client_args(), "--json", *args).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def eventually(address: tuple[str, int], ok: object, what: str) -> Samples:
    deadline = time.monotonic() + WAIT_S
    while True:
        samples = scrape(address)
        if ok(samples):  # type: ignore[operator]
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.05)


@pytest.fixture
def software_controller(tmp_path: Path) -> Iterator[Controller]:
    ctl = Controller(
        tmp_path,
        [
            "--software",
            "--software-listen",
            f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}",
            "--metrics-port",
            "0",
        ],
    )
    ctl.start()
    yield ctl
    ctl.stop()


def _worker(ctl: Controller, name: str, n: int, ip: str = "127.0.0.1") -> subprocess.Popen[str]:
    cmd = [sys.executable, "-c", STEPPED_WORKER, ctl.address, SECRET, name, str(n), str(LENGTH), ip]
    return subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _line(p: subprocess.Popen[str]) -> dict[str, int]:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise AssertionError(f"worker ended: {p.communicate(timeout=WAIT_S)[1]}")
    result: dict[str, int] = json.loads(line)
    return result


def _step(procs: list[subprocess.Popen[str]], n: int) -> None:
    """One allreduce on every worker; each must see the sum of ranks + 1."""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    assert [_line(p)["sum"] for p in procs] == [n * (n + 1) // 2] * n


def _leave(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
        assert p.wait(WAIT_S) == 0, p.communicate()[1]


def test_metrics_move_as_a_job_runs_on_the_software_aggregator(software_controller: Controller) -> None:
    address = metrics_address(software_controller)
    idle = scrape(address)
    assert value(idle, "switchagg_service_jobs", state="active") == 0
    assert value(idle, "switchagg_service_jobs", state="pending") == 0
    assert value(idle, "switchagg_switch_up", data_plane="software") == 1
    assert value(idle, "switchagg_slots_free", data_plane="software") == allocation.SW_POOL_SLOTS
    assert value(idle, "process_cpu_seconds_total") > 0

    n, name = 2, "metrics-job"
    first = _worker(software_controller, name, n)
    procs = [first]
    try:
        eventually(
            address, lambda s: value(s, "switchagg_service_jobs", state="pending") == 1, "a pending job"
        )
        (pending,) = ctl_json(software_controller, "jobs")["jobs"]
        assert pending["state"] == "pending" and pending["name"] == name and pending["world_size"] == n
        assert pending["job_id"] is None and len(pending["workers"]) == 1
        procs.append(_worker(software_controller, name, n))
        joined = [_line(p) for p in procs]
        job_id, k = joined[0]["job_id"], joined[0]["k"]
        chunks = -(-LENGTH // k)
        job = {"job": name, "job_id": str(job_id), "data_plane": "software"}
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
            _step(procs, n)
            now = scrape(address)  # the results came back: every contribution was counted
            assert value(now, "switchagg_job_aggregated_total", **job) == round_ * n * chunks
            assert value(now, "switchagg_job_multicast_total", **job) == round_ * chunks
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
        counts = {"aggregated": 2 * n * chunks, "multicast": 2 * chunks, "resent": 0, "retrans_ignored": 0}
        assert plane["jobs"] == [{"job_id": job_id, **counts}]
        assert plane["total"]["rx"] >= 2 * n * chunks
        _leave(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    gone = eventually(
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
    from test_controller_remote_nodes import WORKER_IPS, _nodes, _spec

    names = ("spine", "rack0", "rack1")  # _nodes' order
    nodes = _nodes(tmp_path)
    for a in nodes:
        a.start()
    ctl = Controller(tmp_path, ["--two-level", str(_spec(tmp_path, nodes)), "--metrics-port", "0"])
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
        procs = [_worker(ctl, name, n, ip) for ip in WORKER_IPS]
        job_id, k = _line(procs[0])["job_id"], _line(procs[1])["k"]
        for p in procs[2:]:
            _line(p)
        chunks = -(-LENGTH // k)
        _step(procs, n)
        s = scrape(address)
        job = {"job": name, "job_id": str(job_id), **plane}
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
