"""Mixed hierarchies (docs/CONTROLLER.md, Mixed hierarchies): P4 leaves whose uplinks name a
software spine. The topology format and its errors; the leaves' entries address the software
spine; the spine's job (the leaves as ranks) on a real embedded software aggregator; one slot
range on the P4 pool and the spine's pool; a restarted spine reconciled to exactly its jobs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from switchagg import protocol
from switchagg.aggregator import SoftwareAggregator
from switchagg_controller import p4_program as p4
from switchagg_controller.allocation import SlotAllocator
from switchagg_controller.model import Job, Remote, SoftwareSpine, Uplink
from switchagg_controller.planes import P4DataPlane, spine_pool
from switchagg_controller.topology import TopologyError, dump_topologies, parse_network, parse_topologies

MIXED = """\
software_spines:
  - {name: sspine, listen: 127.0.0.1:48879, mac: "02:00:00:00:09:FE"}
switches:
  - name: l0
    address: unix:/run/l0.sock
    device_id: 0
    aggregator: {ip: 10.0.0.254, mac: "02:00:00:00:00:fe"}
    uplink: {switch: sspine, port: 100}
    hosts:
      - {name: h0, port: 1, mac: "02:00:00:00:00:01", ip: 10.0.0.1}
      - {name: h1, port: 2, mac: "02:00:00:00:00:02", ip: 10.0.0.2}
  - name: l1
    address: unix:/run/l1.sock
    device_id: 0
    aggregator: {ip: 10.0.1.254, mac: "02:00:00:00:01:fe"}
    uplink: {switch: sspine, port: 100}
    hosts:
      - {name: h2, port: 1, mac: "02:00:00:00:01:01", ip: 10.0.1.1}
