"""The controller runs a job across two bmv2 leaves and a bmv2 spine (docs/CONTROLLER.md, Two
levels on P4 switches): the topology names each leaf's uplink, `serve --topology` programs all
three switches, workers in four namespaces join through the job service, each gets its own leaf
as its aggregator, and the sums are exact. Skipped, with the reason, where bmv2 is missing."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from controller_support import Controller
from test_controller_dataplane_bmv2 import _reports, _skip_reason, _start

from switchagg import protocol

RACKS = [2, 2]


@pytest.fixture
def racks(tmp_path: Path) -> Iterator[Any]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from switchagg.testbed.p4racks import P4Racks

    with P4Racks(RACKS, tmp_path / "bed", spine="bmv2") as bed:
        yield bed


def _topology(bed: Any) -> str:
    """The spine (no hosts of its own) and the leaves with their uplinks, as the controller reads them."""
    from switchagg.testbed.p4racks import UPLINK_PORT
    from switchagg_controller.model import Uplink
    from switchagg_controller.topology import dump_topologies

    spine = replace(bed.spine_topology(), name="spine", hosts=())
    leaves = [
        replace(bed.leaf_topology(r), name=f"l{r}", uplink=Uplink("spine", UPLINK_PORT, r + 1))
        for r in range(len(RACKS))
    ]
    return dump_topologies([spine, *leaves])


def _job_counters(address: str, index: int, names: dict[str, str]) -> dict[str, int]:
    from switchagg_controller import p4_program
    from switchagg_controller.switch_session import SwitchSession

    with SwitchSession(address, 0, p4_program.P4INFO, primary=False, timeout=10) as s:
        return {k: min(s.read_counter(c, index)[index]) for k, c in names.items()}


def test_a_job_across_two_bmv2_leaves_and_a_bmv2_spine(racks: Any, tmp_path: Path) -> None:
    from switchagg_controller import p4_program

    topo = tmp_path / "network.yaml"
    topo.write_text(_topology(racks))
    c = Controller(tmp_path, ["--topology", str(topo), "--reap-timeout", "600"])
    c.start(listen=f"unix:{tmp_path}/jobs.sock")
    try:
        workers = SimpleNamespace(endpoints=racks.workers)
        reports = _reports(_start(workers, c.address, tmp_path, "tl", iterations=3, timeout=30))
        assert sorted(r["rank"] for r in reports) == list(range(sum(RACKS)))
        assert {r["data_plane"] for r in reports} == {"p4"} and {r["k"] for r in reports} == {protocol.P4_K}
        assert all(r["ok"] == 3 and r["wrong"] == 0 and r["error"] is None for r in reports), reports
        # Every leaf sent partials up and multicast the spine's results; the spine summed the leaves.
        names = p4_program.JOB_COUNTER_NAMES | p4_program.LEAF_COUNTER_NAMES
        leaves = [_job_counters(sw.grpc_address, 0, names) for sw in racks.leaves]
        spine = _job_counters(racks.spine.grpc_address, 0, p4_program.JOB_COUNTER_NAMES)
        for leaf in leaves:
            assert leaf["upstream"] == leaf["multicast"] > 0 and leaf["aggregated"] == 2 * leaf["upstream"], (
                leaf
            )
        assert spine["aggregated"] == sum(leaf["upstream"] for leaf in leaves) == 2 * spine["multicast"], (
            spine
        )
        print(f"\nleaves {leaves}; spine {spine}")
    finally:
        c.stop()
