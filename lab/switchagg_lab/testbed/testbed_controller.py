"""The job service of a testbed (``switchagg-ctl serve`` in the switch namespace; for racks, in the
spine namespace, with a ``switchagg-aggregator --control`` in the spine and in each leaf) and the
environment that points a worker's torch backend at it."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from switchagg import protocol
from switchagg_lab.testbed.netns import Endpoint, TestbedError
from switchagg_lab.testbed.rack import AGG_IP, Testbed

if TYPE_CHECKING:
    from switchagg_lab.testbed.racks import Racks

SERVICE_WAIT = 60.0


def service_address(workdir: Path) -> str:
    return f"unix:{workdir / 'jobs.sock'}"


def start_job_service(
    bed: Testbed,
    workdir: Path,
    sw_k: int = protocol.DEFAULT_SW_K,
    sw_slots: int = protocol.DEFAULT_SW_SLOTS,
) -> subprocess.Popen[bytes]:
    """Starts the service detached, on a Unix socket (reachable from every namespace): with the
    soft data plane it serves jobs on its software aggregator at AGG_IP, with bmv2 it programs the
    switch. Returns once the socket exists; the caller (or the namespace's removal) stops it."""
    argv = _serve_argv(workdir)
    if bed.data_plane == "soft":
        argv += ["--software", "--software-listen", f"{AGG_IP}:{protocol.UDP_PORT}"]
        argv += ["--sw-k", str(sw_k), "--sw-slots", str(sw_slots)]
    else:
        from switchagg_controller.topology import dump_topology

        topo = workdir / "topology.yaml"
        topo.write_text(dump_topology(bed.topology()))
        argv += ["--topology", str(topo)]
    return _spawn(bed.switch_ns, argv, workdir / "service.log", workdir / "jobs.sock", "the job service")


def _secret(path: Path) -> Path:
    path.write_text(secrets.token_hex(16))
    path.chmod(0o600)
    return path


def _serve_argv(workdir: Path) -> list[str]:
    workdir.mkdir(parents=True, exist_ok=True)
    return [
        sys.executable, "-m", "switchagg_controller.cli", "serve",
        "--listen", service_address(workdir), "--secret-file", str(_secret(workdir / "secret")),
        "--admin-secret-file", str(_secret(workdir / "admin.secret")), "--state", str(workdir / "ctl.db"),
    ]  # fmt: skip


def _spawn(ns: str, argv: list[str], log_path: Path, ready: Path, what: str) -> subprocess.Popen[bytes]:
    """``argv`` detached in namespace ``ns``, once ``ready`` (its Unix socket) exists."""
    ready.unlink(missing_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + SERVICE_WAIT
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = log_path.read_text(errors="replace")[-1500:]
            raise TestbedError(f"{what} did not come up (see {log_path}):\n{tail}")
        time.sleep(0.1)
    return proc


def start_two_level_service(
    racks: Racks,
    workdir: Path,
    sw_k: int = protocol.DEFAULT_SW_K,
    sw_slots: int = protocol.DEFAULT_SW_SLOTS,
) -> dict[str, int]:
    """A software aggregator with its control service in the spine and in every leaf namespace,
    and the job service (``serve --two-level``) in the spine namespace installing jobs on them
    through their control sockets (docs/CONTROLLER.md, Two levels in software). Returns the pids
    by role; the caller (or the namespaces' removal) stops them."""
    from switchagg_lab.testbed.racks import SPINE_IP

    workdir.mkdir(parents=True, exist_ok=True)
    node_secret = _secret(workdir / "nodes.secret")
    nodes = [
        ("spine", racks.spine_ns, SPINE_IP),
        *((f"rack{leaf.index}", leaf.ns, leaf.worker_ip) for leaf in racks.leaves),
    ]
    pids: dict[str, int] = {}
    lines = []
    for name, ns, ip in nodes:
        sock = workdir / f"{name}.sock"
        argv = [
            sys.executable, "-m", "switchagg.aggregator_cli", "--host", ip, "--port", str(protocol.UDP_PORT),
            "--control", f"unix:{sock}", "--control-secret-file", str(node_secret),
        ]  # fmt: skip
        pids[name] = _spawn(ns, argv, workdir / f"{name}.log", sock, f"the {name} aggregator").pid
        node = f"listen: {ip}:{protocol.UDP_PORT}, control: 'unix:{sock}', secret_file: {node_secret.name}"
        if name == "spine":
            lines += [f"spine: {{{node}}}", "leaves:"]
        else:
            rack = int(name[len("rack") :])
            lines.append(f"  - {{name: {name}, subnets: ['{rack_subnet(rack)}'], {node}}}")
    spec = workdir / "two-level.yaml"
    spec.write_text("\n".join(lines) + "\n")
    argv = _serve_argv(workdir) + ["--two-level", str(spec), "--sw-k", str(sw_k), "--sw-slots", str(sw_slots)]
    pids["service"] = _spawn(
        racks.spine_ns, argv, workdir / "service.log", workdir / "jobs.sock", "the job service"
    ).pid
    return pids


def rack_subnet(rack: int) -> str:
    from switchagg_lab.testbed.racks import rack_ip

    return rack_ip(rack, 0) + "/24"


def worker_env(
    workers: Sequence[Endpoint], rank: int, workdir: Path, master_port: int = 29500
) -> dict[str, str]:
    """What rank ``rank`` needs for init_process_group (env://) and the switchagg backend."""
    e = workers[rank]
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(workers)),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": workers[0].ip,
        "MASTER_PORT": str(master_port),
        "GLOO_SOCKET_IFNAME": e.ifname,
        "SWITCHAGG_JOB_SERVICE": service_address(workdir),
        "SWITCHAGG_SECRET_FILE": str(workdir / "secret"),
        "SWITCHAGG_WORKER_BIND": e.ip,
        "SWITCHAGG_TESTBED_IP": e.ip,
    }
    # The emulated nodes share this host's cores: as torchrun does for several local ranks, one
    # intra-op thread each unless the caller says, so that torch's spinning OpenMP threads of one
    # node do not take the cores the others' compute and packet paths need.
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // len(workers)))
    return env
