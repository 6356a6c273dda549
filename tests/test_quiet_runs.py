"""A first run says only what matters: what torch, c10d and the testbed used to print on every rank
that meant nothing (issue 35). Real processes: torch imported in a fresh interpreter, ranks in the
emulated rack's namespaces (root and iproute2; skipped, saying why, elsewhere)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from switchagg_lab.testbed import netns, tools
from switchagg_lab.testbed.rack import Testbed
from switchagg_lab.testing.kit import free_port

REPO = Path(__file__).resolve().parents[1]


def test_the_backend_loads_without_importing_the_extension_builder() -> None:
    """torch.utils.cpp_extension warns "No CUDA runtime is found" on import (a CUDA build of torch, no
    GPU): a built backend must load without it, from the directory the builder would use."""
    code = (
        "import sys, torch, switchagg.torch\n"
        "from switchagg.torch import native\n"
        "native.load()\n"
        "print('imported' if 'torch.utils.cpp_extension' in sys.modules else 'not imported')\n"
        "from torch.utils import cpp_extension\n"
        "import os, pathlib\n"
        "root = os.environ.get('TORCH_EXTENSIONS_DIR') or cpp_extension.get_default_build_root()\n"
        "print(native.build_directory().parent == pathlib.Path(root))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["not", "imported", "True"], p.stdout


RANK = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print(t.tolist())
dist.destroy_process_group()
"""
RACK_REASON = tools.missing_for(["ip", "tc"], "ranks in the emulated rack")


@pytest.mark.skipif(RACK_REASON is not None, reason=RACK_REASON or "")
def test_ranks_in_the_testbed_name_their_peers(tmp_path: Path) -> None:
    """c10d names each store client by its IPv4-mapped address; the namespaces' /etc/hosts answers
    that, so no rank warns "The hostname of the client socket cannot be retrieved"."""
    n = 3
    with Testbed(n, tmp_path / "bed", data_plane="soft") as bed:
        ns = bed.endpoints[1].ns
        mapped = f"::ffff:{bed.endpoints[0].ip}"
        name = netns.sh(
            sys.executable,
            "-c",
            f"import socket; print(socket.getnameinfo(('{mapped}', 1, 0, 0), 0)[0])",
            ns=ns,
        )
        assert name.strip() == "h0"
        env = os.environ | {
            "MASTER_ADDR": bed.endpoints[0].ip,
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(n),
        }
        procs = [
            bed.endpoints[r].popen(
                [sys.executable, "-c", RANK],
                env=env | {"RANK": str(r), "GLOO_SOCKET_IFNAME": bed.endpoints[r].ifname},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for r in range(n)
        ]
        outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}: {err}"
        assert out.strip() == str([float(n * (n + 1) // 2)] * 4), out
        assert "hostname of the client socket" not in err, f"rank {r}: {err}"


FAKE_DOCKER = """#!/bin/sh
# docker as the CLI 23+ answers without the buildx component (FAKE_BUILDX: with it)
case "$1" in
buildx) [ -n "${FAKE_BUILDX:-}" ] || { echo "docker: unknown command: docker buildx" >&2; exit 1; } ;;
build)
  echo "builder: DOCKER_BUILDKIT=${DOCKER_BUILDKIT-unset}" >&2
  if [ "${DOCKER_BUILDKIT-}" != 1 ]; then
    printf 'DEPRECATED: The legacy builder is deprecated and will be removed in a future release.\\n'\
'            Install the buildx component to build images with BuildKit:\\n'\
'            https://docs.docker.com/go/buildx/\\n\\n' >&2
  fi
  echo "Step 1/1 : FROM scratch" >&2
  echo sha256:0123
  exit "${FAKE_RC:-0}"
  ;;
esac
"""


@pytest.mark.parametrize("buildx", [False, True])
def test_image_builds_use_buildkit_where_the_engine_has_it(
    buildx: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docker/testbed.py's builds against a docker CLI on PATH: BuildKit with buildx; without it the
    legacy builder, its deprecation notice left out and everything else the build said kept."""
    from switchagg_lab.testing.docker_testbed import load_testbed

    docker = tmp_path / "bin" / "docker"
    docker.parent.mkdir()
    docker.write_text(FAKE_DOCKER)
    docker.chmod(0o755)
    monkeypatch.setenv("PATH", f"{docker.parent}:{os.environ['PATH']}")
    monkeypatch.delenv("DOCKER_BUILDKIT", raising=False)
    if buildx:
        monkeypatch.setenv("FAKE_BUILDX", "1")
    tb = load_testbed()
    tb._build(tmp_path / "Dockerfile", tmp_path, "switchagg-test:dev")
    err = capsys.readouterr().err
    assert f"builder: DOCKER_BUILDKIT={'1' if buildx else 'unset'}" in err, err
    assert "Step 1/1 : FROM scratch" in err
    assert "legacy builder" not in err and "buildx component" not in err, err
    monkeypatch.setenv("FAKE_RC", "1")  # a failed build says everything
    with pytest.raises(subprocess.CalledProcessError):
        tb._build(tmp_path / "Dockerfile", tmp_path, "switchagg-test:dev")
    assert "Step 1/1" in capsys.readouterr().err


UNSHARE_REASON = tools.missing_for(["unshare", "mount"], "the rack-entry hosts test")


@pytest.mark.skipif(UNSHARE_REASON is not None or os.geteuid() != 0, reason=UNSHARE_REASON or "needs root")
def test_rack_entry_names_the_rack_for_c10d(tmp_path: Path) -> None:
    """docker/rack-entry.sh gives a worker container the rack's names, v4-mapped forms included: run
    in a mount namespace of its own, over a copy of /etc/hosts, then resolved by glibc as c10d does."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    lookup = (
        "import socket; print(socket.getnameinfo(('::ffff:10.201.0.3', 1, 0, 0), socket.NI_NUMERICSERV)[0], "
        "socket.getnameinfo(('10.201.0.254', 1), 0)[0], socket.gethostbyname('localhost'))"
    )
    script = (
        f"mount --bind {hosts} /etc/hosts && RACK_HOSTS_FILE=/etc/hosts "
        f'sh {REPO / "docker" / "rack-entry.sh"} hosts 4 {sys.executable} -c "{lookup}"'
    )
    p = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["rack-port3", "rack-aggregator", "127.0.0.1"], p.stdout
    assert "::ffff:10.201.0.4 rack-port4" in hosts.read_text()
