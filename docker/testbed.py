#!/usr/bin/env python3
"""The docker-compose testbed: a rack of containers, training through the switch (docs/DOCKER.md).

    docker/testbed.py images [--variant bmv2]      base image (debootstrap) if missing, then the images
    docker/testbed.py up --variant soft -n 4       compose up -d (writes docker/build/<project>/)
    docker/testbed.py wait                         every worker's exit code; 0 if all are 0
    docker/testbed.py down                         no container, network, volume or host rule left
    docker/testbed.py run --variant bmv2 -n 4      images + up + wait + down: one training run
    docker/testbed.py compose --variant soft -n 4  print a compose file
    docker/testbed.py files                        rewrite the committed docker/compose.*.yml, topology.yaml
    docker/testbed.py base                         only the Debian base image

The rack: switch port p (1..n) is its own internal Docker network rack<p> (10.B.<p>.0/24) shared
by the switch container and worker p-1 only; docker/rack-entry.sh turns those interfaces into rack
ports with the addresses of lab/switchagg_lab/testbed/rack.py (10.201.0.p, aggregator
10.201.0.254). Rendezvous, gloo and aggregation traffic cross the switch; the job service and
P4Runtime use the internal network mgmt (10.B.0.0/24). Nothing is published or routed off the host.
Each project gets a /16 of its own, 10.B.0.0/16 (B from 77 up: the first that no Docker network
on the engine overlaps), so several testbeds (-p) share one engine.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import fcntl
import ipaddress
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKER_DIR = REPO / "docker"
BUILD_DIR = DOCKER_DIR / "build"
VARIANTS = ("soft", "bmv2")
BACKENDS = ("switchagg", "gloo")
MAX_WORKERS = 32

BASE_IMAGE = "switchagg-base:bookworm"
BUILD_IMAGE = "switchagg-build:dev"  # Dockerfile.node's build stage, tagged: the cache of the wheel
TORCH_BUILD_IMAGE = "switchagg-torch-build:dev"  # its torch-build stage: the c10d backend's library
CONTROLLER_IMAGE = "switchagg-controller:dev"
WORKER_IMAGE = "switchagg-worker:dev"
BMV2_SWITCH_IMAGE = "switchagg-bmv2-switch:dev"
P4RT_SHELL_IMAGE = "switchagg-p4rt-shell:dev"
P4_IMAGE_DEFAULT = "p4lang/behavioral-model:latest"
LOCAL_P4_IMAGE = "switchagg-p4:local"  # what docker/p4-image-from-prefix.sh makes
IMAGE_LABEL = "org.switchagg.testbed=1"  # on every image built here (the Dockerfiles)
# Held while images are built or a project's networks are chosen and made: one engine, several
# checkouts or test runs (a file lock, released when the process ends however it ends).
LOCK_FILE = Path(tempfile.gettempdir()) / "switchagg-docker-testbed.lock"
# Images of ours a rebuild replaced while a container still used them: removed later (by id).
REPLACED_FILE = Path(tempfile.gettempdir()) / "switchagg-docker-testbed.replaced"

# Addresses: the rack is lab/switchagg_lab/testbed/rack.py's; Docker's own subnets only cable it.
RACK_SUBNET = "10.201.0."
AGG_IP = "10.201.0.254"
AGG_MAC = "02:5a:00:00:00:fe"
# Docker's subnets, per project: 10.B.0.0/24 is mgmt, 10.B.p.0/24 the cable of switch port p.
NET_FIRST, NET_LAST = 77, 199  # B
DEFAULT_NET = NET_FIRST  # the committed compose files'
JOB_SERVICE_PORT = 50051
P4RUNTIME_PORT = 9559
MASTER_PORT = 29500
DEFAULT_SECRET = "switchagg-docker-testbed"  # internal networks only; override with SWITCHAGG_SECRET
# train_digits.py's options: bmv2 forwards a few thousand packets a second, so its run trains a
# narrower model (1.5k parameters, 24 packets per rank and step) than the soft one (26k).
TRAIN_ARGS = {"soft": "", "bmv2": "--hidden 16"}
TORCH_REQUIREMENT = "torch==2.13.0"  # the worker image's (the Makefile's pin)
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
RULE_TAG = "switchagg-docker"  # the comment on every host firewall rule `up` adds


def rack_ip(port: int) -> str:
    return f"{RACK_SUBNET}{port}"


def rack_mac(port: int) -> str:
    return f"02:5a:00:00:00:{port:02x}"


def cable_subnet(port: int, net: int = DEFAULT_NET) -> str:
    return f"10.{net}.{port}.0/24"


def project_network(net: int) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(f"10.{net}.0.0/16")


# -- the compose file ------------------------------------------------------------------------


def _healthcheck(test: list[str]) -> dict[str, Any]:
    return {"test": test, "interval": "1s", "timeout": "5s", "retries": 120}


def _port_open(port: int) -> list[str]:
    return ["CMD", "bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"]


def _serve(extra: list[str]) -> list[str]:
    """switchagg-ctl serve in a container: the secret comes from the environment."""
    argv = [
        "switchagg-ctl", "-v", "serve", "--listen", f"0.0.0.0:{JOB_SERVICE_PORT}",
        "--secret-file", "/tmp/secret", "--state", "/tmp/ctl.db", *extra,
    ]  # fmt: skip
    return ["sh", "-c", 'printf %s "$$SWITCHAGG_SECRET" >/tmp/secret && exec "$$@"', "serve", *argv]


def topology_text(n: int) -> str:
    """The controller's topology file for the bmv2 variant (controller/topology.example.yaml)."""
    doc = {
        "switch": {"address": f"switch:{P4RUNTIME_PORT}", "device_id": 0, "election_id": [0, 1]},
        "aggregator": {"ip": AGG_IP, "mac": AGG_MAC, "udp_port": 48879},
        "cpu_port": 255,
        "hosts": [
            {"name": f"worker{p - 1}", "port": p, "mac": rack_mac(p), "ip": rack_ip(p)}
            for p in range(1, n + 1)
        ],
    }
    header = f"# The bmv2 variant's rack, {n} workers. Generated by docker/testbed.py; do not edit.\n"
    return header + yaml.safe_dump(doc, sort_keys=False)


