"""The docker-compose testbed (docker/, docs/DOCKER.md), soft variant: the committed compose files
are what the generator makes; the Makefile's targets as the README names them (docker-up,
docker-logs, docker-down, docker-run) bring a rack up, train through the "switch" container's
software aggregator to gloo's accuracy and leave nothing behind; two projects share one engine;
a warm rebuild hits the cache. The runs skip, with the reason, when no Docker engine answers; the
bmv2 variant is in bmv2_tests/."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from switchagg_lab.testing.docker_testbed import (
    REPO,
    engine_cannot_run_containers,
    finals_of,
    image_ids,
    leftovers,
    load_testbed,
    make,
    skip_reason,
    source_digest,
)

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


@pytest.mark.parametrize("variant", ["soft", "bmv2"])
def test_a_projects_docker_networks_lie_in_its_own_slash_16(variant: str) -> None:
    tb = load_testbed()
    doc = yaml.safe_load(tb.compose_text(variant, 5, 93))
    own = ipaddress.IPv4Network("10.93.0.0/16")
    subnets = [c["subnet"] for net in doc["networks"].values() for c in net["ipam"]["config"]]
    assert len(subnets) == 6 and all(ipaddress.IPv4Network(s).subnet_of(own) for s in subnets)
    for name, service in doc["services"].items():
        networks = service["networks"]
        if isinstance(networks, dict):  # fixed addresses (the p4rt-shell takes any on mgmt)
            assert all(ipaddress.ip_address(a["ipv4_address"]) in own for a in networks.values()), name
        if any(
            k.startswith("rack") for k in networks
        ):  # rack-entry finds its cables in the project's subnets
            assert service["environment"]["RACK_CABLE_NET"] == "10.93", name


def test_up_chooses_the_first_slash_16_no_network_on_the_engine_overlaps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tb = load_testbed()
    used = ["172.17.0.0/16", "10.77.0.0/24", "10.77.3.0/24", "10.78.200.0/24", "10.80.0.0/16"]
    monkeypatch.setattr(tb, "project_net", lambda project: None)
    monkeypatch.setattr(tb, "docker_subnets", lambda: [ipaddress.ip_network(u) for u in used])
    assert tb.choose_net("another") == 79
    monkeypatch.setattr(tb, "project_net", lambda project: 78)  # its networks exist: kept
    assert tb.choose_net("mine") == 78
    monkeypatch.setattr(tb, "project_net", lambda project: None)
    monkeypatch.setattr(tb, "docker_subnets", lambda: [ipaddress.ip_network("10.0.0.0/8")])
    with pytest.raises(SystemExit, match="no free"):
        tb.choose_net("x")


def test_up_takes_no_start_and_the_backend_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    tb = load_testbed()
    calls: list[tuple[object, ...]] = []

    def up(*a: object, **k: object) -> int:
        calls.append((*a, k))
        return 77

    monkeypatch.setattr(tb, "up", up)
    assert tb.main(["up", "--no-start", "-p", "x", "-n", "2"]) == 0
    assert tb.main(["up", "-p", "y", "--backend", "gloo", "--train-args", "--epochs 1"]) == 0
    assert calls == [
        ("x", "soft", 2, None, None, {"start": False}),
        ("y", "soft", 4, "gloo", "--epochs 1", {"start": True}),
    ]
    # None: $TRAIN_BACKEND, else switchagg (TRAIN_BACKEND=gloo make docker-run)
    monkeypatch.setenv("TRAIN_BACKEND", "gloo")
    assert tb.default_backend() == "gloo"
    monkeypatch.delenv("TRAIN_BACKEND")
    assert tb.default_backend() == "switchagg"
    monkeypatch.setenv("TRAIN_BACKEND", "nccl")
    with pytest.raises(SystemExit, match="TRAIN_BACKEND"):
        tb.default_backend()


def test_make_docker_run_builds_the_images_once() -> None:
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "docker-run", "VPY=python3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    calls = [line for line in out.splitlines() if "docker/testbed.py" in line]
    assert len(calls) == 1 and " run " in calls[0], out


def test_the_wheel_layer_is_built_from_the_package_sources_only() -> None:
    tb = load_testbed()
    files = tb.source_files()
    package = set(tb.package_files(files))
    wanted = {
        "pyproject.toml",
        "README.md",
        "host/csrc/worker.c",
        "host/switchagg/session.py",
        "controller/switchagg_controller/app.py",
        "controller/switchagg_controller/p4/switchagg.json",
        "lab/switchagg_lab/__init__.py",
    }
    assert wanted <= package
    assert not [f for f in package if f.startswith(("tests/", "docs/", "bench/", "docker/", "examples/"))]


def test_concurrent_base_builds_make_one_image(tmp_path: Path) -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    tb = load_testbed()
    tag = f"switchagg-test-base:{os.getpid()}"

    def rootfs(root: str) -> None:
        time.sleep(0.5)  # the others are waiting (the lock) or about to check
        Path(root, "hello").write_text("hi\n")

    before = set(
        subprocess.run(
            ["docker", "images", "-aq", "--no-trunc"], capture_output=True, text=True
        ).stdout.split()
    )
    threads = [threading.Thread(target=tb.build_base, args=(tag, rootfs)) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        after = set(
            subprocess.run(
                ["docker", "images", "-aq", "--no-trunc"], capture_output=True, text=True
            ).stdout.split()
        )
        assert after - before == {tb.image_id(tag)}
    finally:
        subprocess.run(["docker", "rmi", tag], capture_output=True)


# A cold run builds the images first (base, controller, worker: ~6 min on 2 shared cores).
@pytest.mark.timeout(2400)
def test_two_projects_train_at_once_through_the_make_targets() -> None:
    """`make docker-up` (switchagg) and DOCKER.md's compose flow (`up --no-start --backend gloo`,
    then docker-compose up) on one engine at once; `make docker-logs`; `make docker-down`."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    tb = load_testbed()
    engine_problem = engine_cannot_run_containers()
    if engine_problem:
        pytest.skip(engine_problem)
    tags = [tb.BUILD_IMAGE, tb.TORCH_BUILD_IMAGE, tb.CONTROLLER_IMAGE, tb.WORKER_IMAGE]
    sources, previous = source_digest(), image_ids(tags)
    tb.build_images("soft")
    # Warm: unchanged sources, the same images, in seconds.
    built = image_ids(tags)
    started = time.monotonic()
    tb.build_images("soft")
    warm = time.monotonic() - started
    print(f"warm build: {warm:.1f} s")
    if source_digest() == sources:  # (a checkout being edited meanwhile builds new images, rightly)
        assert image_ids(tags) == built and None not in built.values()
        assert warm < 90, f"a warm build took {warm:.0f} s"
    # What a rebuild replaced is gone (nothing used it), by id: no image of ours left untagged.
    replaced = {i for i in previous.values() if i} - set(image_ids(tags).values())
    assert [i for i in replaced if tb.image_id(i)] == []

    n = 4
    sa, gl = f"sat{os.getpid()}sa", f"sat{os.getpid()}gl"
    try:
        up_sa = make("docker-up", "VARIANT=soft", f"N={n}", f"PROJECT={sa}")
        testbed = [sys.executable, str(REPO / "docker" / "testbed.py")]
        argv = [*testbed, "up", "--no-start", "-p", gl, "--backend", "gloo", "-n", str(n)]
        out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=True).stdout
        compose_file = f"docker/build/{gl}/docker-compose.yml"
        subprocess.run(
            ["docker-compose", "-p", gl, "-f", compose_file, "up", "-d"],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        nets = [re.search(r"Docker networks in (10\.\d+)\.0\.0/16", text) for text in (up_sa, out)]
        assert None not in nets and nets[0][1] != nets[1][1], (up_sa, out)  # type: ignore[index]
        codes = {p: tb.wait(p, timeout=900) for p in (sa, gl)}
        logs = {p: make("docker-logs", f"PROJECT={p}") for p in (sa, gl)}
    finally:
        for p in (sa, gl):
            make("docker-down", f"PROJECT={p}")
    for p in (sa, gl):
        assert codes[p] == [0] * n, logs[p][-6000:]
        assert leftovers(p) == []
        assert not (REPO / "docker" / "build" / p).exists()
    fin_sa, fin_gl = finals_of(logs[sa]), finals_of(logs[gl])
    assert sorted(f[2] for f in fin_sa) == list(range(n)), logs[sa][-6000:]
    assert {(f[1], f[3], f[6]) for f in fin_sa} == {("switchagg", n, "software")}, fin_sa
    assert re.search(r"job 1 on the software data plane", logs[sa]), logs[sa][-6000:]
    assert len(re.findall(r"rack-entry: switch port \d+ = ", logs[sa])) == n
    assert {(f[1], f[6]) for f in fin_gl} == {("gloo", "gloo")} and len(fin_gl) == n, logs[gl][-6000:]
    sa_accuracy, gl_accuracy = {f[5] for f in fin_sa}, {f[5] for f in fin_gl}
    assert len(sa_accuracy) == 1 and len(gl_accuracy) == 1  # DDP: every rank holds the same model
    assert abs(sa_accuracy.pop() - gl_accuracy.pop()) <= 0.5, (fin_sa, fin_gl)


@pytest.mark.timeout(1800)
def test_make_docker_run_with_train_backend_gloo() -> None:
    """`TRAIN_BACKEND=gloo make docker-run`: one build (warm here), a run on gloo, nothing left."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    engine_problem = engine_cannot_run_containers()
    if engine_problem:
        pytest.skip(engine_problem)
    project = f"sar{os.getpid()}"
    try:
        out = make(
            "docker-run", "VARIANT=soft", "N=2", f"PROJECT={project}",
            env={"TRAIN_BACKEND": "gloo", "TRAIN_ARGS": "--epochs 2"},
        )  # fmt: skip
    finally:
        load_testbed().down(project)
    assert out.count("--target worker") == 1, out[-6000:]  # built once
    assert "exit codes (rank order): [0, 0]" in out, out[-6000:]
    finals = finals_of(out)
    assert {(f[1], f[3], f[6]) for f in finals} == {("gloo", 2, "gloo")} and len(finals) == 2, out[-6000:]
    assert leftovers(project) == []
