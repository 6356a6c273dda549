"""switchagg-testbed with the bmv2 data plane: `up` starts simple_switch_grpc and the controller's
job service in the switch namespace, `run` workers join through it and get the P4 data plane,
their sums are exact, and `down` leaves nothing behind. Skipped, with the reason, without bmv2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from switchagg_lab.bmv2.skip import skip_reason
from switchagg_lab.testbed import netns
from switchagg_lab.testing.kit import run_testbed_cli as cli

NAME = f"b{os.getpid() % 10**7}"
WORKER = (
    "import os, numpy as np; from switchagg import Session;"
    "s = Session.from_job_service(os.environ['SWITCHAGG_JOB_SERVICE'],"
    " open(os.environ['SWITCHAGG_SECRET_FILE']).read().strip(), 'dp', int(os.environ['WORLD_SIZE']),"
    " rank=int(os.environ['RANK']), bind=(os.environ['SWITCHAGG_WORKER_BIND'], 0));"
    "x = np.arange(3000, dtype=np.int32) * (int(os.environ['RANK']) + 1); s.allreduce(x);"
    "print(s.data_plane, bool((x == np.arange(3000, dtype=np.int32) * 3).all())); s.close()"
)


def _cli(env: dict[str, str], command: str, *args: str) -> subprocess.CompletedProcess[str]:
    return cli(command, "--name", NAME, *args, env=env, timeout=300)


def test_the_testbed_command_with_the_bmv2_data_plane(tmp_path: Path) -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "SWITCHAGG_TESTBED_DIR": str(tmp_path)}
    try:
        up = _cli(env, "up", "-n", "2", "--data-plane", "bmv2")
        assert up.returncode == 0, up.stderr
        run = _cli(env, "run", "--timeout", "200", "--", sys.executable, "-c", WORKER)
        assert run.returncode == 0, run.stdout + run.stderr
        assert sorted(line for line in run.stdout.splitlines() if "p4" in line) == [
            "[h0] p4 True",
            "[h1] p4 True",
        ]
    finally:
        down = _cli(env, "down")
    assert down.returncode == 0
    assert [n for n in netns.namespaces() if n.startswith(f"sat{NAME}-")] == []
