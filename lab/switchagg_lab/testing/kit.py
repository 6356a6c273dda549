"""The shared test kit: free ports and a bounded wait, one of each for tests, bench and lab."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port(kind: int = socket.SOCK_STREAM, host: str = "127.0.0.1") -> int:
    """A port the kernel just had free on ``host`` (TCP unless ``kind`` says SOCK_DGRAM)."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(count: int, kind: int = socket.SOCK_DGRAM, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports: all sockets are held open together while they are chosen."""
    socks = [socket.socket(socket.AF_INET, kind) for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(
    predicate: Callable[[], object], timeout: float = 60.0, what: str = "condition", interval: float = 0.1
) -> None:
    """Polls ``predicate`` until it is true; the bound only guards against a hang, never times a result."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