def compose(variant: str, n: int, net: int = DEFAULT_NET) -> dict[str, Any]:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, not {variant!r}")
    if not 1 <= n <= MAX_WORKERS:
        raise ValueError(f"a rack has 1..{MAX_WORKERS} workers, not {n}")
    if not NET_FIRST <= net <= NET_LAST:
        raise ValueError(f"the project's network is 10.B.0.0/16 with B in {NET_FIRST}..{NET_LAST}, not {net}")
    # rack-entry finds each cable by its Docker address, in 10.<net>.<port>.0/24
    common = {"SWITCHAGG_SECRET": f"${{SWITCHAGG_SECRET:-{DEFAULT_SECRET}}}", "RACK_CABLE_NET": f"10.{net}"}
    if variant == "soft":
        services, service_host = _soft_switch(n, net, common), "switch"
    else:
        services, service_host = _bmv2_switch(n, net, common), "controller"
    for rank in range(n):
        services[f"worker{rank}"] = _worker(variant, n, net, rank, common, service_host)
    networks: dict[str, Any] = {"mgmt": _network(f"10.{net}.0.0/24")}
    for p in range(1, n + 1):
        networks[f"rack{p}"] = _network(cable_subnet(p, net))
    return {"version": "2.4", "services": services, "networks": networks}


def _cables(n: int, net: int) -> dict[str, Any]:
    return {f"rack{p}": {"ipv4_address": f"10.{net}.{p}.254"} for p in range(1, n + 1)}


def _soft_switch(n: int, net: int, common: dict[str, str]) -> dict[str, Any]:
    """The software aggregator (inside the job service) at the rack's aggregator address, on a
    bridge over the switch ports; the same container is "controller" on mgmt."""
    soft = _serve(["--software", "--software-listen", f"{AGG_IP}:48879"])
    mgmt = {"ipv4_address": f"10.{net}.0.2", "aliases": ["controller"]}
    return {
        "switch": {
            "image": CONTROLLER_IMAGE,
            "command": ["soft-switch", str(n), *soft],
            "cap_add": ["NET_ADMIN"],
            "environment": common,
            "networks": {"mgmt": mgmt, **_cables(n, net)},
            "healthcheck": _healthcheck(_port_open(JOB_SERVICE_PORT)),
        }
    }


