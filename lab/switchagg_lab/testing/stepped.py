"""Worker processes driven round by round (job_worker with stdin): each joins through the job
service, then does one allreduce per line it reads (printing the sum), and leaves at EOF; so a
test knows at each step what every counter must say."""

from __future__ import annotations

import json
import subprocess

from switchagg import protocol
from switchagg_lab.testing.controller import SECRET, Controller
from switchagg_lab.testing.job_worker import PROGRAM, expected

WAIT_S = 60.0  # generous: only guards against a hang
LENGTH = 3 * protocol.DEFAULT_SW_K + 5  # 4 chunks per int32 allreduce


def stepped_worker(ctl: Controller, name: str, n: int, ip: str = "127.0.0.1") -> subprocess.Popen[str]:
    """A job_worker stepped by stdin: it prints {"job_id", "k"} once joined, then one line per step."""
    cfg = {
        "service": ctl.address,
        "secret": SECRET,
        "name": name,
        "n": n,
        "ip": ip,
        "length": LENGTH,
        "stdin": True,
    }
    return subprocess.Popen(
        [*PROGRAM, json.dumps(cfg)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_line(p: subprocess.Popen[str]) -> dict[str, int]:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise AssertionError(f"worker ended: {p.communicate(timeout=WAIT_S)[1]}")
    result: dict[str, int] = json.loads(line)
    return result


def step(procs: list[subprocess.Popen[str]], n: int) -> int:
    """One allreduce on every worker; each must see the exact sum (its first element). Returns the
    rounds of the sessions' hello so far (the first step's call runs it: docs/PROTOCOL.md, Sessions),
    the same on every worker of one session: each adds one contribution per rank to the job."""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    lines = [read_line(p) for p in procs]
    assert [line["sum"] for line in lines] == [int(expected(LENGTH, 1, n)[0])] * n
    return max(line["hello_rounds"] for line in lines)


def leave(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
        assert p.wait(WAIT_S) == 0, p.communicate()[1]
