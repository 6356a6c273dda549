"""Fixtures of the unit and end-to-end tests (the shared kit itself is switchagg_lab.testing)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from switchagg.aggregator import SoftwareAggregator
from switchagg_lab.testing.controller import Controller
from switchagg_lab.testing.kit import free_port


@pytest.fixture
def software_controller(tmp_path: Path) -> Iterator[Controller]:
    """`switchagg-ctl serve` on its embedded software aggregator, with a metrics port."""
    ctl = Controller(
        tmp_path,
        [
            "--software",
            "--software-listen",
            f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}",
            "--metrics-port",
            "0",
        ],
    )
    ctl.start()
    yield ctl
    ctl.stop()


@pytest.fixture
def aggregator() -> Iterator[SoftwareAggregator]:
    """A software aggregator on loopback, one thread, started and stopped around the test."""
    agg = SoftwareAggregator("127.0.0.1", 0)
    agg.start()
    yield agg
    agg.stop()


@pytest.fixture
def socks() -> Iterator[list[socket.socket]]:
    """Four UDP sockets on loopback, as ranks (or a spine) that craft their own packets; 10 s timeouts."""
    made = []
    for _ in range(4):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.settimeout(10.0)
        made.append(s)
    yield made
    for s in made:
        s.close()
