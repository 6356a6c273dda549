"""``switchagg-aggregator --control`` processes for tests: started, read back, restarted, stopped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

LISTENING = re.compile(r"listening on (\S+):(\d+);")
CONTROL = re.compile(r"control on (\S+); boot id ([0-9a-f]+)")


class ControlledAggregator:
    """One aggregator process serving UDP on ``host:port`` (0: a free one, then kept across
    restarts) with its control service on the Unix socket ``<tmp>/<name>.sock``; in network
    namespace ``netns`` if given (the socket is a file: a controller outside reaches it)."""

    __test__ = False

    def __init__(
        self,
        tmp: Path,
        name: str,
        secret: str,
        host: str = "127.0.0.1",
        port: int = 0,
        netns: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.secret_file = tmp / f"{name}.secret"
        self.secret_file.write_text(secret + "\n")
        self.target = f"unix:{tmp / name}.sock"
        self.host, self.port = host, port
        self.netns = netns
        self.env = env  # added to this process's environment (e.g. an LD_PRELOAD fault injector)
        self.proc: subprocess.Popen[str] | None = None
        self.boot_id = ""

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def start(self) -> ControlledAggregator:
        # ip netns exec execs the command: the process is the aggregator itself (kill() is a crash)
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "switchagg.aggregator_cli", "--host", self.host,
             "--port", str(self.port), "--control", self.target,
             "--control-secret-file", str(self.secret_file)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **self.env} if self.env else None,
        )  # fmt: skip
        assert proc.stdout is not None
        watchdog = threading.Timer(30.0, proc.kill)  # bounds the wait: the pipe ends once killed
        watchdog.start()
        try:
            for line in proc.stdout:
                if m := LISTENING.search(line):
                    self.port = int(m.group(2))
                elif m := CONTROL.search(line):
                    self.proc, self.boot_id = proc, m.group(2)
                    return self
        finally:
            watchdog.cancel()
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise RuntimeError(f"switchagg-aggregator --control did not come up: {err[-1500:]}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)

    def kill(self) -> None:
        """As a crash: no clean shutdown."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.communicate(timeout=10)

    def __enter__(self) -> ControlledAggregator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
