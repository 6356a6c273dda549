"""P4 switches as rails (docs/CONTROLLER.md, Rails): two bmv2 switches, three worker namespaces each
cabled to both (one interface per rail). ``switchagg-ctl serve --topology`` programs both switches,
the reducer pool names them as rails, and a Join with shards=2 (each worker bound per rail) gets one
slot range on each switch, shard s through rail s: the JoinReply's shards carry each rail's
aggregator address, every worker's int32 sums are exact and its float32 sums within the
protocol's bound, and each switch's job counters show that it aggregated exactly its shard.
Skipped, with the reason, where bmv2 or the compiled P4 program is missing.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from switchagg import protocol
from switchagg.striping import shard_bounds
from switchagg_lab.bmv2.controller_jobs import job_counters, worker_reports
from switchagg_lab.bmv2.skip import skip_reason
from switchagg_lab.testing.controller import SECRET, Controller
from switchagg_lab.testing.job_worker import PROGRAM

WORKERS, RAILS = 3, 2
LENGTH, ITERATIONS, FLOAT_SIZE = 1000, 3, 1000  # 16 chunks of K=64 a call: 8 through each rail


@pytest.fixture
def rails(tmp_path: Path) -> Iterator[Any]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    from switchagg_lab.testbed.rails import P4Rails

    with P4Rails(WORKERS, RAILS, tmp_path / "rails") as bed:
        yield bed


def test_a_job_striped_across_two_bmv2_rails(rails: Any, tmp_path: Path) -> None:
    _striped_job(rails, tmp_path)


@pytest.mark.reliability(
    "loss",
    "bmv2 rails: 10% of frames lost each way on every worker's link to rail 1 (nftables), "
    "3 ranks striped over 2 rails x 4 allreduces",
    sums=4 * WORKERS,
    recovery="every loss repaired by its own shard's resends (rail 0 untouched)",
    state="nothing: rules removed",
)
def test_a_rail_that_loses_frames_repairs_its_own_shard(rails: Any, tmp_path: Path) -> None:
    """Loss on one rail stalls only that rail's shard, whose resends repair it: every sum exact, each
    rail aggregated exactly its shard, and only rail 1's workers resent."""
    lossy = rails.endpoints[1]
    for e in lossy:
        e.set_loss(10)
    reports = _striped_job(rails, tmp_path)
    lost = [e.lost_each_way() for e in lossy]
    assert sum(out for out, _ in lost) > 0 and sum(back for _, back in lost) > 0, lost  # both ways
    assert sum(r["retransmits"][1] for r in reports) > 0 and sum(r["retransmits"][0] for r in reports) == 0, (
        reports
    )


def _step(procs: list[subprocess.Popen[str]]) -> int:
    """ITERATIONS int32 allreduces, one per line to every worker; the hello rounds each rail took."""
    for _ in range(ITERATIONS):
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        lines = [_line(p) for p in procs]
        assert all("sum" in line for line in lines)
    # Each rail's sessions said hello in rounds of their own (docs/PROTOCOL.md, Sessions); a worker's
    # count is its shards' together, the same rounds on each rail here (fresh switches).
    assert all(line["hello_rounds"] % RAILS == 0 for line in lines), lines
    return int(lines[0]["hello_rounds"]) // RAILS


