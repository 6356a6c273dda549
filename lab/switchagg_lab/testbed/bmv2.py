"""simple_switch_grpc in a network namespace: start, kill, restart, and register reads over Thrift.

Its P4Runtime server listens on a Unix socket (reachable from every namespace through the file
system); its Thrift server listens on every address, which is why it never runs in the host's
namespace.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from switchagg_lab.testbed.netns import TestbedError
from switchagg_lab.testbed.tools import find_tool, tool_env

THRIFT_PORT = 9090


class Bmv2Switch:
    """One simple_switch_grpc process with ``ports`` (switch port, interface) in namespace ``ns``;
    start() and kill() may be repeated (restart tests)."""

    def __init__(
        self,
        ns: str,
        ports: Sequence[tuple[int, str]],
        workdir: Path,
        device_id: int = 0,
        detach: bool = False,
    ) -> None:
        self.ns = ns
        self.detach = detach  # its own session: it outlives the process that started it (switchagg-testbed)
        self.ports = list(ports)
        self.workdir = workdir
        self.device_id = device_id
        self.grpc_socket = workdir / "p4runtime.sock"
        self.starts = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def grpc_address(self) -> str:
        return f"unix:{self.grpc_socket}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, wait: float = 60) -> Bmv2Switch:
        if self.alive():
            raise TestbedError("the switch is already running")
        binary = find_tool("simple_switch_grpc")
        if binary is None:
            raise TestbedError("simple_switch_grpc not found (PATH, $SIMPLE_SWITCH_GRPC or /opt/p4/bin)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.grpc_socket.unlink(missing_ok=True)  # a killed switch leaves its socket file behind
        self.starts += 1
        argv = ["ip", "netns", "exec", self.ns, binary, "--no-p4", "--device-id", str(self.device_id)]
        for port, ifname in self.ports:
            argv += ["-i", f"{port}@{ifname}"]
        argv += ["--thrift-port", str(THRIFT_PORT)]
        argv += ["--notifications-addr", f"ipc://{self.workdir}/notifications.ipc"]
        if os.environ.get("SWITCHAGG_BMV2_LOG"):
            argv += ["--log-file", str(self.workdir / "bmv2"), "--log-level", "debug", "--log-flush"]
        argv += ["--", "--grpc-server-addr", self.grpc_address]
        with open(self.log_path, "ab") as out:
            self._proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=tool_env(), start_new_session=self.detach
            )
        deadline = time.monotonic() + wait
        while not self.grpc_socket.exists():
            if self._proc.poll() is not None:
                raise TestbedError(f"simple_switch_grpc exited ({self._proc.returncode}): {self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TestbedError(f"simple_switch_grpc did not open {self.grpc_socket}: {self.log()}")
            time.sleep(0.05)
        return self

    @property
    def log_path(self) -> Path:
        return self.workdir / "switch.out"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """Kills the switch at once (SIGKILL): it comes back empty, as after a crash."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(timeout=30)
            self._proc = None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self.grpc_socket.unlink(missing_ok=True)

    def restart(self) -> Bmv2Switch:
        self.kill()
        return self.start()

    def cli(self, commands: str) -> str:
        """Runs simple_switch_CLI commands (Thrift, inside the switch's namespace)."""
        binary = find_tool("simple_switch_CLI")
        if binary is None:
            raise TestbedError("simple_switch_CLI not found")
        p = subprocess.run(
            ["ip", "netns", "exec", self.ns, binary, "--thrift-port", str(THRIFT_PORT)],
            input=commands,
            capture_output=True,
            text=True,
            timeout=120,
            env=tool_env(),
        )
        if p.returncode != 0:
            raise TestbedError(f"simple_switch_CLI failed: {p.stderr.strip()}")
        return p.stdout

    def registers(self, name: str, indices: Sequence[int]) -> list[int]:
        """Several cells of one register array in one CLI run."""
        out = self.cli("".join(f"register_read {name} {i}\n" for i in indices))
        found = {int(i): int(v) for i, v in re.findall(rf"{re.escape(name)}\[(\d+)\]\s*=\s*(-?\d+)", out)}
        missing = [i for i in indices if i not in found]
        if missing:
            raise TestbedError(f"cannot read {name}{missing}: {out.strip()[-500:]}")
        return [found[i] for i in indices]
