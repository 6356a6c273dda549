"""What every console script shares (host/switchagg/cli_util.py): --version from the package
metadata."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import switchagg

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = (ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
# [project.scripts]: name = "module:function"
SCRIPTS = dict(re.findall(r'^(switchagg-[a-z-]+) = "([\w.:]+)"$', PYPROJECT, re.M))


def _run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs the console script ``name`` as its entry point, with this interpreter."""
    module, func = SCRIPTS[name].split(":")
    code = f"import sys; from {module} import {func} as main; sys.argv[0] = {name!r}; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)


def test_version_is_the_package_metadata() -> None:
    declared = re.search(r'^version = "([^"]+)"$', PYPROJECT, re.M)
    assert declared is not None
    assert switchagg.__version__ == metadata.version("switchagg") == declared.group(1)


def test_every_console_script_is_installed() -> None:
    scripts = metadata.entry_points(group="console_scripts")
    installed = {e.name for e in scripts if e.dist is not None and e.dist.name == "switchagg"}
    assert len(SCRIPTS) >= 4 and installed == set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_version_flag(name: str) -> None:
    r = _run_script(name, "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{name} {switchagg.__version__}"
    assert r.stderr == ""