def _striped_job(rails: Any, tmp_path: Path) -> list[dict[str, Any]]:
    """A job of WORKERS joined with shards = RAILS, ITERATIONS int32 allreduces and a float32 one,
    everything checked; the workers' reports."""
    from switchagg_controller import p4_program
    from switchagg_controller.topology import dump_topologies
    from switchagg_lab.testbed.rails import rail_ip

    topo = tmp_path / "network.yaml"
    topo.write_text(dump_topologies([rails.topology(r) for r in range(RAILS)]))
    pool = tmp_path / "rails.yaml"
    pool.write_text("reducers:\n" + "".join(f"  - {{name: r{r}, switch: rail{r}}}\n" for r in range(RAILS)))
    c = Controller(tmp_path, ["--topology", str(topo), "--reducers", str(pool), "--reap-timeout", "600"])
    c.start(listen=f"unix:{tmp_path}/jobs.sock")
    procs: list[subprocess.Popen[str]] = []
    try:
        assert " rails r0=rail0,r1=rail1 " in c.banner, c.banner
        for w in range(WORKERS):
            cfg = {
                "service": c.address, "secret": SECRET, "name": "railed", "n": WORKERS,
                "ips": rails.addresses(w), "length": LENGTH, "timeout": 30, "stdin": True,
                "float_size": FLOAT_SIZE,
            }  # fmt: skip
            procs.append(
                rails.workers[w].popen(
                    [*PROGRAM, json.dumps(cfg)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )  # fmt: skip
            )
        joined = [_line(p) for p in procs]  # {"job_id", "k"} once the job is installed
        assert {j["k"] for j in joined} == {protocol.P4_K} and len({j["job_id"] for j in joined}) == 1
        hello = _step(procs)

        (job,) = json.loads(c.ctl("jobs", "--json", *c.client_args()).stdout)["jobs"]
        assert job["data_plane"] == "striped" and job["job_id"] == joined[0]["job_id"]
        assert [(s["node"], s["aggregator"]) for s in job["shards"]] == [
            (f"r{s}", f"{rail_ip(s)}:{protocol.UDP_PORT}") for s in range(RAILS)
        ]
        # Each rail aggregated its shard of every call, every worker's contribution once: exactly.
        chunks = [-(-(hi - lo) // protocol.P4_K) for lo, hi in shard_bounds(LENGTH, protocol.P4_K, RAILS)]
        on_switch = [job_counters(sw.grpc_address, 0, p4_program.JOB_COUNTER_NAMES) for sw in rails.switches]
        for s, counted in enumerate(on_switch):
            want = WORKERS * (chunks[s] * ITERATIONS + hello)
            assert counted["aggregated"] == want and counted["multicast"] > 0, (s, counted, want)
        # The controller's counters show each rail's share of the job under its pool name.
        counters = json.loads(c.ctl("counters", "--json", *c.client_args()).stdout)
        planes = {p["data_plane"]: p for p in counters["data_planes"]}
        for s in range(RAILS):
            (shard_job,) = planes[f"striped:r{s}"]["jobs"]
            assert shard_job["job_id"] == job["job_id"], shard_job
            assert shard_job["aggregated"] == on_switch[s]["aggregated"], (shard_job, on_switch[s])
        assert counters["unavailable"] == []

        for p in procs:  # EOF, to all at once: the float32 round, then each worker's report
            assert p.stdin is not None
            p.stdin.close()
            p.stdin = None  # closed already: communicate() leaves it alone
        reports = sorted(worker_reports(procs), key=lambda r: r["rank"])
        for r in reports:
            assert r["error"] is None and r["wrong"] == 0 and r["ok"] == ITERATIONS, r
            assert r["float_excess"] <= 0, r
            assert r["data_plane"] == "striped" and r["k"] == protocol.P4_K
            # Shard s through rail s: its aggregator is rail s's, pinned to the worker's rail-s socket.
            assert [s[:2] for s in r["shards"]] == [[f"r{s}", rail_ip(s)] for s in range(RAILS)], r
            assert [ip for ip, _ in r["local"]] in [rails.addresses(w) for w in range(WORKERS)], r
            assert [s[2] for s in r["shards"]] == [port for _, port in r["local"]]
        return reports
    finally:
        for p in procs:
            p.kill()
        c.stop()


def _line(p: subprocess.Popen[str]) -> dict[str, Any]:
    """The worker's next stdout line as JSON (its stderr if it ended instead)."""
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        p.wait(30)
        raise AssertionError(f"worker ended ({p.returncode}): {p.stderr.read() if p.stderr else ''}")
    out: dict[str, Any] = json.loads(line)
    return out
