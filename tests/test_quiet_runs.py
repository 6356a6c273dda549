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
