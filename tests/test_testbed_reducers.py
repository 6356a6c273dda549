"""``switchagg-testbed up --reducers 2`` (docs/TESTBED.md, Reducer hosts): two software aggregators in
namespaces of their own behind capped links; a job of the workers is striped across both (the pool's
size by default) and sums exactly, each reducer's link carries its shard, and SWITCHAGG_SHARDS=0
runs a job on the switch's own aggregator instead. Needs root and iproute2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from switchagg_lab.testbed import netns, tools
from switchagg_lab.testing.kit import run_testbed_cli as cli

REASON = tools.missing_for(["ip", "tc"], "the testbed tests")
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

NAME = f"r{os.getpid() % 10**7}"
LENGTH = 300_000  # int32: 1.2 MB, several chunks per shard

SCRIPT = (
    "import json, os; from switchagg import Session; import numpy as np;"
    "s = Session.from_job_service(os.environ['SWITCHAGG_JOB_SERVICE'], "
    "open(os.environ['SWITCHAGG_SECRET_FILE']).read().strip(), os.environ['JOB'], "
    "int(os.environ['WORLD_SIZE']), "
    "rank=int(os.environ['RANK']), bind=(os.environ['SWITCHAGG_WORKER_BIND'], 0));"
    f"x = np.arange({LENGTH}, dtype=np.int32) * (int(os.environ['RANK']) + 1); s.allreduce(x);"
    f"ok = bool((x == np.arange({LENGTH}, dtype=np.int32) * 3).all());"
    "print('REPORT', json.dumps({'ok': ok, 'plane': s.data_plane, "
    "'shards': [sh.aggregator_ip for sh in s.assignment.shards]})); s.close()"
)


@pytest.fixture
def cli_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    env = {**os.environ, "SWITCHAGG_TESTBED_DIR": str(tmp_path / "state")}
    yield env
    cli("down", "--name", NAME, env=env)


def _reports(run: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    assert run.returncode == 0, run.stdout + run.stderr
    return [json.loads(line.split("REPORT ", 1)[1]) for line in run.stdout.splitlines() if "REPORT " in line]


def test_the_testbed_runs_a_job_striped_across_two_reducer_hosts(cli_env: dict[str, str]) -> None:
    env = cli_env
    up = cli("up", "--name", NAME, "-n", "2", "--reducers", "2", "--rate", "200mbit", env=env)
    assert up.returncode == 0, up.stderr
    assert "2 reducer hosts (10.201.0.101, 10.201.0.102)" in up.stdout, up.stdout
    prefix = f"sat{NAME}-"
    for i in (0, 1):  # each reducer's link is capped as the workers' are
        qdisc = netns.sh("tc", "qdisc", "show", "dev", "eth0", ns=f"{prefix}r{i}")
        assert "tbf" in qdisc and "200Mbit" in qdisc, qdisc

    run = ["run", "--name", NAME, "--timeout", "120", "--", "env"]
    striped = cli(*run, "JOB=wide", sys.executable, "-c", SCRIPT, env=env)
    reports = _reports(striped)
    assert len(reports) == 2 and all(r["ok"] for r in reports), reports
    assert all(r["plane"] == "striped" and r["shards"] == ["10.201.0.101", "10.201.0.102"] for r in reports)
    status = json.loads(cli("status", "--name", NAME, "--json", env=env).stdout)
    assert status["up"] and set(status["processes"]) == {"service", "r0", "r1"}, status

    switch = cli(*run, "JOB=flat", "SWITCHAGG_SHARDS=0", sys.executable, "-c", SCRIPT, env=env)
    reports = _reports(switch)
    assert len(reports) == 2 and all(
        r["ok"] and r["plane"] == "software" and r["shards"] == [] for r in reports
    )

    assert cli("down", "--name", NAME, env=env).returncode == 0
    assert [n for n in netns.namespaces() if n.startswith(prefix)] == []
