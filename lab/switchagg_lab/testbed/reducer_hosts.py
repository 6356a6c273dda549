"""The reducer hosts of a testbed (``switchagg-testbed up --reducers M``): a software aggregator with
its control service in each reducer namespace, and the job service in the switch namespace with
them as its reducer pool (``switchagg-ctl serve --reducers``) beside its own software aggregator
at the switch's address (the switch case). A worker that asks for shards (SWITCHAGG_SHARDS, or the
pool's size by default) is striped across the reducers; SWITCHAGG_SHARDS=0 runs on the switch."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from switchagg import protocol
from switchagg_lab.testbed.rack import Testbed
from switchagg_lab.testbed.testbed_controller import _secret, _serve_argv, _spawn, sw_layout


def aggregator_module() -> str:
    """The module that runs ``switchagg-aggregator`` (its command line moved out of the library's
    aggregator module in a later layout)."""
    cli = "switchagg.aggregator_cli"
    return cli if importlib.util.find_spec(cli) is not None else "switchagg.aggregator"


def start_reducers(bed: Testbed, workdir: Path) -> tuple[Path, dict[str, int]]:
    """A ``switchagg-aggregator --control`` on each reducer host; returns the reducer pool file for
    ``serve --reducers`` and their pids by name (r0, r1, ...)."""
    workdir.mkdir(parents=True, exist_ok=True)
    node_secret = _secret(workdir / "reducers.secret")
    pids: dict[str, int] = {}
    lines = ["reducers:"]
    for e in bed.reducer_hosts:
        name = f"r{e.index}"
        sock = workdir / f"{name}.sock"
        argv = [
            sys.executable, "-m", aggregator_module(), "--host", e.ip, "--port", str(protocol.UDP_PORT),
            "--control", f"unix:{sock}", "--control-secret-file", str(node_secret),
        ]  # fmt: skip
        pids[name] = _spawn(e.ns, argv, workdir / f"{name}.log", sock, f"reducer {name}").pid
        lines.append(
            f"  - {{name: {name}, listen: {e.ip}:{protocol.UDP_PORT}, control: 'unix:{sock}', "
            f"secret_file: {node_secret.name}}}"
        )
    pool = workdir / "reducers.yaml"
    pool.write_text("\n".join(lines) + "\n")
    return pool, pids


def start_reducer_service(
    bed: Testbed,
    workdir: Path,
    sw_k: int | None = None,
    sw_slots: int | None = None,
) -> dict[str, int]:
    """The reducers, then the job service (switch namespace) with them as its pool and its own
    software aggregator at the switch's address. Returns the pids by role."""
    sw_k, sw_slots = sw_layout(bed.mtu, sw_k, sw_slots)
    pool, pids = start_reducers(bed, workdir)
    argv = _serve_argv(workdir) + [
        "--reducers", str(pool), "--software", "--software-listen", f"{bed.agg_ip}:{protocol.UDP_PORT}",
        "--sw-k", str(sw_k), "--sw-slots", str(sw_slots),
    ]  # fmt: skip
    service = _spawn(bed.switch_ns, argv, workdir / "service.log", workdir / "jobs.sock", "the job service")
    pids["service"] = service.pid
    return pids
