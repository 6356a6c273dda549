"""Two levels with nodes the controller does not run: a spine and two leaves, each a separate
``switchagg-aggregator --control`` process, installed by a real ``switchagg-ctl serve --two-level``
through their control services; 2 leaves x 2 worker processes on loopback, int32 exact; a leaf
killed and restarted while a job runs is reconciled by the controller."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from switchagg.aggregator_control import ControlError, RemoteAggregator
from switchagg_controller.allocation import TWO_LEVEL
from switchagg_controller.topology import TopologyError
from switchagg_controller.two_level_spec import parse_two_level
from switchagg_lab.testing.controller import SECRET, Controller, collect, expected_int_sum, start_workers
from switchagg_lab.testing.job_worker import PROGRAM
from switchagg_lab.testing.reliability import Reliability
from switchagg_lab.testing.remote_nodes import NODE_SECRET, remote_nodes, remote_nodes_spec
from switchagg_lab.testing.topologies import LOOPBACK_WORKER_IPS as WORKER_IPS

ROUNDS, LENGTH = 30, 20000


def test_remote_node_file_errors() -> None:
    with pytest.raises(TopologyError, match="control needs secret_file too"):
        parse_two_level("spine: {listen: 127.0.0.1:1, control: 'unix:/x'}\nleaves: []\n")
    with pytest.raises(TopologyError, match="needs its real port, not 0"):
        parse_two_level(
            "spine: {listen: 127.0.0.1:1}\nleaves:\n"
            "  - {name: a, listen: 127.0.0.2:0, subnets: [10.0.0.0/8], control: 'unix:/x', secret_file: s}\n"
        )
    spec = parse_two_level(
        "spine: {listen: 127.0.0.1:1, control: '127.0.0.1:50061', secret_file: s}\n"
        "leaves:\n  - {name: a, listen: 127.0.0.2:1, subnets: [10.0.0.0/8]}\n",
        base=Path("/etc/switchagg"),
    )
    assert spec.spine_remote is not None and spec.spine_remote.secret_file == Path("/etc/switchagg/s")
    assert spec.leaves[0].remote is None


def test_a_node_serving_elsewhere_than_its_listen_address_is_refused(tmp_path: Path) -> None:
    nodes = remote_nodes(tmp_path)
    for a in nodes:
        a.start()
    try:
        spec = remote_nodes_spec(tmp_path, nodes)
        spec.write_text(spec.read_text().replace(f"127.0.2.254:{nodes[2].port}", "127.0.2.254:9"))
        c = Controller(tmp_path, ["--two-level", str(spec)])
        with pytest.raises(RuntimeError, match=r"rack1 aggregator .* serves on 127.0.2.254:\d+, not on"):
            c.start()
    finally:
        for a in nodes:
            a.stop()


def test_remote_spine_and_leaves_sum_exactly(tmp_path: Path) -> None:
    nodes = remote_nodes(tmp_path)
    for a in nodes:
        a.start()
    c = Controller(tmp_path, ["--two-level", str(remote_nodes_spec(tmp_path, nodes))]).start()
    try:
        spine, r0, r1 = (f"{a.host}:{a.port}" for a in nodes)
        assert f"two-level spine {spine} leaves {r0},{r1}" in c.banner
        procs = start_workers(c.address, SECRET, "racks", 4, 3000, seed=2, bind_ips=WORKER_IPS)
        results = collect(procs)
        total, head = expected_int_sum(4, 3000, 2)
        assert {r["data_plane"] for r in results} == {TWO_LEVEL}
        for r in results:
            assert r["int_sum"] == total and r["int_head"] == head
        for a in nodes:  # every node carried the job, and refused nothing
            with RemoteAggregator(a.target, NODE_SECRET) as remote:
                counters = remote.counters()
                assert counters["rx"] > 0 and sum(counters["drops"].values()) == 0
                assert remote.jobs() == {}  # the workers left: the controller removed the job
        listed = json.loads(c.ctl("counters", "--json", *c.client_args()).stdout)
        planes = {p["data_plane"]: p for p in listed["data_planes"]}
        assert planes["two-level:rack1"]["total"]["rx"] > 0
    finally:
        c.stop()
        for a in nodes:
            a.stop()


@pytest.mark.reliability(
    "aggregator restarted",
    "two-level through the controller: a remote leaf (switchagg-aggregator --control) SIGKILLed "
    "mid-job, restarted empty on its address and reconciled, 4 ranks",
    recovery="exact: the controller reinstalls the job; failed: the session timeout",
    state="the job reinstalled on the restarted leaf",
)
def test_a_leaf_restarted_under_a_running_job_is_reconciled(tmp_path: Path, reliability: Reliability) -> None:
    nodes = remote_nodes(tmp_path)
    for a in nodes:
        a.start()
    c = Controller(tmp_path, ["--two-level", str(remote_nodes_spec(tmp_path, nodes))]).start()
    rack1 = nodes[2]
    try:
        configs = [
            {
                "service": c.address,
                "secret": SECRET,
                "name": "long",
                "n": len(WORKER_IPS),
                "ip": ip,
                "length": LENGTH,
                "iterations": ROUNDS,
                "leave": True,
            }  # fmt: skip
            for ip in WORKER_IPS
        ]
        procs = [
            subprocess.Popen(
                [*PROGRAM, json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for cfg in configs
        ]
        with RemoteAggregator(rack1.target, NODE_SECRET, timeout=2.0) as remote:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # wait until the job runs through rack1
                jobs = remote.counters()["jobs"]
                if any(j["aggregated"] > 0 for j in jobs.values()):
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("the job never reached rack1")
            rack1.kill()
            rack1.start()  # the same address, empty
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the controller reinstalls the job on it
                try:
                    if remote.jobs():
                        break
                except ControlError:
                    pass
                time.sleep(0.1)
            else:
                raise AssertionError("the controller did not reinstall the job on the restarted leaf")
            outcomes = []
            for p in procs:
                out, err = p.communicate(timeout=180)
                outcomes.append((p.returncode, out, err))
            after = remote.counters()
        # docs/PROTOCOL.md, Restarting a leaf: exact, or every worker fails with its session
        # timeout (a round some local worker had finished); never a wrong sum.
        codes = [code for code, _, _ in outcomes]
        reliability.record(
            sums=ROUNDS * codes.count(0), outcome="exact" if codes == [0] * 4 else "failed cleanly"
        )
        if codes == [0, 0, 0, 0]:
            for _, out, _ in outcomes:
                assert json.loads(out.strip().splitlines()[-1])["ok"] == ROUNDS
            assert after["rx"] > 0  # the job went on through the restarted leaf
        else:
            for code, out, err in outcomes:
                assert code != 0 or json.loads(out.strip().splitlines()[-1])["ok"] == ROUNDS, err[-800:]
                assert "differ" not in err
            print(f"\nleaf restart: the job failed cleanly (exit codes {codes})")
        log = c.stop()
        assert "two-level node 2 reconciled: 1 job(s) installed" in log
    finally:
        c.stop()
        for a in nodes:
            a.stop()


async def test_reconcile_makes_a_node_hold_exactly_its_part(tmp_path: Path) -> None:
    """A node that was unreachable may hold a job removed meanwhile, or miss one installed."""
    from switchagg_controller.model import Job, WorkerAddr
    from switchagg_controller.software_nodes import close_nodes, open_nodes
    from switchagg_controller.two_level_plane import TwoLevelDataPlane
    from switchagg_controller.two_level_spec import load_two_level

    nodes = remote_nodes(tmp_path)
    for a in nodes:
        a.start()
    handles, warnings = open_nodes(load_two_level(remote_nodes_spec(tmp_path, nodes)))
    try:
        assert warnings == []
        plane = TwoLevelDataPlane(
            load_two_level(remote_nodes_spec(tmp_path, nodes)), handles[0], handles[1:], k=64
        )
        workers = tuple(WorkerAddr(r, ip, 7000 + r) for r, ip in enumerate(WORKER_IPS))
        job = Job(5, "j", 4, 0, 16, 64, 3, workers)
        rack0_only = Job(6, "r0", 1, 16, 8, 64, 4, (WorkerAddr(0, "127.0.1.9", 7100),))
        await plane.install(job)
        await plane.install(rack0_only)
        rack1 = handles[2]
        assert set(rack1.jobs()) == {5}
        rack1.add_job(9, 2, 100, 4, 8, 1, [("127.0.2.8", 5000), ("127.0.2.9", 5001)])  # removed meanwhile
        assert plane.reconcile(2, [job, rack0_only]) == (0, 1)
        assert set(rack1.jobs()) == {5}
        rack1.remove_job(5)  # lost (e.g. the node restarted)
        assert plane.reconcile(2, [job, rack0_only]) == (1, 0)
        assert plane.reconcile(2, [job, rack0_only]) == (0, 0)  # idempotent
        installed = rack1.jobs()[5]
        assert (installed.n, installed.slot_base, installed.slot_count) == (4, 0, 16)
        assert plane.reconcile(0, [job, rack0_only]) == (0, 0)  # the spine has both already
    finally:
        close_nodes(handles)
        for a in nodes:
            a.stop()
