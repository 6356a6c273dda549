"""The reducer pool (docs/CONTROLLER.md, The reducer pool): a real ``switchagg-ctl serve --reducers``
with three embedded reducers on loopback places striped jobs (one slot range per node, a key per
shard, each rank pinned per shard), Join answers with the shards, ``jobs`` shows them, and worker
processes sum exactly through them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc")
pytest.importorskip("yaml")

from switchagg_controller.model import Job, JobShard, WorkerAddr  # noqa: E402
from switchagg_controller.reducers import parse_reducers  # noqa: E402
from switchagg_controller.store import JobRecord, Store  # noqa: E402
from switchagg_controller.topology import TopologyError  # noqa: E402
from switchagg_lab.testing.controller import SECRET, Controller  # noqa: E402
from switchagg_lab.testing.kit import json_reports  # noqa: E402

K, SLOTS = 64, 8
LENGTH = 5 * K + 17  # three unequal shards: 2, 2 and 2 chunks, the last one short

# One rank: join (shards from $SWITCHAGG_SHARDS, else the pool's size), report the assignment,
# wait for a line on stdin (the test reads `jobs` meanwhile), then allreduce and report the sums.
WORKER = f"""
import json, sys
import numpy as np
from switchagg.session import Session
service, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Session.from_job_service(service, {SECRET!r}, name, n, timeout=20) as s:
    a = s.assignment
    print(json.dumps({{"rank": a.rank, "shards": [sh.__dict__ for sh in a.shards],
                      "local": s.local_addresses}}), flush=True)
    sys.stdin.readline()
    x = np.arange({LENGTH}, dtype=np.int32) * (a.rank + 1)
    s.allreduce(x)
    f = np.full({LENGTH}, 0.5 * (a.rank + 1), dtype=np.float32)
    s.allreduce(f)
    report = {{"rank": a.rank, "int": x.tolist(), "float": f.tolist(), "stats": s.stats()}}
    print(json.dumps(report), flush=True)
