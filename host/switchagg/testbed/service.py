"""The job service of a testbed (``switchagg-ctl serve`` in the switch namespace) and the
environment that points a worker's torch backend at it."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from pathlib import Path

from switchagg import protocol
from switchagg.testbed.netns import TestbedError
from switchagg.testbed.topology import AGG_IP, Testbed

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
    workdir.mkdir(parents=True, exist_ok=True)
    secret = workdir / "secret"
    secret.write_text(secrets.token_hex(16))
    secret.chmod(0o600)
    sock = workdir / "jobs.sock"
    sock.unlink(missing_ok=True)
    argv = [
        sys.executable, "-m", "switchagg_controller.cli", "serve",
        "--listen", service_address(workdir), "--secret-file", str(secret),
        "--state", str(workdir / "ctl.db"),
    ]  # fmt: skip
    if bed.data_plane == "soft":
        argv += ["--software", "--software-listen", f"{AGG_IP}:{protocol.UDP_PORT}"]
        argv += ["--sw-k", str(sw_k), "--sw-slots", str(sw_slots)]
    else:
        from switchagg_controller.topology import dump_topology

        topo = workdir / "topology.yaml"
        topo.write_text(dump_topology(bed.topology()))
        argv += ["--topology", str(topo)]
    log_path = workdir / "service.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", bed.switch_ns, *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + SERVICE_WAIT
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = log_path.read_text(errors="replace")[-1500:]
            raise TestbedError(f"the job service did not come up (see {log_path}):\n{tail}")
        time.sleep(0.1)
    return proc


def worker_env(bed: Testbed, rank: int, workdir: Path, master_port: int = 29500) -> dict[str, str]:
    """What rank ``rank`` needs for init_process_group (env://) and the switchagg backend."""
    e = bed.endpoints[rank]
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(bed.n),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": bed.endpoints[0].ip,
        "MASTER_PORT": str(master_port),
        "GLOO_SOCKET_IFNAME": e.ifname,
        "SWITCHAGG_JOB_SERVICE": service_address(workdir),
        "SWITCHAGG_SECRET_FILE": str(workdir / "secret"),
        "SWITCHAGG_WORKER_BIND": e.ip,
        "SWITCHAGG_TESTBED_IP": e.ip,
    }