"""


def test_a_leaf_uplink_may_name_a_software_spine() -> None:
    net = parse_network(MIXED, "net.yaml")
    l0, l1 = net.switches
    assert l0.uplink == Uplink("sspine", 100, None) and l1.uplink == Uplink("sspine", 100, None)
    assert net.software_spines == [SoftwareSpine("sspine", "127.0.0.1", 48879, "02:00:00:00:09:fe")]
    assert parse_topologies(MIXED) == net.switches  # the switches alone, for push and counters
    text = dump_topologies(net.switches, net.software_spines)
    assert parse_network(text) == net


def test_a_remote_software_spine_names_its_control_and_secret(tmp_path: Path) -> None:
    text = MIXED.replace(
        '"02:00:00:00:09:FE"}', "\"02:00:00:00:09:FE\", control: 'unix:/run/sp.sock', secret_file: sp.secret}"
    )
    (spine,) = parse_network(text, "net.yaml", base=tmp_path).software_spines
    assert spine.remote == Remote("unix:/run/sp.sock", tmp_path / "sp.secret")
    net = parse_network(text, "net.yaml", base=tmp_path)
    assert parse_network(dump_topologies(net.switches, net.software_spines)) == net


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("{switch: sspine, port: 100}", "{switch: sspine, port: 100, spine_port: 3}",
         "net.yaml:8: switches[0].uplink.spine_port: unknown field (known: switch, port)"),
        ("{switch: sspine, port: 100}", "{switch: sspine, port: 1}",
         "net.yaml:8: switches[0].uplink: port 1 of 'l0' is host 'h0' already"),
        ("listen: 127.0.0.1:48879", "listen: 127.0.0.1:0",
         "net.yaml:2: software_spines[0].listen: the leaves need the spine's real port, not 0"),
        ('mac: "02:00:00:00:09:FE"}', "mac: \"02:00:00:00:09:FE\", control: 'unix:/x'}",
         "net.yaml:2: software_spines[0].control: control needs secret_file too "
         "(a node run elsewhere names both)"),
        ("name: l1\n", "name: sspine\n",
         "net.yaml:12: switches[1].name: 'sspine' names a software spine too"),
    ],
)  # fmt: skip
def test_bad_software_spines(old: str, new: str, message: str) -> None:
    assert old in MIXED
    with pytest.raises(TopologyError) as e:
        parse_network(MIXED.replace(old, new, 1), "net.yaml")
    assert str(e.value) == message


def test_a_software_spine_no_leaf_names_is_refused() -> None:
    text = MIXED.replace("    uplink: {switch: sspine, port: 100}\n", "")
    with pytest.raises(TopologyError, match=r"net.yaml:2: .*software spine 'sspine' is no leaf's uplink"):
        parse_network(text, "net.yaml")


def _job(plane: P4DataPlane, ips: list[str], job_id: int = 3, generation: int = 9) -> Job:
    workers = tuple(plane.worker_addr(r, ip, 40000 + r) for r, ip in enumerate(ips))
    return Job(job_id, "j", len(ips), 32, 8, protocol.P4_K, generation, workers, counter_index=2)


@pytest.fixture
def spine() -> Iterator[SoftwareAggregator]:
    agg = SoftwareAggregator("127.0.0.1", 0).start()
    yield agg
    agg.stop()


def _plane(agg: SoftwareAggregator) -> P4DataPlane:
    net = parse_network(MIXED, "net.yaml")
    return P4DataPlane(net.switches, software_spines=[(net.software_spines[0], agg)])


async def test_the_leaves_address_the_software_spine_and_it_sums_the_leaves(
    spine: SoftwareAggregator,
) -> None:
    plane = _plane(spine)
    job = _job(plane, ["10.0.1.1", "10.0.0.1", "10.0.0.2"])  # rank 0 behind l1, ranks 1, 2 behind l0
    assert plane.route(job) == ("sspine", ["l0", "l1"])
    assert plane.switches_of(job) == ["l0", "l1"]  # the P4 switches; the spine is software
    assert plane.software_spine_of(job) == "sspine"
    assert plane.slot_pools(job.workers) == ("p4", spine_pool("sspine"))
    assert not plane.bumped_by_restart(job, "l0")  # a leaf restart keeps the generation
    plane.set_jobs([job])
    for leaf, index in (("l0", 0), ("l1", 1)):
        e = next(e for e in plane.desired(leaf).entries if e.table == p4.JOB_TABLE)
        params = dict(e.params)
        assert e.action == "MyIngress.set_leaf_job" and params["leaf_index"] == index
        assert (params["up_port"], params["spine_ip"], params["spine_mac"], params["spine_udp_port"]) == (
            100,
            p4.ip_int("127.0.0.1"),
            p4.mac_int("02:00:00:00:09:fe"),
            48879,
        )
    view = plane.software_spine_view(job)  # leaf l is rank l: the UDP source of its partials
    assert view.n == 2 and [(w.rank, w.ip, w.udp_port) for w in view.workers] == [
        (0, "10.0.0.254", 48879),
        (1, "10.0.1.254", 48879),
    ]
    # P4 leaves take no loss notices (a STATUS would be a bad_type drop there): the spine sends none
    assert plane.spine_planes["sspine"].loss_notices is False
    await plane.spine_planes["sspine"].install(view)
    installed = spine.jobs()[3]
    assert (installed.n, installed.slot_base, installed.slot_count, installed.k) == (2, 32, 8, protocol.P4_K)
    reading = await plane.counters()  # no supervisors here: only the spine answers
    assert {c.data_plane for c in reading.values} == {"p4:sspine"}


def test_one_slot_range_free_on_the_p4_pool_and_the_spine_pool(spine: SoftwareAggregator) -> None:
    plane = _plane(spine)
    sizes = plane.pool_sizes()
    assert sizes == {"p4": protocol.P4_NUM_SLOTS, spine_pool("sspine"): 32768}
    alloc = SlotAllocator(p4_slots=None, sw_slots=None, pools=sizes)
    across = _job(plane, ["10.0.0.1", "10.0.1.1"])
    alloc.place_on_all("p4", (spine_pool("sspine"),), 16)  # the spine's pool taken, not the P4 one's
    placed = alloc.place_on_all("p4", plane.slot_pools(across.workers), 8)
    assert placed.slot_base == 16  # free on both
    local = _job(plane, ["10.0.0.1"])
    assert alloc.place_on_all("p4", plane.slot_pools(local.workers), 8).slot_base == 0  # one leaf only


def test_a_restarted_spine_is_reconciled_to_exactly_its_jobs(spine: SoftwareAggregator) -> None:
    plane = _plane(spine)
    mine = _job(plane, ["10.0.0.1", "10.0.1.1"], job_id=5, generation=40)
    local = _job(plane, ["10.0.0.1", "10.0.0.2"], job_id=6)  # on l0 alone: not the spine's
    spine.add_job(7, 2, 100, 4, protocol.P4_K, 1, [("10.0.0.254", 48879), ("10.0.1.254", 48879)])  # gone
    assert plane.reconcile_software_spine("sspine", [mine, local]) == (1, 1)
    assert set(spine.jobs()) == {5}
    assert plane.reconcile_software_spine("sspine", [mine, local]) == (0, 0)  # idempotent


async def test_reloaded_jobs_are_put_back_on_the_software_spine(spine: SoftwareAggregator) -> None:
    """A controller restart: restore() installs the spine's part at once (the leaves get theirs
    from their supervisors when they connect; none here)."""
    plane = _plane(spine)
    across = _job(plane, ["10.0.0.1", "10.0.1.1"], job_id=4)
    local = _job(plane, ["10.0.0.1"], job_id=8)
    await plane.restore([across, local])
    assert set(spine.jobs()) == {4} and spine.jobs()[4].n == 2
    await plane.remove(across)  # the leaves are away: the spine still lets it go
    assert spine.jobs() == {}


async def test_a_remote_spine_that_is_away_makes_the_install_unavailable(tmp_path: Path) -> None:
    """Nothing serves its control socket: the job is not placed here, and the reason says the
    data plane is away (the workers hear UNAVAILABLE, as for a switch away), not full."""
    from switchagg.aggregator_control import RemoteAggregator
    from switchagg_controller.planes import DataPlaneError

    net = parse_network(MIXED, "net.yaml")
    remote = RemoteAggregator(f"unix:{tmp_path}/nobody.sock", "s", timeout=0.5, address=("127.0.0.1", 48879))
    try:
        plane = P4DataPlane(net.switches, software_spines=[(net.software_spines[0], remote)])
        job = _job(plane, ["10.0.0.1", "10.0.1.1"])
        with pytest.raises(DataPlaneError, match="sspine refused job 3") as e:
            await plane.install(job)
        assert e.value.unavailable
        assert plane.jobs_on("l0") == []  # not left on the leaves either
        reading = await plane.counters()
        assert list(reading.unavailable) == ["p4:sspine"]
    finally:
        remote.close()
