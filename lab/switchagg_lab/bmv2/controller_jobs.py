"""Controller jobs on bmv2: worker processes (job_worker) started in the testbed's namespaces
against the controller's job service, their progress files, a common stop, their reports, and
what the switch's tables and counters say about a job."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from switchagg_lab.testing.controller import SECRET
from switchagg_lab.testing.job_worker import PROGRAM, progress_of
from switchagg_lab.testing.job_worker import stop_together as stop_workers_together
from switchagg_lab.testing.kit import json_reports


def start_workers(
    own_bed: Any,
    service: str,
    tmp: Path,
    name: str,
    iterations: int,
    timeout: float,
    stop: Path | None = None,
) -> list[Any]:
    procs = []
    for e in own_bed.endpoints:
        cfg = {
            "service": service, "secret": SECRET, "name": name, "n": len(own_bed.endpoints), "ip": e.ip,
            "length": 1000, "iterations": iterations, "timeout": timeout,
            "progress": str(tmp / f"{name}-{e.index}"), "stop": str(stop) if stop else None, "catch": True,
        }  # fmt: skip
        procs.append(e.popen([*PROGRAM, json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def progress(tmp: Path, name: str, endpoints: Any) -> list[int]:
    """The allreduces each worker finished so far (0 for a file not there or read mid-write)."""
    return progress_of([tmp / f"{name}-{e.index}" for e in endpoints])


def stop_together(stop: Path, tmp: Path, name: str, endpoints: Any) -> None:
    """Ends the workers' run at one iteration none of them began yet (job_worker.stop_together)."""
    stop_workers_together(stop, [tmp / f"{name}-{e.index}" for e in endpoints])


def worker_reports(procs: list[Any], timeout: float = 300) -> list[dict[str, Any]]:
    """Each job_worker's final report (bounded; a failed or hung worker fails the test)."""
    return json_reports(procs, timeout)


def job_counters(address: str, index: int, names: dict[str, str]) -> dict[str, int]:
    from switchagg_controller import p4_program
    from switchagg_controller.switch_session import SwitchSession

    with SwitchSession(address, 0, p4_program.P4INFO, primary=False, timeout=10) as s:
        return {k: min(s.read_counter(c, index)[index]) for k, c in names.items()}


def min_progress(tmp: Path, name: str, endpoints: Any) -> int:
    """The fewest allreduces any worker finished so far."""
    return min(progress(tmp, name, endpoints))


def job_generation(address: str, job_id: int) -> int | None:
    """The generation of job ``job_id`` in the switch's job table (either role's action); None
    while the switch has no such entry (or no pipeline yet)."""
    from switchagg_controller.p4rt import P4RuntimeError

    try:
        return read_job_generation(address, job_id)
    except (P4RuntimeError, TimeoutError):
        return None


def read_job_generation(address: str, job_id: int) -> int | None:
    from switchagg_controller import p4_program
    from switchagg_controller.switch_session import SwitchSession

    with SwitchSession(address, 0, p4_program.P4INFO, primary=False, timeout=10) as s:
        table = s.p4info.tables[p4_program.JOB_TABLE]
        gen_ids = {
            s.p4info.actions[a].id: next(p.id for p in s.p4info.actions[a].params if p.name == "generation")
            for a in ("MyIngress.set_job", "MyIngress.set_leaf_job")
        }
        for e in s.read_table_entries():
            if e.table_id == table.id and int.from_bytes(e.match[0].exact.value, "big") == job_id:
                gen_id = gen_ids[e.action.action.action_id]
                return next(
                    int.from_bytes(p.value, "big") for p in e.action.action.params if p.param_id == gen_id
                )
    return None


def topology_file(own_bed: Any, path: Path) -> Path:
    from switchagg_controller.topology import dump_topology

    path.write_text(dump_topology(own_bed.topology()))
    return path