"""


def test_reducer_file_errors_name_the_line() -> None:
    ok = parse_reducers(
        "reducers:\n  - {name: r0, listen: 127.0.0.1:0}\n  - {name: r1, listen: 127.0.0.1:5}\n"
    )
    assert [r.name for r in ok] == ["r0", "r1"] and ok[1].listen == ("127.0.0.1", 5)
    with pytest.raises(TopologyError, match=r"f:3: reducers\[1\]: reducer 'r0'"):
        parse_reducers(
            "reducers:\n  - {name: r0, listen: 127.0.0.1:1}\n  - {name: r0, listen: 127.0.0.1:2}\n", "f"
        )
    with pytest.raises(TopologyError, match="control needs secret_file"):
        parse_reducers("reducers:\n  - {name: r0, listen: 127.0.0.1:1, control: 'unix:/x'}\n", "f")


def test_a_striped_job_survives_the_store(tmp_path: Path) -> None:
    shards = (JobShard("r0", 0, 8, 11, (5000, 5001)), JobShard("r2", 0, 8, 12, (5002, 5003)))
    job = Job(4, "big", 2, 0, 8, K, 9, (WorkerAddr(0, "10.0.0.1", 5000), WorkerAddr(1, "10.0.0.2", 5001)),
              key=11, shards=shards)  # fmt: skip
    store = Store(tmp_path / "s.db")
    store.save(JobRecord(job, "striped"))
    store.close()
    [record] = Store(tmp_path / "s.db").load()
    assert record.job == job and record.data_plane == "striped"


def _workers(ctl: Controller, name: str, n: int, shards: int | None) -> list[subprocess.Popen[str]]:
    env = {**os.environ}
    if shards is not None:
        env["SWITCHAGG_SHARDS"] = str(shards)
    return [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, ctl.address, name, str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for _ in range(n)
    ]


def _first_line(p: subprocess.Popen[str]) -> dict[str, Any]:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        p.wait(30)
        raise AssertionError(f"worker ended: {p.stderr.read() if p.stderr else ''}")
    report: dict[str, Any] = json.loads(line)
    return report


def test_serve_places_striped_jobs_on_the_reducer_pool(tmp_path: Path) -> None:
    pool = tmp_path / "reducers.yaml"
    pool.write_text("reducers:\n" + "".join(f"  - {{name: r{i}, listen: 127.0.0.1:0}}\n" for i in range(3)))
    ctl = Controller(tmp_path, ["--reducers", str(pool), "--sw-k", str(K), "--sw-slots", str(SLOTS)]).start()
    procs: list[subprocess.Popen[str]] = []
    try:
        assert " reducers 127.0.0.1:" in ctl.banner
        wide = _workers(ctl, "wide", 3, None)  # the pool's size by default: 3 shards
        procs += wide
        joined_wide = sorted((_first_line(p) for p in wide), key=lambda r: r["rank"])
        pair = _workers(ctl, "pair", 2, 2)
        procs += pair
        joined_pair = sorted((_first_line(p) for p in pair), key=lambda r: r["rank"])

        listed = {
            j["name"]: j for j in json.loads(ctl.ctl("jobs", "--json", *ctl.client_args()).stdout)["jobs"]
        }
        assert listed["wide"]["data_plane"] == "striped" and listed["pair"]["data_plane"] == "striped"
        assert [s["node"] for s in listed["wide"]["shards"]] == ["r0", "r1", "r2"]
        assert len(listed["pair"]["shards"]) == 2
        text = ctl.ctl("jobs", *ctl.client_args()).stdout
        assert "shard 2: r2 127.0.0.1:" in text, text
        # One range per node, never overlapping another job's on the same node.
        used: dict[str, list[tuple[int, int]]] = {}
        for job in listed.values():
            for s in job["shards"]:
                used.setdefault(s["node"], []).append((s["slot_base"], s["slot_base"] + s["slot_count"]))
        for ranges in used.values():
            ranges.sort()
            assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False)), used

        for joined in (joined_wide, joined_pair):
            for r in joined:
                shards = r["shards"]
                assert [s["index"] for s in shards] == list(range(len(shards)))
                assert [s["udp_port"] for s in shards] == [port for _, port in r["local"]]  # pinned per shard
                assert len({s["key"] for s in shards}) == len(shards) and all(s["key"] for s in shards)
            # Every rank is told the same nodes, ranges and keys.
            assert len({json.dumps([{**s, "udp_port": 0} for s in r["shards"]]) for r in joined}) == 1

        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for group, n in ((wide, 3), (pair, 2)):
            for report in json_reports(group, timeout=120):
                assert report["int"] == [i * n * (n + 1) // 2 for i in range(LENGTH)]
                assert report["float"] == [0.5 * n * (n + 1) / 2] * LENGTH  # exact in float32 here
                assert report["stats"]["allreduces"] == 2

        counters = json.loads(ctl.ctl("counters", "--json", *ctl.client_args()).stdout)
        planes = {p["data_plane"]: p for p in counters["data_planes"]}
        assert set(planes) >= {"striped:r0", "striped:r1", "striped:r2"}
    finally:
        for p in procs:
            p.kill()
        ctl.stop()


def test_rails_in_the_pool_file() -> None:
    specs = parse_reducers(
        "reducers:\n  - {name: r0, switch: a}\n  - {name: sw, listen: 127.0.0.1:0}\n"
        "  - {name: r1, switch: b}\n"
    )
    assert [(s.name, s.switch) for s in specs] == [("r0", "a"), ("sw", ""), ("r1", "b")]
    with pytest.raises(TopologyError, match="names a switch \\(a rail\\): it takes no other key"):
        parse_reducers("reducers:\n  - {name: r0, switch: a, listen: 127.0.0.1:1}\n", "f")
    with pytest.raises(TopologyError, match="reducer 'r1' \\(switch a\\) repeats reducer 'r0'"):
        parse_reducers("reducers:\n  - {name: r0, switch: a}\n  - {name: r1, switch: a}\n", "f")
    with pytest.raises(TopologyError, match="needs listen \\(a software reducer\\) or switch \\(a rail\\)"):
        parse_reducers("reducers:\n  - {name: r0}\n", "f")


def _rail_topology(name: str, subnet: int, hosts: int) -> Any:
    from switchagg_controller.model import HostPort, Topology

    return Topology(
        switch_address=f"unix:/nonexistent/{name}.sock",
        device_id=0,
        hosts=tuple(
            HostPort(f"h{i}", i + 1, f"02:00:00:00:{subnet:02x}:{i + 1:02x}", f"10.9.{subnet}.{i + 1}")
            for i in range(hosts)
        ),
        aggregator_ip=f"10.9.{subnet}.254",
        aggregator_mac=f"02:00:00:00:{subnet:02x}:fe",
        name=name,
    )


def test_a_striped_job_on_two_rails_is_one_job_per_switch() -> None:
    """Without switches: the pool's rails place a job on the P4 pool, and each switch's desired state
    holds its shard as a one-switch job with the shard's key and every rank's address on that rail."""
    import asyncio

    from switchagg import protocol
    from switchagg_controller import allocation, p4_program
    from switchagg_controller.planes import DataPlaneError, P4DataPlane
    from switchagg_controller.reducers import StripedDataPlane

    p4 = P4DataPlane([_rail_topology("a", 1, 2), _rail_topology("b", 2, 2)])
    specs = parse_reducers("reducers:\n  - {name: r0, switch: a}\n  - {name: r1, switch: b}\n")
    plane = StripedDataPlane(specs, [None, None], k=protocol.P4_K, default_slots=64, p4=p4)
    assert plane.pool_sizes() == {} and plane.node_pool("r1") == allocation.P4
    assert plane.node_address("r1") == ("10.9.2.254", protocol.UDP_PORT) and plane.shard_slots(2) == 64
    ips: list[tuple[str, ...]] = [("10.9.1.1", "10.9.2.1"), ("10.9.1.2", "10.9.2.2")]
    shards = plane.shards_of(["r0", "r1"], 128, 64, 77, [(5000, 5001), (6000, 6001)], ips)
    workers = (WorkerAddr(0, "10.9.1.1", 5000), WorkerAddr(1, "10.9.1.2", 6000))
    job = Job(3, "railed", 2, 128, 64, protocol.P4_K, 9, workers, counter_index=5, key=77, shards=shards)
    assert plane.job_pools(job) == (allocation.P4,)
    # No switch is connected: a restore keeps the views for the supervisors to apply.
    asyncio.run(plane.install(job, keep=True))
    (on_b,) = p4.rail_jobs("b")
    assert (on_b.slot_base, on_b.slot_count, on_b.counter_index) == (128, 64, 5)
    assert on_b.key == shards[1].key != job.key
    assert [(w.ip, w.udp_port, w.switch_port) for w in on_b.workers] == [
        ("10.9.2.1", 5001, 1),
        ("10.9.2.2", 6001, 2),
    ]
    entries = p4.desired("a").entries
    pinned = [
        dict(e.params)["ip"]
        for e in entries
        if e.table == p4_program.WORKER_TABLE and e.match[0] == ("job", 3)
    ]
    assert pinned == [p4_program.ip_int("10.9.1.1"), p4_program.ip_int("10.9.1.2")]
    asyncio.run(plane.remove(job))
    assert p4.rail_jobs("a") == p4.rail_jobs("b") == []
    # A rank whose address on a rail is not a host of that switch is refused before anything is pushed.
    wrong = Job(4, "wrong", 2, 0, 64, protocol.P4_K, 9, workers, key=1, shards=plane.shards_of(
        ["r0", "r1"], 0, 64, 1, [(5000, 5001), (6000, 6001)], None))  # fmt: skip
    with pytest.raises(DataPlaneError, match=r"from 10\.9\.1\.1, which is not a host of switch b"):
        asyncio.run(plane.install(wrong))
    with pytest.raises(DataPlaneError, match="rail switch a failed"):  # a live install needs the switch
        asyncio.run(plane.install(job))
    assert p4.rail_jobs("a") == []


def test_rails_need_the_topology(tmp_path: Path) -> None:
    pool = tmp_path / "rails.yaml"
    pool.write_text("reducers:\n  - {name: r0, switch: a}\n")
    with pytest.raises(RuntimeError, match="rail r0 names a switch: serve needs --topology with it"):
        Controller(tmp_path, ["--reducers", str(pool)]).start()
