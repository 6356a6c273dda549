"""Finding the tools a testbed needs (iproute2, tc, nftables, ethtool, bmv2) and saying what is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

EXTRA_BIN_DIRS = (Path("/opt/p4/bin"), Path("/usr/local/bin"))
# Each system tool and its Debian package.
PACKAGES = {"ip": "iproute2", "tc": "iproute2", "nft": "nftables", "ethtool": "ethtool"}
# What the bmv2 suite needs: namespaces, loss injection, checksum offload off.
BMV2_SYSTEM_TOOLS = ("ip", "nft", "ethtool")


def find_tool(name: str) -> str | None:
    """``$NAME`` (e.g. P4C, SIMPLE_SWITCH_GRPC), then PATH, then /opt/p4/bin."""
    env = os.environ.get(name.upper())
    if env:
        return env if Path(env).is_file() else None
    found = shutil.which(name)
    if found:
        return found
    for d in EXTRA_BIN_DIRS:
        if (d / name).is_file():
            return str(d / name)
    return None


def missing_for(tools: Iterable[str], what: str = "the testbed") -> str | None:
    """Why ``what`` cannot run here (not root, or these system tools absent), or None."""
    if os.geteuid() != 0:
        return f"{what} needs root (network namespaces and veth pairs)"
    missing = [f"`{t}` (apt install {PACKAGES[t]})" for t in tools if shutil.which(t) is None]
    if missing:
        return f"{what} needs {' and '.join(missing)} on PATH"
    return None


def missing_bmv2() -> str | None:
    """Why simple_switch_grpc and its CLI cannot run here, or None."""
    for tool in ("simple_switch_grpc", "simple_switch_CLI"):
        if find_tool(tool) is None:
            return f"bmv2 tests need {tool} (bmv2 with PI/gRPC) on PATH or in /opt/p4/bin"
    # simple_switch_CLI (register reads) runs on `python3` and needs the thrift module there.
    python3 = shutil.which("python3", path=tool_env().get("PATH"))
    if (
        python3 is None
        or subprocess.run([python3, "-c", "import thrift"], capture_output=True, env=tool_env()).returncode
    ):
        return "simple_switch_CLI needs the Python `thrift` module for python3 (pip install thrift)"
    return None


def missing_for_switch() -> str | None:
    """Why the bmv2 tests cannot run here, or None when they can."""
    return missing_for(BMV2_SYSTEM_TOOLS, "bmv2 tests") or missing_bmv2()


def tool_env() -> dict[str, str]:
    """The environment for toolchain processes: /opt/p4's libraries and Python modules if it exists."""
    env = dict(os.environ)
    lib = Path("/opt/p4/lib")
    if lib.is_dir():
        env["LD_LIBRARY_PATH"] = f"{lib}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else str(lib)
        # simple_switch_CLI is a Python script importing bmv2's thrift bindings from there.
        pys = sorted(lib.glob("python3*/site-packages")) + sorted(lib.glob("python3*/dist-packages"))
        if pys:
            extra = ":".join(str(p) for p in pys)
            env["PYTHONPATH"] = f"{extra}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else extra
    return env