def _bmv2_switch(n: int, net: int, common: dict[str, str]) -> dict[str, Any]:
    """bmv2 on the cables, the controller on mgmt, and the p4runtime-shell tool service."""
    grpc = f"0.0.0.0:{P4RUNTIME_PORT}"
    bmv2 = ["simple_switch_grpc", "--no-p4", "--device-id", "0", "--thrift-port", "9090"]
    p4 = ["--p4-json", "/src/p4/build/switchagg.json", "--p4info", "/src/p4/build/switchagg.p4info.txtpb"]
    return {
        "switch": {
            "image": BMV2_SWITCH_IMAGE,
            "command": ["bmv2-switch", str(n), *bmv2, "--", "--grpc-server-addr", grpc],
            "cap_add": ["NET_ADMIN"],
            "environment": {"RACK_CABLE_NET": f"10.{net}"},
            "networks": {"mgmt": {"ipv4_address": f"10.{net}.0.2"}, **_cables(n, net)},
            "healthcheck": _healthcheck(_port_open(P4RUNTIME_PORT)),
        },
        "controller": {
            "image": CONTROLLER_IMAGE,
            "entrypoint": [],
            "command": _serve(["--topology", "/etc/switchagg/topology.yaml", *p4]),
            "environment": common,
            "volumes": ["./topology.yaml:/etc/switchagg/topology.yaml:ro"],
            "networks": {"mgmt": {"ipv4_address": f"10.{net}.0.3"}},
            "depends_on": {"switch": {"condition": "service_healthy"}},
            "healthcheck": _healthcheck(_port_open(JOB_SERVICE_PORT)),
        },
        # Looking at the switch: `docker-compose run --rm p4rt-shell` (docs/DOCKER.md). A second
        # client (election id 0,2: the controller stays primary) that reads the pipeline from the
        # switch; it only starts when asked for, so `up` leaves it out.
        "p4rt-shell": {
            "image": P4RT_SHELL_IMAGE,
            "command": [
                "--grpc-addr",
                f"switch:{P4RUNTIME_PORT}",
                "--device-id",
                "0",
                "--election-id",
                "0,2",
            ],
            "networks": ["mgmt"],
            "profiles": ["tools"],
            "depends_on": {"controller": {"condition": "service_healthy"}},
        },
    }


def _worker(
    variant: str, n: int, net: int, rank: int, common: dict[str, str], service_host: str
) -> dict[str, Any]:
    """Rank ``rank``: torchrun of examples/train_digits.py on the rack, its cable to port rank + 1."""
    port = rank + 1
    train = (
        f"exec torchrun --nnodes {n} --node-rank {rank} --nproc-per-node 1 --master-addr {rack_ip(1)}"
        f' --master-port {MASTER_PORT} examples/train_digits.py --backend "$$TRAIN_BACKEND" $$TRAIN_ARGS'
    )
    return {
        "image": WORKER_IMAGE,
        "command": ["worker", str(port), "sh", "-c", train],
        "cap_add": ["NET_ADMIN"],
        "environment": {
            **common,
            "TRAIN_BACKEND": "${TRAIN_BACKEND:-switchagg}",
            "TRAIN_ARGS": f"${{TRAIN_ARGS:-{TRAIN_ARGS[variant]}}}",
            "SWITCHAGG_JOB_SERVICE": f"{service_host}:{JOB_SERVICE_PORT}",
            "SWITCHAGG_WORKER_BIND": rack_ip(port),
            "RACK_PORTS": str(n),  # rack-entry names the rack's addresses (c10d looks its peers up)
            "OMP_NUM_THREADS": "1",
        },
        "networks": {
            "mgmt": {"ipv4_address": f"10.{net}.0.{10 + rank}"},
            f"rack{port}": {"ipv4_address": f"10.{net}.{port}.2"},
        },
        "depends_on": {service_host: {"condition": "service_healthy"}},
    }


def _network(subnet: str) -> dict[str, Any]:
    return {"internal": True, "ipam": {"config": [{"subnet": subnet}]}}


def compose_text(variant: str, n: int, net: int = DEFAULT_NET) -> str:
    header = (
        f"# The docker testbed, {variant} variant, {n} workers (docs/DOCKER.md).\n"
        f"# Generated by `docker/testbed.py compose --variant {variant} -n {n}`; do not edit.\n"
        f"# Docker's subnets: 10.{net}.0.0/16 (`up` chooses one per project).\n"
        "# Images: `docker/testbed.py images`; host firewall rules, clean-up: `docker/testbed.py up/down`.\n"
    )
    return header + yaml.safe_dump(compose(variant, n, net), sort_keys=False, width=200)


# -- images ----------------------------------------------------------------------------------


def sh(*argv: str, check: bool = True, capture: bool = False, **kw: Any) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(argv), file=sys.stderr, flush=True)
    return subprocess.run(argv, check=check, text=True, capture_output=capture, **kw)


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def image_id(name: str) -> str | None:
    out = subprocess.run(
        ["docker", "image", "inspect", "-f", "{{.Id}}", name], capture_output=True, text=True
    )
    return out.stdout.strip() if out.returncode == 0 else None


