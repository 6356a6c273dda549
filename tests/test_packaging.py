"""A non-editable install works outside the source tree: the wheel built from the repository's
files carries the P4 artifacts (package data; controller/switchagg_controller/p4/ links to
p4/build, the one copy) and, installed into a fresh virtual environment, loads them through the
controller's P4 path and runs switchagg-demo from a directory outside the repository.

Slow-ish (a wheel build compiles the C extension: 10-30 s on 2 shared cores), kept in the
default run. Builds without isolation: setuptools>=74.1 (the test extra) and numpy as installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
from pathlib import Path

import pytest

from switchagg_controller import p4_program

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ("switchagg.json", "switchagg.p4info.txtpb")

pytestmark = pytest.mark.timeout(600)


def test_the_packaged_artifacts_are_p4_build() -> None:
    """One copy: the package's p4/ holds links to what p4c writes in p4/build."""
    packaged = ROOT / "controller" / "switchagg_controller" / "p4"
    for name in ARTIFACTS:
        assert (packaged / name).is_symlink(), f"{packaged / name} must link to p4/build/{name}"
        assert (packaged / name).resolve() == (ROOT / "p4" / "build" / name).resolve()
    assert p4_program.BMV2_JSON.name == ARTIFACTS[0] and p4_program.P4INFO.name == ARTIFACTS[1]
    assert p4_program.BMV2_JSON.read_bytes() == (ROOT / "p4" / "build" / ARTIFACTS[0]).read_bytes()
    assert p4_program.P4INFO.read_bytes() == (ROOT / "p4" / "build" / ARTIFACTS[1]).read_bytes()


def _source_tree(dest: Path) -> None:
    """The repository's files as git sees them (tracked and new, not ignored), links as links."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "-c", "-o", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        src = ROOT / os.fsdecode(name)
        if src.is_symlink() or src.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target, follow_symlinks=False)


BUILD_SDIST = "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))"

CHECK = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import switchagg, switchagg_controller
    from switchagg_controller import cli, p4_program, p4rt
    venv, repo = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    for module in (switchagg, switchagg_controller, p4_program):
        where = Path(module.__file__).resolve()
        assert where.is_relative_to(venv) and not where.is_relative_to(repo), where
    json_path, p4info = cli._p4_artifacts(cli.build_parser().parse_args(["push", "--topology", "t.yaml"]))
    for path in (json_path, p4info):
        assert not path.is_symlink() and path.resolve().is_relative_to(venv), path
    schema = p4rt.load_schema(p4info)
    print(json.dumps({
        "json": str(json_path), "p4info": str(p4info), "version": switchagg.__version__,
        "pipelines": [p["name"] for p in json.loads(json_path.read_text())["pipelines"]],
        "tables": sorted(t.name for t in schema.tables),
    }))
    """
)


def _skip_unless_buildable() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("builds the wheel from the repository's files: needs git and a checkout")
    setuptools = pytest.importorskip("setuptools", reason="the wheel is built with setuptools")
    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (74, 1):
        pytest.skip(f"setuptools {setuptools.__version__} < 74.1 (ext-modules in pyproject.toml)")
    pytest.importorskip(
        "finsy", reason="the controller's P4 path needs its extra (pip install .[controller])"
    )


def _build_wheel(src: Path, wheels: Path, elsewhere: Path) -> Path:
    """The wheel of ``src``; it carries the P4 artifacts and no C sources."""
    # --no-build-isolation: setuptools and numpy as installed here (no index needed)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
         "--disable-pip-version-check", "-w", str(wheels)],
        capture_output=True, text=True, timeout=600, cwd=elsewhere,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("switchagg-*.whl")
    names = subprocess.run(
        [sys.executable, "-m", "zipfile", "-l", str(wheel)], capture_output=True, text=True, check=True
    ).stdout
    for name in ARTIFACTS:
        assert f"switchagg_controller/p4/{name}" in names
    # The C extension's sources are no package; the torch backend's C++ source is package data, since
    # it is compiled where it is used (switchagg/torch/native.py).
    assert not [n for n in names.split() if n.endswith((".c", ".h"))]
    assert "switchagg/torch/csrc/c10d_backend.cpp" in names
    return wheel


def _check_sdist(src: Path, out: Path) -> None:
    """The sdist carries what a wheel built from it needs: the headers, the artifacts as files."""
    sdist = subprocess.run(
        [sys.executable, "-c", BUILD_SDIST, str(out)], capture_output=True, text=True, timeout=300, cwd=src
    )
    assert sdist.returncode == 0, sdist.stderr
    with tarfile.open(out / sdist.stdout.split()[-1]) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
    headers = {str(p.relative_to(ROOT)) for p in (ROOT / "host/csrc").rglob("*.h")}
    assert headers and headers <= set(members)
    for name in ARTIFACTS:
        assert members[f"controller/switchagg_controller/p4/{name}"].isfile()


def _venv_with(wheel: Path, venv: Path) -> tuple[Path, dict[str, str]]:
    """A fresh venv with ``wheel`` installed: its python and the environment to run it in. The
    deps (numpy, grpcio, finsy) come from this interpreter's site-packages, after the venv's own
    (a .pth line; --system-site-packages would skip a venv running this test)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (site,) = venv.glob("lib/python3*/site-packages")
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "deps-of-the-test.pth").write_text("".join(f"{p}\n" for p in sorted(here)))
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--disable-pip-version-check",
         str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return python, env


def test_a_wheel_installed_outside_the_tree_finds_its_p4_program(tmp_path: Path) -> None:
    _skip_unless_buildable()
    src, wheels, venv, elsewhere = (tmp_path / d for d in ("src", "wheels", "venv", "elsewhere"))
    _source_tree(src)
    elsewhere.mkdir()
    wheel = _build_wheel(src, wheels, elsewhere)
    _check_sdist(src, tmp_path / "sdist")
    python, env = _venv_with(wheel, venv)

    check = subprocess.run(
        [str(python), "-c", CHECK, str(venv), str(ROOT)],
        capture_output=True, text=True, timeout=120, cwd=elsewhere, env=env,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    report = json.loads(check.stdout)
    assert report["pipelines"] == ["ingress", "egress"]
    tables = {p4_program.L2_TABLE, p4_program.JOB_TABLE, p4_program.WORKER_TABLE, p4_program.RESULT_TABLE}
    assert tables <= set(report["tables"]), report["tables"]
    assert Path(report["json"]).read_bytes() == (ROOT / "p4" / "build" / ARTIFACTS[0]).read_bytes()

    demo = subprocess.run(
        [str(venv / "bin" / "switchagg-demo"), "--workers", "2", "--size", "100000"],
        capture_output=True, text=True, timeout=300, cwd=elsewhere, env=env,
    )  # fmt: skip
    assert demo.returncode == 0 and "demo passed" in demo.stdout, demo.stdout + demo.stderr
    version = subprocess.run(
        [str(venv / "bin" / "switchagg-ctl"), "--version"],
        capture_output=True,
        text=True,
        env=env,
        cwd=elsewhere,
    )
    assert version.stdout.strip() == f"switchagg-ctl {report['version']}", version.stderr
