"""What every console script shares (host/switchagg/cli_util.py): --version from the package
metadata; switchagg-ctl's defaults from the workers' variables (a real controller on a Unix
socket)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from controller_support import SECRET, Controller, free_port

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


# -- switchagg-ctl: $SWITCHAGG_JOB_SERVICE, $SWITCHAGG_SECRET, $SWITCHAGG_SECRET_FILE -------------


@pytest.fixture(scope="module")
def unix_controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controller]:
    pytest.importorskip("grpc", reason="the controller needs its extra (pip install .[controller])")
    tmp = tmp_path_factory.mktemp("ctl")
    udp = f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}"
    ctl = Controller(tmp, ["--software", "--software-listen", udp]).start(listen=f"unix:{tmp}/jobs.sock")
    yield ctl
    ctl.stop()


def _ctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHAGG_")}
    return subprocess.run(
        [sys.executable, "-m", "switchagg_controller.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )


def test_ctl_takes_service_and_secret_from_the_workers_variables(unix_controller: Controller) -> None:
    service, secret_file = unix_controller.address, str(unix_controller.secret_file)
    assert service.startswith("unix:")
    for env in (
        {"SWITCHAGG_JOB_SERVICE": service, "SWITCHAGG_SECRET_FILE": secret_file},
        {"SWITCHAGG_JOB_SERVICE": service, "SWITCHAGG_SECRET": SECRET},
        # the workers' order: SWITCHAGG_SECRET before SWITCHAGG_SECRET_FILE
        {
            "SWITCHAGG_JOB_SERVICE": service,
            "SWITCHAGG_SECRET": SECRET,
            "SWITCHAGG_SECRET_FILE": "/nonexistent",
        },
    ):
        r = _ctl("jobs", "--json", env=env)
        assert r.returncode == 0 and json.loads(r.stdout) == {"jobs": []}, (env, r.stderr)
        r = _ctl("counters", env=env)
        assert r.returncode == 0 and "[software]" in r.stdout, (env, r.stderr)


def test_ctl_flags_win_over_the_variables(unix_controller: Controller) -> None:
    service, secret_file = unix_controller.address, str(unix_controller.secret_file)
    wrong = {"SWITCHAGG_JOB_SERVICE": "127.0.0.1:1", "SWITCHAGG_SECRET": "wrong"}
    r = _ctl("jobs", "--service", service, "--secret-file", secret_file, env=wrong)
    assert r.returncode == 0 and r.stdout.strip() == "no jobs", r.stderr
    r = _ctl("jobs", "--secret", "wrong", env={"SWITCHAGG_JOB_SERVICE": service, "SWITCHAGG_SECRET": SECRET})
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr, r.stderr


def test_ctl_says_which_secret_is_missing(tmp_path: Path) -> None:
    r = _ctl("jobs", env={"SWITCHAGG_JOB_SERVICE": "127.0.0.1:1"})
    assert r.returncode == 1
    assert "--secret-file or --secret, or $SWITCHAGG_SECRET_FILE or $SWITCHAGG_SECRET" in r.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    r = _ctl("jobs", env={"SWITCHAGG_SECRET_FILE": str(empty)})
    assert r.returncode == 1 and f"SWITCHAGG_SECRET_FILE={empty} is empty" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
