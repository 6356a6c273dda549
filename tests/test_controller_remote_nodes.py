"""Two levels with nodes the controller does not run: a spine and two leaves, each a separate
``switchagg-aggregator --control`` process, installed by a real ``switchagg-ctl serve --two-level``
through their control services; 2 leaves x 2 worker processes on loopback, int32 exact; a leaf
killed and restarted while a job runs is reconciled by the controller."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from switchagg.aggregator_control import ControlError, RemoteAggregator
from switchagg_controller.allocation import TWO_LEVEL
from switchagg_controller.topology import TopologyError
from switchagg_controller.two_level_spec import parse_two_level
from switchagg_lab.testing.controller import SECRET, Controller, collect, expected_int_sum, start_workers
from switchagg_lab.testing.job_worker import expected
from switchagg_lab.testing.kit import wait_until
from switchagg_lab.testing.reliability import Reliability
from switchagg_lab.testing.remote_nodes import NODE_SECRET, remote_nodes, remote_nodes_spec
from switchagg_lab.testing.stepped import LENGTH, WAIT_S, leave, read_line, step, stepped_worker
from switchagg_lab.testing.topologies import LOOPBACK_WORKER_IPS as WORKER_IPS


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
    # Stepped workers (one allreduce per stdin line): the job cannot end before the leaf dies,
    # however slow the machine (a free-running job of a few rounds could finish first, and a
    # job that is gone is rightly not reinstalled).
    nodes = remote_nodes(tmp_path)
    for a in nodes:
        a.start()
    c = Controller(tmp_path, ["--two-level", str(remote_nodes_spec(tmp_path, nodes))]).start()
    rack1, n = nodes[2], len(WORKER_IPS)
    procs = [stepped_worker(c, "long", n, ip) for ip in WORKER_IPS]
    try:
        for p in procs:
            read_line(p)  # joined
        for _ in range(3):
            step(procs, n)
        with RemoteAggregator(rack1.target, NODE_SECRET, timeout=2.0) as remote:
            assert any(j["aggregated"] > 0 for j in remote.counters()["jobs"].values())
            for p in procs:  # one round in flight while the leaf dies
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            rack1.kill()
            rack1.start()  # the same address, empty
            wait_until(
                lambda: _holds_jobs(remote), 30, "the controller reinstalls the job on the restarted leaf"
            )
            sums = [_sum_or_none(p) for p in procs]
            exact = sums == [int(expected(LENGTH, 1, n)[0])] * n
            if exact:
                for _ in range(3):  # and the job goes on through the restarted leaf
                    step(procs, n)
                leave(procs)
                assert remote.counters()["rx"] > 0
        # docs/PROTOCOL.md, Restarting a leaf: exact, or every worker fails with its session
        # timeout (a round some local worker had finished); never a wrong sum.
        reliability.record(
            sums=n * (6 if exact else 3) + sum(x is not None for x in sums),
            outcome="exact" if exact else "failed cleanly",
        )
        if not exact:
            for p, got in zip(procs, sums, strict=True):
                _, err = p.communicate(timeout=WAIT_S)
                assert got is None or got == int(expected(LENGTH, 1, n)[0]), err[-800:]
                assert "differ" not in err
            print(f"\nleaf restart: the job failed cleanly (sums {sums})")
        log = c.stop()
        assert "two-level node 2 reconciled: 1 job(s) installed" in log
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        c.stop()
        for a in nodes:
            a.stop()


def _holds_jobs(remote: RemoteAggregator) -> bool:
    try:
        return bool(remote.jobs())
    except ControlError:  # not serving yet
        return False


def _sum_or_none(p: subprocess.Popen[str]) -> int | None:
    """The step's sum, or None if the worker ended (its session timed out)."""
    assert p.stdout is not None
    line = p.stdout.readline()
    return json.loads(line)["sum"] if line else None


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
        rack1.add_job(
            9, 2, 100, 4, 8, 1, [("127.0.2.8", 5000), ("127.0.2.9", 5001)], key=9
        )  # removed meanwhile
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
