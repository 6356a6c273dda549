"""Fixtures of the bmv2 suite: one switch with six endpoint namespaces for the whole session.

Every test installs the jobs it needs with ``apply`` (the desired state as a whole), so tests
do not depend on each other; counters are compared as differences.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from switchagg_lab.bmv2.skip import skip_reason

ENDPOINTS = 6


@pytest.fixture(scope="session")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    from switchagg_lab.testbed import Testbed

    with Testbed(ENDPOINTS, tmp_path_factory.mktemp("bmv2")) as tb:
        yield tb


@pytest.fixture(scope="session")
def switch(bed: Any) -> Iterator[Any]:
    from switchagg_controller import p4_program
    from switchagg_controller.switch_session import SwitchSession

    session = SwitchSession(
        bed.grpc_address, bed.device_id, p4_program.P4INFO, p4_program.BMV2_JSON, force_pipeline=True
    )
    with session:
        yield session


@pytest.fixture
def bmv2(tmp_path: Path) -> Iterator[Any]:
    """A running switch with three ports cabled to endpoint namespaces; kill()/start() restart it."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    from switchagg_lab.testbed import Testbed

    with Testbed(3, tmp_path / "bed") as bed:
        assert bed.switch is not None
        yield bed.switch


@pytest.fixture
def own_bed(tmp_path: Path) -> Iterator[Any]:
    """A testbed of its own with three endpoints: for tests that kill or restart the switch."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    from switchagg_lab.testbed import Testbed

    with Testbed(3, tmp_path / "own_bed") as tb:
        yield tb


@pytest.fixture
def wire(bed: Any, switch: Any) -> Iterator[Any]:
    from switchagg_lab.bmv2.frames import Wire

    w = Wire(bed.endpoints)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(autouse=True)
def _no_loss(request: pytest.FixtureRequest) -> Iterator[None]:
    """Loss injected by a test never leaks into the next one."""
    yield
    if "bed" in request.fixturenames:
        for e in request.getfixturevalue("bed").endpoints:
            e.set_loss(0)
