"""Shared helpers of the controller tests: a real switchagg-ctl serve process and worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from switchagg_lab.testing.job_worker import PROGRAM
from switchagg_lab.testing.kit import json_reports

SECRET = "s3cret-for-tests"  # the join secret
ADMIN_SECRET = "admin-s3cret-for-tests"  # ListJobs, Counters, Teardown: client_args()


class Controller:
    """``switchagg-ctl serve`` in its own process; ``address`` is its job service."""

    def __init__(
        self, tmp: Path, extra: list[str], secret: str = SECRET, admin_secret: str | None = ADMIN_SECRET
    ) -> None:
        """``admin_secret`` None: serve is given none, and keeps the one it makes (the banner says where)."""
        self.secret_file = tmp / "secret"
        self.secret_file.write_text(secret + "\n")
        self.admin_secret_file = tmp / "admin-secret"
        self.admin_flags: list[str] = []
        if admin_secret is not None:
            self.admin_secret_file.write_text(admin_secret + "\n")
            self.admin_flags = ["--admin-secret-file", str(self.admin_secret_file)]
        self.state = tmp / "ctl.db"
        # Its output goes to files, not pipes: nobody reads a pipe while a test runs, and a controller
        # that logs 64 KiB (a switch away for a while) would block on its next line, its work undone.
        self.out_path, self.err_path = tmp / "ctl.out", tmp / "ctl.err"
        self.extra = extra
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.banner = ""

    def start(self, port: int = 0, listen: str | None = None) -> Controller:
        cmd = [
            sys.executable, "-m", "switchagg_controller.cli", "serve",
            "--listen", listen or f"127.0.0.1:{port}",
            "--secret-file", str(self.secret_file), *self.admin_flags,
            "--state", str(self.state), *self.extra,
        ]  # fmt: skip
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        self.banner = self._banner(60.0)  # the banner comes once the service listens
        if "job service on" not in self.banner:
            self.proc.kill()
            self.proc.wait(timeout=30)
            why = self.err_path.read_text()
            raise RuntimeError(f"switchagg-ctl serve did not start: {self.banner!r} {why}")
        self.address = self.banner.split("job service on ")[1].split(";")[0]
        if not self.admin_flags:
            self.admin_secret_file = Path(self.banner.split("admin secret in ")[1].split(";")[0].strip())
        return self

    def _banner(self, timeout: float) -> str:
        """Its first line of output, once written (or what there is when it exits or time is up)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.out_path.read_text()
            if "\n" in text or self.proc.poll() is not None:
                return text.split("\n", 1)[0] + "\n" if text else ""
            time.sleep(0.02)
        return self.out_path.read_text()

    def stop(self) -> str:
        """Stops the process (SIGTERM, then SIGKILL) and returns its stderr."""
        if self.proc is None:
            return ""
        proc, self.proc = self.proc, None
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        return self.err_path.read_text()

    def kill(self) -> None:
        """SIGKILL: the controller (and its embedded aggregator) dies without a word."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.kill()
        proc.wait(timeout=30)

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "switchagg_controller.cli", *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if check and r.returncode != 0:
            raise AssertionError(f"{cmd} failed: {r.stdout} {r.stderr}")
        return r

    def client_args(self) -> list[str]:
        """The flags of an operator's command (jobs, counters, top, teardown): the admin secret."""
        return ["--service", self.address, "--admin-secret-file", str(self.admin_secret_file)]


def start_workers(
    service: str,
    secret: str,
    name: str,
    n: int,
    length: int,
    seed: int = 0,
    ranks: list[int | None] | None = None,
    bind_ips: list[str] | None = None,
) -> list[subprocess.Popen[str]]:
    """Worker processes (job_worker) that join ``name``, allreduce one int32 tensor known from
    (rank, seed) and one float32 tensor, leave, and report (``collect``); ``bind_ips``: each
    worker's own address (default 127.0.0.1 for all)."""
    ranks = ranks or [None] * n
    ips = bind_ips or ["127.0.0.1"] * len(ranks)
    configs = [
        {
            "service": service,
            "secret": secret,
            "name": name,
            "n": n,
            "rank": r,
            "ip": ip,
            "length": length,
            "seed": seed,
            "float_round": True,
            "leave": True,
        }  # fmt: skip
        for r, ip in zip(ranks, ips, strict=True)
    ]
    return [
        subprocess.Popen([*PROGRAM, json.dumps(c)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in configs
    ]


def collect(procs: list[subprocess.Popen[str]], timeout: float = 120.0) -> list[dict[str, Any]]:
    """Each WORKER's report (bounded; a failed or hung worker fails the test)."""
    return json_reports(procs, timeout)


def expected_int_sum(n: int, length: int, seed: int) -> tuple[int, list[int]]:
    """The int32 allreduce of start_workers' tensors: sum over ranks of arange*(seed+1) + 7r - 3."""
    head = [sum(i * (seed + 1) + r * 7 - 3 for r in range(n)) for i in range(4)]
    total = sum(sum(i * (seed + 1) + r * 7 - 3 for i in range(length)) for r in range(n))
    return total, head


async def aio_join(
    stub: Any, secret: str, name: str, n: int, ip: str, udp_port: int, timeout: float = 60.0
) -> Any:
    """One Join through a grpc.aio stub (jobs_pb2_grpc.JobServiceStub on a grpc.aio channel):
    many of them wait at once on one event loop, in the test as in the service."""
    from switchagg._proto import jobs_pb2

    request = jobs_pb2.JoinRequest(
        secret=secret, job_name=name, world_size=n, ip=ip, udp_port=udp_port, rank=-1, timeout_s=timeout
    )
    return await stub.Join(request, timeout=timeout + 30)


def metrics_address(ctl: Controller) -> tuple[str, int]:
    """Where `serve --metrics-port` listens, from its banner."""
    url = ctl.banner.split("metrics on http://")[1].split("/")[0]
    host, _, port = url.rpartition(":")
    return host, int(port)


def ctl_json(ctl: Controller, command: str, *args: str) -> dict[str, Any]:
    out = ctl.ctl(command, *ctl.client_args(), "--json", *args).stdout
    result: dict[str, Any] = json.loads(out)
    return result
