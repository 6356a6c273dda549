"""Shared by the docker testbed tests (tests/ for soft, bmv2_tests/ for bmv2): whether an engine
answers, one training run of the compose testbed with what it printed, and the Makefile's docker
targets run as a user runs them."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]  # the checkout: lab/switchagg_lab/testing/ is three below
FINAL = re.compile(
    r"^(worker\d+)_1\s+\|\s+\[(\w+)\] rank (\d+)/(\d+) final: loss (\S+)\s+"
    r"test accuracy (\S+)%\s+data plane (\S+)",
    re.M,
)


def load_testbed() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docker_testbed_cli", REPO / "docker" / "testbed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def skip_reason() -> str | None:
    """Why the compose testbed cannot run here, or None."""
    for tool in ("docker", "docker-compose", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if os.geteuid() != 0:
        return "the docker testbed needs root (host firewall rules for its bridges)"
    try:
        info = subprocess.run(
            ["docker", "info", "-f", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "the Docker engine does not answer (docker info timed out)"
    if info.returncode != 0:
        return f"no Docker engine answers: {info.stderr.strip()[:200]}"
    tb = load_testbed()
    if not tb.image_exists(tb.BASE_IMAGE) and shutil.which("debootstrap") is None:
        return f"neither the base image {tb.BASE_IMAGE} nor debootstrap to make it"
    return None


@dataclass
class Run:
    codes: list[int]
    logs: str
    finals: list[tuple[str, str, int, int, float, float, str]]  # service, backend, rank, n, loss, %, plane


def finals_of(logs: str) -> list[tuple[str, str, int, int, float, float, str]]:
    return [(m[0], m[1], int(m[2]), int(m[3]), float(m[4]), float(m[5]), m[6]) for m in FINAL.findall(logs)]


def train(variant: str, n: int, backend: str, project: str) -> Run:
    """One compose run (images must exist); always brought down."""
    tb = load_testbed()
    try:
        tb.up(project, variant, n, backend)
        codes = tb.wait(project, timeout=900)
        logs = tb.logs(project)
    finally:
        tb.down(project)
    return Run(codes, logs, finals_of(logs))


def make(*args: str, env: Mapping[str, str] | None = None, timeout: float = 1800) -> str:
    """`make ARGS` in the repository as a user runs it (stdout and stderr together); fails the
    test on a non-zero exit. VPY is this interpreter (the one with the test dependencies, which
    the docker targets' .venv would otherwise be made to hold)."""
    argv = ["make", "--no-print-directory", f"VPY={sys.executable}", *args]
    out = subprocess.run(
        argv,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, f"{' '.join(argv)} exited {out.returncode}:\n{out.stdout[-6000:]}"
    return out.stdout


def image_ids(tags: list[str]) -> dict[str, str | None]:
    tb = load_testbed()
    return {tag: tb.image_id(tag) for tag in tags}


def source_digest() -> str:
    """Of the files the image build copies: equal digests, equal build contexts."""
    tb = load_testbed()
    h = hashlib.sha256()
    for name in tb.source_files():
        h.update(name.encode() + b"\0" + (REPO / name).read_bytes() + b"\0")
    return h.hexdigest()


def leftovers(project: str) -> list[str]:
    """Containers, networks and volumes of the project, and host rules it added."""
    label = f"label=com.docker.compose.project={project}"
    found = []
    for kind in (["ps", "-a"], ["network", "ls"], ["volume", "ls"]):
        out = subprocess.run(
            ["docker", *kind, "-q", "--filter", label], capture_output=True, text=True
        ).stdout
        found += [f"{kind[0]} {i}" for i in out.split()]
    rules = subprocess.run(["iptables-save", "-t", "filter"], capture_output=True, text=True).stdout
    found += [line for line in rules.splitlines() if f"switchagg-docker:{project}" in line]
    return found


def engine_cannot_run_containers() -> str | None:
    """Why this machine cannot make the Debian base or run a container in it, or None.

    The base comes from debootstrap against the machine's mirror and the engine may sit in a
    sandbox that answers `docker info` yet cannot start containers: both are facts of the machine,
    so they skip. Everything built on the base (our Dockerfiles, the run) must pass."""
    tb = load_testbed()
    try:
        tb.build_base()
    except (SystemExit, subprocess.CalledProcessError, OSError) as e:
        return f"the Debian base image could not be made here: {e}"
    probe = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", tb.BASE_IMAGE, "true"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        return f"the Docker engine cannot run a container here: {probe.stderr.strip()[:300]}"
    return None


def check_training(variant: str, project: str, plane: str, n: int = 4) -> None:
    """Builds the images, trains through the switch and with gloo over the same rack, and checks
    every worker's outcome against gloo's."""
    tb = load_testbed()
    engine_problem = engine_cannot_run_containers()
    if engine_problem:
        pytest.skip(engine_problem)
    tb.build_images(variant)
    sa = train(variant, n, "switchagg", f"{project}sa")
    assert sa.codes == [0] * n, sa.logs[-6000:]
    assert sorted(f[2] for f in sa.finals) == list(range(n)), sa.logs[-6000:]
    assert {(f[1], f[3], f[6]) for f in sa.finals} == {("switchagg", n, plane)}, sa.finals
    # The job service says where it placed the job; the switch container says what its ports are.
    assert re.search(rf"job 1 on the {plane} data plane", sa.logs), sa.logs[-6000:]
    assert len(re.findall(r"rack-entry: switch port \d+ = ", sa.logs)) == n
    assert leftovers(f"{project}sa") == []
    gloo = train(variant, n, "gloo", f"{project}gl")
    assert gloo.codes == [0] * n, gloo.logs[-6000:]
    assert {(f[1], f[6]) for f in gloo.finals} == {("gloo", "gloo")} and len(gloo.finals) == n
    assert leftovers(f"{project}gl") == []
    sa_accuracy = {f[5] for f in sa.finals}
    gloo_accuracy = {f[5] for f in gloo.finals}
    assert len(sa_accuracy) == 1 and len(gloo_accuracy) == 1  # DDP: every rank holds the same model
    assert abs(sa_accuracy.pop() - gloo_accuracy.pop()) <= 0.5, (sa.finals, gloo.finals)
