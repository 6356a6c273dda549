"""`switchagg-ctl top` against a real job on the controller's software aggregator: the rates of
two reads around a known number of allreduces are exact; the real command, run while workers
allreduce in a loop, shows the job moving, in 80 columns and as JSON."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client", reason="the metrics need prometheus-client (pip install .[metrics])")
pytest.importorskip("finsy", reason="the controller needs its extra (pip install .[controller])")

from switchagg import protocol  # noqa: E402
from switchagg_controller import allocation, top  # noqa: E402
from switchagg_lab.testing.controller import SECRET, Controller, ctl_json, metrics_address  # noqa: E402
from switchagg_lab.testing.job_worker import PROGRAM, stop_together  # noqa: E402
from switchagg_lab.testing.prom import scrape_until  # noqa: E402
from switchagg_lab.testing.stepped import LENGTH, read_line, step, stepped_worker  # noqa: E402

WAIT_S = 60.0


def _snapshot(ctl: Controller) -> top.Snapshot:
    return top.Snapshot(time.monotonic(), ctl_json(ctl, "jobs"), ctl_json(ctl, "counters"))


def test_rates_of_two_reads_around_known_allreduces_are_exact(software_controller: Controller) -> None:
    n, name, rounds = 2, "top-exact", 3
    procs = [stepped_worker(software_controller, name, n) for _ in range(n)]
    try:
        k = [read_line(p) for p in procs][0]["k"]
        chunks = -(-LENGTH // k)
        step(procs, n)  # the sessions open (their hello: docs/PROTOCOL.md, Sessions) before the reads
        before = _snapshot(software_controller)
        for _ in range(rounds):
            step(procs, n)
        after = _snapshot(software_controller)
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=WAIT_S)
    v = top.view(before, after)
    (job,) = v["jobs"]
    dt = v["interval_s"]
    assert job["name"] == name and job["state"] == "active" and job["data_plane"] == "software"
    assert job["contributions_per_s"] * dt == pytest.approx(rounds * n * chunks)
    assert job["results_per_s"] * dt == pytest.approx(rounds * chunks)
    # No resend count is asserted: on a loaded machine a loss-free run still resends when a timer fires
    # early (5 ms floor, tail probes), answered from the stored result or ignored, never counted as a
    # contribution (the exact count above).
    packet_bits = (protocol.HEADER_LEN + 4 * k) * 8
    assert job["gbit_per_s"] * dt == pytest.approx(rounds * n * chunks * packet_bits / 1e9)
    (plane,) = v["data_planes"]
    assert plane["slots_allocated"] == protocol.DEFAULT_SW_SLOTS
    assert plane["slots_pool"] == allocation.SW_POOL_SLOTS
    assert plane["drops_per_s"] == 0 and plane["jobs"] == 1
    text = top.render(v, "title")
    assert all(len(line) <= top.WIDTH for line in text.splitlines())
    assert name in text and f"{protocol.DEFAULT_SW_SLOTS}/{allocation.SW_POOL_SLOTS}" in text


def test_top_shows_a_running_job(software_controller: Controller, tmp_path: Path) -> None:
    n, name, stop = 2, "top-live", tmp_path / "stop"
    progress = [tmp_path / f"progress{r}" for r in range(n)]
    configs = [
        {
            "service": software_controller.address,
            "secret": SECRET,
            "name": name,
            "n": n,
            "rank": r,
            "length": 5000,
            "iterations": 100_000,
            "progress": str(progress[r]),
            "stop": str(stop),
        }  # fmt: skip
        for r in range(n)
    ]
    procs = [subprocess.Popen([*PROGRAM, json.dumps(c)], stderr=subprocess.PIPE, text=True) for c in configs]
    try:
        scrape_until(
            metrics_address(software_controller),
            lambda s: any(
                metric == "switchagg_job_aggregated_total" and ("switchagg_job", name) in labels and v > 0
                for (metric, labels), v in s.items()
            ),
            "the job runs",
        )
        out = software_controller.ctl(
            "top", *software_controller.client_args(), "--json", "--count", "2", "--interval", "0.5"
        ).stdout.splitlines()
        assert len(out) == 2
        frames = [json.loads(line) for line in out]
        rows = [next(j for j in f["jobs"] if j["name"] == name) for f in frames]
        assert all(r["contributions_per_s"] >= 0 and r["data_plane"] == "software" for r in rows)
        assert sum(r["contributions_per_s"] for r in rows) > 0  # the workers never stop meanwhile

        text = software_controller.ctl(
            "top", *software_controller.client_args(), "--once", "--interval", "0.5"
        )
        lines = text.stdout.splitlines()
        assert lines[0].startswith("switchagg-ctl top") and "contrib/s" in lines[1]
        assert all(len(line) <= top.WIDTH for line in lines), text.stdout
        row = next(line for line in lines if name in line)
        assert row.split()[2] == "software" and row.split()[3] == str(n)
        assert any(line.startswith("software") and "16/32768" in line for line in lines)
    finally:
        stop_together(stop, progress)
        for p in procs:
            try:
                assert p.wait(WAIT_S) == 0, p.communicate()[1]
            finally:
                if p.poll() is None:
                    p.kill()


def test_a_two_level_job_is_one_row_with_its_workers_rates(tmp_path: Path) -> None:
    """2 leaves x 2 workers behind a spine (embedded nodes): the job's contributions are what
    its leaves aggregated, its results what the spine multicast, and its slot range is counted
    on every node."""
    from switchagg_lab.testing.topologies import LOOPBACK_TWO_LEVEL as SPEC
    from switchagg_lab.testing.topologies import LOOPBACK_WORKER_IPS as WORKER_IPS

    spec = tmp_path / "two-level.yaml"
    spec.write_text(SPEC)
    ctl = Controller(tmp_path, ["--two-level", str(spec), "--software", "--software-listen", "127.0.0.1:0"])
    n, name, rounds = len(WORKER_IPS), "top-racks", 3
    procs: list[subprocess.Popen[str]] = []
    try:
        ctl.start()
        procs = [stepped_worker(ctl, name, n, ip) for ip in WORKER_IPS]
        k = [read_line(p) for p in procs][0]["k"]
        chunks = -(-LENGTH // k)
        step(procs, n)  # the sessions open (their hello: docs/PROTOCOL.md, Sessions) before the reads
        before = _snapshot(ctl)
        for _ in range(rounds):
            step(procs, n)
        after = _snapshot(ctl)
        (listed,) = after.jobs["jobs"]
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=WAIT_S)
        ctl.stop()
    v = top.view(before, after)
    (job,) = v["jobs"]
    dt = v["interval_s"]
    assert job["name"] == name and job["data_plane"] == allocation.TWO_LEVEL
    assert job["contributions_per_s"] * dt == pytest.approx(rounds * n * chunks)
    assert job["results_per_s"] * dt == pytest.approx(rounds * chunks)
    # No resend count is asserted: on a loaded machine a loss-free run still resends when a timer fires
    # early (5 ms floor, tail probes), answered from the stored result or ignored, never counted as a
    # contribution (the exact count above).
    planes = {p["data_plane"]: p for p in v["data_planes"]}
    for node in ("spine", "rack0", "rack1"):
        plane = planes[f"{allocation.TWO_LEVEL}:{node}"]
        assert plane["jobs"] == 1 and plane["slots_allocated"] == listed["slot_count"] > 0
    assert planes[allocation.SOFTWARE]["slots_allocated"] == 0
    text = top.render(v, "title")
    assert all(len(line) <= top.WIDTH for line in text.splitlines())
    assert name in text and "two-level:rack1" in text
