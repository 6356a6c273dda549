"""The docker-compose testbed (docker/, docs/DOCKER.md), soft variant: the committed compose files
are what the generator makes, and a real run in containers trains through the "switch"
container's software aggregator to gloo's accuracy, leaving nothing behind. The run skips, with
the reason, when no Docker engine answers; the bmv2 variant is in bmv2_tests/."""

from __future__ import annotations

import os

import pytest

from tests.docker_testbed import REPO, check_training, load_testbed, skip_reason

COMMITTED = {"compose.soft.yml": ("soft", 4), "compose.bmv2.yml": ("bmv2", 4)}


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_the_committed_compose_files_are_generated(name: str) -> None:
    tb = load_testbed()
    variant, n = COMMITTED[name]
    assert (REPO / "docker" / name).read_text() == tb.compose_text(variant, n), "run: make docker-files"


def test_the_committed_topology_is_generated() -> None:
    tb = load_testbed()
    assert (REPO / "docker" / "topology.yaml").read_text() == tb.topology_text(4), "run: make docker-files"


def test_the_generated_topology_is_valid_for_the_controller() -> None:
    from switchagg_controller.topology import parse_topology
    from switchagg_lab.testbed.rack import AGG_IP, AGG_MAC

    tb = load_testbed()
    topo = parse_topology(tb.topology_text(8))
    assert (topo.aggregator_ip, topo.aggregator_mac) == (AGG_IP, AGG_MAC)
    assert [(h.port, h.ip, h.mac) for h in topo.hosts] == [
        (p, tb.rack_ip(p), tb.rack_mac(p)) for p in range(1, 9)
    ]


# A cold run builds the images first (base, controller, worker: ~3 min here).
@pytest.mark.timeout(2400)
def test_the_soft_variant_trains_through_the_switch_container() -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    check_training("soft", f"sat{os.getpid()}", "software")