@contextlib.contextmanager
def engine_lock() -> Iterator[None]:
    """One builder (or network chooser) at a time on this machine: the images and the subnets
    are the engine's, shared by every checkout and test run."""
    with open(LOCK_FILE, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another build or up ({LOCK_FILE})", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def debian_mirror() -> str:
    """The Debian mirror apt uses here (debootstrap fetches the base from it)."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for uri, suites in re.findall(r"^URIs:\s*(\S+)\s*\nSuites:\s*(.*)$", text, re.M):
            if "bookworm" in suites.split() and "security" not in uri:
                return str(uri)
        for uri in re.findall(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", text, re.M):
            return str(uri)
    return "http://deb.debian.org/debian"


def import_image(tar_argv: Sequence[str], tag: str) -> bool:
    """`docker import` of what ``tar_argv`` writes, tagged ``tag`` unless an image has that tag
    already (made meanwhile by another process: ours is then removed, so no untagged image is
    left). True if ours became ``tag``."""
    tar = subprocess.Popen(list(tar_argv), stdout=subprocess.PIPE)
    change = ["--change", f"LABEL {IMAGE_LABEL}"]
    imported = sh("docker", "import", *change, "-", stdin=tar.stdout, capture=True).stdout.strip()
    if tar.wait() != 0:
        subprocess.run(["docker", "rmi", imported], capture_output=True)
        raise SystemExit(f"{' '.join(tar_argv)} failed")
    if image_exists(tag):
        subprocess.run(["docker", "rmi", imported], capture_output=True)
        return False
    sh("docker", "tag", imported, tag)
    return True


def build_base(tag: str = BASE_IMAGE, make_rootfs: Callable[[str], None] | None = None) -> None:
    """The Debian base image ``tag`` if missing (``make_rootfs``: debootstrap). Under the lock:
    two builds at once make one image, never an untagged second."""
    with engine_lock():
        _build_base(tag, make_rootfs)


def _build_base(tag: str = BASE_IMAGE, make_rootfs: Callable[[str], None] | None = None) -> None:
    if image_exists(tag):
        return
    with tempfile.TemporaryDirectory(prefix="switchagg-rootfs-") as root:
        (make_rootfs or debootstrap)(root)
        import_image(["tar", "-C", root, "-c", "."], tag)


def debootstrap(root: str) -> None:
    if shutil.which("debootstrap") is None:
        raise SystemExit("debootstrap is needed to make the base image (apt-get install debootstrap)")
    sh("debootstrap", "--variant=minbase", "bookworm", root, debian_mirror(), stdout=subprocess.DEVNULL)


def torch_wheel(dest: Path) -> Path:
    """The CPU torch wheel for the worker image: $TORCH_WHEEL if set, else the one
    `pip download torch==2.13.0` resolves to with this machine's pip settings (a local CPU wheel
    through find-links, say) if it is a CPU build, else the one from the PyTorch CPU index (on
    x86_64, PyPI's torch is the CUDA build: several GB with its nvidia packages)."""
    dest.mkdir(parents=True, exist_ok=True)
    given = os.environ.get("TORCH_WHEEL")
    if given:
        for old in dest.glob("*.whl"):
            old.unlink()
        target = dest / Path(given).name
        shutil.copy(given, target)
        return target
    # Into a fresh folder, then moved: the wheel already in dest stays if it is the same file, so
    # its modification time does not change (the image cache keys on contents anyway).
    with tempfile.TemporaryDirectory(prefix="torch-", dir=dest.parent) as tmp:
        wheel = _download_torch(Path(tmp), [])
        if platform.machine() == "x86_64" and "+cpu" not in wheel.name:
            print(f"{wheel.name} is not a CPU build: trying {TORCH_CPU_INDEX}", file=sys.stderr)
            wheel.unlink()
            try:
                wheel = _download_torch(Path(tmp), ["--index-url", TORCH_CPU_INDEX])
            except (subprocess.CalledProcessError, SystemExit) as e:
                raise SystemExit(
                    f"no CPU build of {TORCH_REQUIREMENT} from {TORCH_CPU_INDEX} ({e}): "
                    "set TORCH_WHEEL to the path of a CPU wheel"
                ) from e
        target = dest / wheel.name
        for old in dest.glob("*.whl"):
            if old.name != wheel.name:
                old.unlink()
        if not (target.exists() and target.stat().st_size == wheel.stat().st_size):
            shutil.move(str(wheel), target)
    return target


def _download_torch(dest: Path, extra: list[str]) -> Path:
    argv = ["-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(dest)]
    sh(sys.executable, *argv, *extra, TORCH_REQUIREMENT)
    wheels = list(dest.glob("torch-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"pip download gave {wheels}, not one torch wheel")
    return wheels[0]


def pip_settings(dest: Path) -> None:
    """pip.conf for builds: this machine's http(s) index URLs and CA bundle (file:// ones cannot
    be reached from a build)."""
    dest.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    found: dict[str, str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        found[key.split(".")[-1]] = value.strip().strip("'\"")
    for key in ("index-url", "extra-index-url", "cert", "timeout", "default-timeout"):
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            found[key] = env
    conf = configparser.ConfigParser()
    conf["global"] = {"timeout": found.get("default-timeout") or found.get("timeout") or "180"}
    for key in ("index-url", "extra-index-url"):
        urls = [u for u in found.get(key, "").split() if u.startswith(("http://", "https://"))]
        if urls:
            conf["global"][key] = " ".join(urls)
    cert = found.get("cert") or "/etc/ssl/certs/ca-certificates.crt"
    (dest / "ca.crt").unlink(missing_ok=True)
    if Path(cert).is_file():
        shutil.copy(cert, dest / "ca.crt")
        conf["global"]["cert"] = "/etc/switchagg-pip/ca.crt"
    with open(dest / "pip.conf", "w") as f:
        conf.write(f)


def source_files() -> list[str]:
    """The repository's files as git sees them (tracked and new, not ignored): no build output."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "-c", "-o", "--exclude-standard"],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"the build context is the git checkout's files: git ls-files failed ({e})") from e
    return sorted({os.fsdecode(n) for n in listed.split(b"\0") if n and (REPO / os.fsdecode(n)).is_file()})


def package_files(files: Sequence[str]) -> list[str]:
    """Those of ``files`` that `pip wheel` reads: pyproject.toml's package and extension source
    directories, and the project files at the top (README.md is the long description). The
    wheel's layer is rebuilt only when one of these changes, not for a test or a document."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: everything
        return list(files)
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    setuptools = project.get("tool", {}).get("setuptools", {})
    dirs = set(setuptools.get("package-dir", {}).values())
    dirs |= set(setuptools.get("packages", {}).get("find", {}).get("where", []))
    for ext in setuptools.get("ext-modules", []):
        dirs |= {str(Path(src).parent) for src in ext.get("sources", [])}
    dirs.discard("")
    if not dirs:  # a flat layout: no way to tell, so everything
        return list(files)
    top = {
        "pyproject.toml",
        "setup.py",
        "setup.cfg",
        "MANIFEST.in",
        str(project.get("project", {}).get("readme", "")),
    }
    return [n for n in files if n in top or any(n.startswith(d.rstrip("/") + "/") for d in dirs)]


def copy_files(files: Sequence[str], dest: Path) -> None:
    """``files`` (relative to the repository) into ``dest``, afresh; links are copied as the files
    they point to (the controller's P4 artifacts are links into p4/build)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)


# What the docker CLI (23+) prints on stderr for every build with the legacy builder (an indented
# continuation follows: how to install buildx, or that DOCKER_BUILDKIT=0 disabled it): a notice, not a
# problem of the build. The builder is BuildKit where the engine has it (builder_env).
LEGACY_BUILDER_NOTICE = re.compile(
    r"^DEPRECATED: The legacy builder is deprecated.*\n(?:[ \t]+\S.*\n)*\n?", re.M
)


def builder_env() -> dict[str, str]:
    """The environment of `docker build`: BuildKit (DOCKER_BUILDKIT=1) where the buildx component is
    installed; else the CLI's own choice, the legacy builder. A DOCKER_BUILDKIT of the caller's wins."""
    env = dict(os.environ)
    if "DOCKER_BUILDKIT" not in env:
        buildx = subprocess.run(["docker", "buildx", "version"], capture_output=True, check=False)
        if buildx.returncode == 0:
            env["DOCKER_BUILDKIT"] = "1"
    return env


def _build(dockerfile: Path, context: Path, tag: str, *args: str) -> None:
    argv = ["docker", "build", "-q", "--network", "host", "-f", str(dockerfile), *args, "-t", tag]
    p = sh(
        *argv, str(context), check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=builder_env()
    )
    sys.stderr.write(LEGACY_BUILDER_NOTICE.sub("", p.stderr) if p.returncode == 0 else p.stderr)
    if p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, argv, stderr=p.stderr)


def build_images(variant: str, p4_image: str | None = None) -> None:
    """The base if missing, then the variant's images; unchanged sources hit the cache throughout
    (docs/DOCKER.md). One build at a time on this machine (engine_lock)."""
    started = time.monotonic()
    with engine_lock():
        _build_base()
        context = BUILD_DIR / "context"
        files = source_files()
        copy_files(files, context / "src")
        copy_files(package_files(files), context / "pkg")
        torch_wheel(context / "wheels")
        pip_settings(context / "pip")
        # The build stage is tagged like the others: an untagged stage would be the prune's (and
        # its layers, the compiled wheel, rebuilt every time).
        targets = [("build", BUILD_IMAGE), ("torch-build", TORCH_BUILD_IMAGE)]
        targets += [("controller", CONTROLLER_IMAGE), ("worker", WORKER_IMAGE)]
        if variant == "bmv2":
            targets.append(("p4rt-shell", P4RT_SHELL_IMAGE))
        tags = [tag for _, tag in targets] + ([BMV2_SWITCH_IMAGE] if variant == "bmv2" else [])
        before = {tag: image_id(tag) for tag in tags}
        for target, tag in targets:
            _build(
                DOCKER_DIR / "Dockerfile.node",
                context,
                tag,
                "--target",
                target,
                "--build-arg",
                f"BASE_IMAGE={BASE_IMAGE}",
            )
        if variant == "bmv2":
            image = p4_image or default_p4_image()
            _build(
                DOCKER_DIR / "Dockerfile.bmv2-switch",
                DOCKER_DIR,
                BMV2_SWITCH_IMAGE,
                "--build-arg",
                f"P4_IMAGE={image}",
            )
        remove_replaced(before, {tag: image_id(tag) for tag in tags})
    print(f"images ready in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)


def remove_replaced(before: dict[str, str | None], after: dict[str, str | None]) -> None:
    """Removes the images a rebuild took our tags from, and with them their own untagged layers.
    Nothing else: no prune, so another build's layers on this engine are never touched. One that
    a container still uses (a testbed that is up), or that another tag names, stays (docker rmi
    refuses it); it is remembered (REPLACED_FILE) and removed by a later build or `down`."""
    keep = set(after.values())
    replaced = {i for i in before.values() if i} - keep
    remove_images(replaced | (_read_replaced() - keep))


def remove_images(ids: set[str]) -> None:
    """Call under engine_lock. ``ids`` that stay (in use) are written back to REPLACED_FILE."""
    left = set()
    for old in sorted(ids):
        subprocess.run(["docker", "rmi", old], capture_output=True)
        if image_id(old) is not None:
            left.add(old)
    REPLACED_FILE.write_text("".join(f"{i}\n" for i in sorted(left)))


def _read_replaced() -> set[str]:
    try:
        return set(REPLACED_FILE.read_text().split())
    except OSError:
        return set()


def remove_replaced_now() -> None:
    """What `down` does: the remembered images, if no build holds the lock (else that build will)."""
    if not _read_replaced():
        return
    with open(LOCK_FILE, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        try:
            remove_images(_read_replaced())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_p4_image() -> str:
    """$P4_IMAGE, else the locally packaged bmv2 when there is one, else the public image."""
    given = os.environ.get("P4_IMAGE")
    if given:
        return given
    return LOCAL_P4_IMAGE if image_exists(LOCAL_P4_IMAGE) else P4_IMAGE_DEFAULT


# -- up, wait, down --------------------------------------------------------------------------


def project_dir(project: str) -> Path:
    return BUILD_DIR / project


def compose_cmd(project: str, *argv: str) -> list[str]:
    return ["docker-compose", "-p", project, "-f", str(project_dir(project) / "docker-compose.yml"), *argv]


def write_project(
    project: str, variant: str, n: int, net: int = DEFAULT_NET, env: dict[str, str] | None = None
) -> Path:
    """docker/build/<project>/: the compose file, the topology, and .env (what `up` was given, so
    that a plain `docker-compose -p <project> -f ...` later uses the same)."""
    d = project_dir(project)
    d.mkdir(parents=True, exist_ok=True)
    (d / "docker-compose.yml").write_text(compose_text(variant, n, net))
    (d / "topology.yaml").write_text(topology_text(n))
    (d / ".env").write_text("".join(f"{k}={v}\n" for k, v in (env or {}).items()))
    return d


def docker_subnets() -> list[ipaddress.IPv4Network]:
    """Every IPv4 subnet of every network on the engine."""
    ids = sh("docker", "network", "ls", "-q", capture=True).stdout.split()
    if not ids:
        return []
    fmt = "{{range .IPAM.Config}}{{.Subnet}} {{end}}"
    out = sh("docker", "network", "inspect", "-f", fmt, *ids, capture=True, check=False).stdout
    found = []
    for word in out.split():
        with contextlib.suppress(ValueError):
            net = ipaddress.ip_network(word, strict=False)
            if isinstance(net, ipaddress.IPv4Network):
                found.append(net)
    return found


def project_net(project: str) -> int | None:
    """B of the project's 10.B.0.0/16 when its networks exist (an `up` again keeps it)."""
    label = f"label=com.docker.compose.project={project}"
    ids = sh("docker", "network", "ls", "-q", "--filter", label, capture=True).stdout.split()
    if not ids:
        return None
    fmt = "{{range .IPAM.Config}}{{.Subnet}} {{end}}"
    out = sh("docker", "network", "inspect", "-f", fmt, *ids, capture=True, check=False).stdout
    m = re.search(r"\b10\.(\d+)\.\d+\.0/24\b", out)
    return int(m.group(1)) if m else None


def choose_net(project: str) -> int:
    """The project's 10.B.0.0/16: its own if its networks exist, else the first from
    NET_FIRST that no network on the engine overlaps. Call it under engine_lock, with the
    networks made before the lock is released."""
    own = project_net(project)
    if own is not None:
        return own
    used = docker_subnets()
    for net in range(NET_FIRST, NET_LAST + 1):
        if not any(project_network(net).overlaps(u) for u in used):
            return net
    raise SystemExit(
        f"no free 10.B.0.0/16 (B in {NET_FIRST}..{NET_LAST}) on this engine: `down` a testbed first"
    )


def missing_images(variant: str) -> list[str]:
    need = [CONTROLLER_IMAGE, WORKER_IMAGE] + ([BMV2_SWITCH_IMAGE] if variant == "bmv2" else [])
    return [image for image in need if not image_exists(image)]


def project_bridges(project: str) -> list[str]:
    """The host bridges of the project's networks (Docker names them br-<network id[:12]>)."""
    label = f"label=com.docker.compose.project={project}"
    ids = sh("docker", "network", "ls", "-q", "--no-trunc", "--filter", label, capture=True).stdout.split()
    return [f"br-{i[:12]}" for i in ids]


def allow_bridged(project: str) -> None:
    """Rack addresses are not Docker's: with bridge netfilter on, Docker's isolation rules for
    internal networks drop them. Frames that stay on one of our bridges are let through (tagged,
    so that `down` finds them even when the networks are gone)."""
    if shutil.which("iptables") is None:
        return
    for br in project_bridges(project):
        tag = f"{RULE_TAG}:{project}"
        sh(
            "iptables",
            "-I",
            "DOCKER-USER",
            "-i",
            br,
            "-o",
            br,
            "-m",
            "comment",
            "--comment",
            tag,
            "-j",
            "ACCEPT",
        )


def remove_rules(project: str | None) -> int:
    """Deletes the DOCKER-USER rules tagged for ``project`` (every project: None)."""
    if shutil.which("iptables-save") is None:
        return 0
    rules = subprocess.run(["iptables-save", "-t", "filter"], capture_output=True, text=True).stdout
    removed = 0
    for line in rules.splitlines():
        m = re.search(r'--comment "?([^" ]+)"?', line)
        if not line.startswith("-A DOCKER-USER ") or m is None:
            continue
        tag = m.group(1)
        if tag == f"{RULE_TAG}:{project}" or (project is None and tag.startswith(f"{RULE_TAG}:")):
            spec = line.split()[2:]
            spec = [s.strip('"') for s in spec]
            subprocess.run(["iptables", "-D", "DOCKER-USER", *spec], check=False)
            removed += 1
    return removed


def default_backend() -> str:
    """$TRAIN_BACKEND, else switchagg."""
    backend = os.environ.get("TRAIN_BACKEND") or "switchagg"
    if backend not in BACKENDS:
        raise SystemExit(f"TRAIN_BACKEND must be one of {', '.join(BACKENDS)}, not {backend!r}")
    return backend


def up(
    project: str,
    variant: str,
    n: int,
    backend: str | None = None,
    train_args: str | None = None,
    start: bool = True,
) -> int:
    """Makes the project's networks, host rules and containers, and starts them (``start``).
    ``backend``: None is $TRAIN_BACKEND or switchagg; ``train_args``: None is $TRAIN_ARGS or the
    variant's. Returns the B of the project's 10.B.0.0/16."""
    missing = missing_images(variant)
    if missing:
        raise SystemExit(
            f"no image {', '.join(missing)}: make docker-images VARIANT={variant} (docker/testbed.py images)"
        )
    settings = {"TRAIN_BACKEND": backend or default_backend()}
    if train_args is None:
        train_args = os.environ.get("TRAIN_ARGS")
    if train_args is not None:
        settings["TRAIN_ARGS"] = train_args
    env = {**os.environ, **settings}
    # Networks first, so the host rules are in place before any worker sends; under the lock, so
    # that two projects coming up at once do not choose the same subnets.
    with engine_lock():
        net = choose_net(project)
        write_project(project, variant, n, net, settings)
        sh(*compose_cmd(project, "up", "--no-start", "--no-build"), env=env, stdout=subprocess.DEVNULL)
    remove_rules(project)
    allow_bridged(project)
    if start:
        sh(*compose_cmd(project, "up", "-d", "--no-build"), env=env, stdout=subprocess.DEVNULL)
    return net


def workers(project: str) -> list[str]:
    """Worker container ids in rank order."""
    out = sh(
        "docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={project}",
        "--format", '{{.ID}} {{.Label "com.docker.compose.service"}}', capture=True,
    ).stdout  # fmt: skip
    found = {}
    for line in out.splitlines():
        cid, _, service = line.partition(" ")
        if service.startswith("worker") and service[6:].isdigit():
            found[int(service[6:])] = cid
    return [found[r] for r in sorted(found)]


def wait(project: str, timeout: float = 900) -> list[int]:
    """Every worker's exit code, in rank order; a worker still running after ``timeout`` is killed."""
    ids = workers(project)
    deadline = time.monotonic() + timeout
    codes = []
    for cid in ids:
        left = max(1.0, deadline - time.monotonic())
        try:
            out = subprocess.run(["docker", "wait", cid], capture_output=True, text=True, timeout=left).stdout
        except subprocess.TimeoutExpired:
            subprocess.run(["docker", "kill", cid], capture_output=True)
            out = subprocess.run(["docker", "wait", cid], capture_output=True, text=True).stdout
        codes.append(int(out.strip() or -1))
    return codes


def logs(project: str) -> str:
    return subprocess.run(compose_cmd(project, "logs", "--no-color"), capture_output=True, text=True).stdout


def down(project: str) -> None:
    """Stops and removes the project's containers, networks and volumes, and the host rules it
    added; also when its files are gone (a crashed run)."""
    if (project_dir(project) / "docker-compose.yml").exists():
        sh(*compose_cmd(project, "down", "-v", "--remove-orphans", "-t", "5"), check=False)
    label = f"label=com.docker.compose.project={project}"
    left = sh("docker", "ps", "-aq", "--filter", label, capture=True).stdout.split()
    if left:
        sh("docker", "rm", "-f", "-v", *left, check=False, capture=True)
    for kind in ("network", "volume"):
        ids = sh("docker", kind, "ls", "-q", "--filter", label, capture=True).stdout.split()
        if ids:
            sh("docker", kind, "rm", *ids, check=False, capture=True)
    remove_rules(project)
    shutil.rmtree(project_dir(project), ignore_errors=True)
    remove_replaced_now()


def run(
    project: str, variant: str, n: int, backend: str | None, timeout: float, train_args: str | None = None
) -> int:
    try:
        up(project, variant, n, backend, train_args)
        codes = wait(project, timeout)
        print(logs(project))
        print(f"exit codes (rank order): {codes}")
        return 0 if codes and all(c == 0 for c in codes) else 1
    finally:
        down(project)


# -- command line ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("base", "images", "up", "run", "compose", "files", "wait", "down", "logs"):
        c = sub.add_parser(name)
        c.add_argument(
            "-p", "--project", default="switchagg", help="compose project name (default %(default)s)"
        )
        if name in ("images", "up", "run", "compose"):
            c.add_argument("--variant", choices=VARIANTS, default="soft")
        if name in ("up", "run", "compose"):
            c.add_argument("-n", type=int, default=4, help="workers (default %(default)s)")
        if name in ("up", "run"):
            c.add_argument(
                "--backend",
                choices=BACKENDS,
                help="what the workers train with (default: $TRAIN_BACKEND, else switchagg)",
            )
            c.add_argument(
                "--train-args",
                help="train_digits.py options (default: $TRAIN_ARGS, else the variant's: TRAIN_ARGS above)",
            )
        if name == "up":
            c.add_argument(
                "--no-start",
                action="store_true",
                help="networks, host rules and containers only: start them with docker-compose yourself",
            )
        if name == "run":
            c.add_argument("--no-build", action="store_true", help="use the images as they are")
        if name in ("images", "run"):
            c.add_argument(
                "--p4-image", help=f"bmv2 image (default: $P4_IMAGE, {LOCAL_P4_IMAGE}, {P4_IMAGE_DEFAULT})"
            )
        if name in ("run", "wait"):
            c.add_argument("--timeout", type=float, default=900, help="seconds the workers get")
    args = p.parse_args(argv)
    if args.cmd == "compose":
        sys.stdout.write(compose_text(args.variant, args.n))
    elif args.cmd == "files":
        for variant in VARIANTS:
            (DOCKER_DIR / f"compose.{variant}.yml").write_text(compose_text(variant, 4))
        (DOCKER_DIR / "topology.yaml").write_text(topology_text(4))
    elif args.cmd == "base":
        build_base()
    elif args.cmd == "images":
        build_images(args.variant, args.p4_image)
    elif args.cmd == "up":
        net = up(args.project, args.variant, args.n, args.backend, args.train_args, start=not args.no_start)
        print(f"{args.project}: {args.variant}, {args.n} workers, Docker networks in 10.{net}.0.0/16")
        if args.no_start:
            print("start it:", " ".join(compose_cmd(args.project, "up")))
        else:
            print(f"next: make docker-logs|docker-down PROJECT={args.project}, or docker/testbed.py wait")
    elif args.cmd == "wait":
        codes = wait(args.project, args.timeout)
        print(f"exit codes (rank order): {codes}")
        return 0 if codes and all(c == 0 for c in codes) else 1
    elif args.cmd == "logs":
        sys.stdout.write(logs(args.project))
    elif args.cmd == "down":
        down(args.project)
    else:
        if not args.no_build:
            build_images(args.variant, args.p4_image)
        return run(args.project, args.variant, args.n, args.backend, args.timeout, args.train_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
