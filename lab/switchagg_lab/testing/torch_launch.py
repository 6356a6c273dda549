"""Launching torch.distributed worker processes (switchagg_lab.testing.torch_worker) and collecting
what they report, for the torch backend's tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from switchagg_lab.testing.kit import free_port

WORKER = [sys.executable, "-m", "switchagg_lab.testing.torch_worker"]
HANG_GUARD = 180  # seconds; only there so that a hang fails instead of blocking CI


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    log: Path  # stderr goes to a file: a pipe nobody reads while polling could fill and block

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def launch(scenario: str, n: int, out: Path, **env: str) -> list[Worker]:
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n))
    base.pop("SWITCHAGG_JOB_SERVICE", None)  # these tests use the embedded aggregator unless told
    base.update(OMP_NUM_THREADS="1", **env)
    workers = []
    for r in range(n):
        log = out / f"stderr{r}.txt"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [*WORKER, scenario, str(out)],
                env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        workers.append(Worker(proc, log))
    return workers


def finish(workers: list[Worker], on_hang: Callable[[], str] | None = None) -> list[tuple[int, str]]:
    """Waits for all; once one fails the others get a grace period, then are killed: a rank
    that died early otherwise leaves its peers waiting on the store or gloo for minutes.
    ``on_hang()`` may return more evidence (native stacks) for the failure message."""
    deadline = time.monotonic() + HANG_GUARD
    failed_at: float | None = None
    while any(w.proc.poll() is None for w in workers):
        now = time.monotonic()
        if failed_at is None and any(w.proc.returncode not in (None, 0) for w in workers):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + 15):
            for w in workers:
                if w.proc.poll() is None:
                    w.proc.send_signal(signal.SIGUSR1)  # faulthandler: dump the stacks first
            time.sleep(1)
            extra = on_hang() if failed_at is None and on_hang is not None else ""
            for w in workers:
                w.proc.kill()
                w.proc.wait()
            if failed_at is None:
                logs = "\n----\n".join(w.stderr() for w in workers)
                pytest.fail(f"workers hung; their stderr:\n{logs}\n{extra}")
            break
        time.sleep(0.1)
    return [(w.proc.returncode, w.stderr()) for w in workers]


def read(out: Path, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((out / f"rank{rank}.json").read_text())
    return result
