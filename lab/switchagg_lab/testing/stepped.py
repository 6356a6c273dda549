"""Worker processes driven round by round: each joins through the job service, then does one
allreduce per line it reads (printing the sum), and leaves at EOF; so a test knows at each step
what every counter must say."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from switchagg import protocol
from switchagg_lab.testing.controller import SECRET, Controller

WAIT_S = 60.0  # generous: only guards against a hang
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


def stepped_worker(ctl: Controller, name: str, n: int, ip: str = "127.0.0.1") -> subprocess.Popen[str]:
    cmd = [sys.executable, "-c", STEPPED_WORKER, ctl.address, SECRET, name, str(n), str(LENGTH), ip]
    return subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def read_line(p: subprocess.Popen[str]) -> dict[str, int]:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise AssertionError(f"worker ended: {p.communicate(timeout=WAIT_S)[1]}")
    result: dict[str, int] = json.loads(line)
    return result


def step(procs: list[subprocess.Popen[str]], n: int) -> None:
    """One allreduce on every worker; each must see the sum of ranks + 1."""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    assert [read_line(p)["sum"] for p in procs] == [n * (n + 1) // 2] * n


def leave(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
        assert p.wait(WAIT_S) == 0, p.communicate()[1]
