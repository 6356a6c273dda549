"""The README's quick start on a stock Debian 12 (issue 27): a plain debootstrap Debian 12
container (the docker testbed's base image), the packages of the README's one `apt-get install`
line and nothing else, a copy of the repository (git's files), then both quick-start commands:
`make demo` passes, and `make test` installs the test dependencies and passes its first tests
(PYTEST_ARGS: a short selection, for CI's time).

pip inside sees what pip outside sees: this machine's pip settings (`pip config list` and PIP_*:
index URLs, find-links, constraints, CA bundle), with the local folders and files they name
mounted read-only (under /host). That is how the CPU torch wheel arrives here and on CI
(find-links); on a machine without one, `make test` takes torch from wherever pip's settings
point (README: TORCH_INDEX for the CPU build). The container reaches the Debian mirror and the
package index through the host's network. Skips, with the reason, without a Docker engine that
runs containers or the means to make the base image."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from switchagg_lab.testing.docker_testbed import REPO, engine_cannot_run_containers, load_testbed

# What `make test` runs here: quick tests of the C extension (gcc, with the sanitizers), the
# quantizer, and the torch backend's setup (torch imported, the entry point).
FIRST_TESTS = (
    "tests/test_c_engines.py tests/test_quantize.py tests/test_torch_setup.py -x -q -p no:cacheprovider"
)


def readme_packages() -> list[str]:
    """The packages of the README quick start's `apt-get install` line (there is one)."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if re.match(r"^(sudo )?apt-get install ", line)]
    assert len(lines) == 1, lines
    return [word for word in lines[0].split("install", 1)[1].split() if not word.startswith("-")]


# A step that failed because the container cannot reach the Debian mirror or the package index
# says so in one of these: that is this machine's network, not the quick start (skip, saying so).
OFFLINE = re.compile(
    r"Temporary failure resolving|Could not resolve|Failed to establish a new connection|"
    r"Network is unreachable|Temporary failure in name resolution"
)

HOST = "/host"  # where the local paths of the host's pip settings appear in the container


def host_pip_settings() -> tuple[dict[str, str], list[str]]:
    """PIP_* variables with this machine's pip settings, and the local paths they name (mounted
    under HOST, read-only: not at their own paths, which may be the container's own files, such
    as the CA bundle that Debian's ca-certificates writes)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            settings[key.rsplit(".", 1)[-1]] = value.strip().strip("'\"")
    for var, value in os.environ.items():
        if var.startswith("PIP_"):
            settings[var[4:].lower().replace("_", "-")] = value
    env: dict[str, str] = {}
    paths: set[str] = set()
    for key, value in settings.items():
        words = []
        for word in value.split():
            scheme = "file://" if word.startswith("file://") else ""
            path = word.removeprefix(scheme)
            if path.startswith("/") and os.path.exists(path):
                # an index's pages may link to files beside it (../../files/x.whl): its parent too
                paths.add(os.path.dirname(path.rstrip("/")) if key.endswith("index-url") else path)
                word = f"{scheme}{HOST}{path}"
            words.append(word)
        env["PIP_" + key.upper().replace("-", "_")] = " ".join(words)
    return env, sorted(paths)


# apt-get and pip downloads, the C extension twice (demo, test), torch and the test dependencies.
@pytest.mark.timeout(1800)
def test_the_quick_start_on_a_stock_debian_12(tmp_path: Path) -> None:
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        pytest.skip(f"no Docker engine answers: {info.stderr.strip()[:200]}")
    problem = engine_cannot_run_containers()
    if problem:
        pytest.skip(problem)
    tb = load_testbed()
    packages = readme_packages()
    env, paths = host_pip_settings()
    name = f"switchagg-quickstart-{os.getpid()}"
    argv = ["docker", "run", "-d", "--name", name, "--network", "host", "--label", tb.IMAGE_LABEL]
    for path in paths:
        argv += ["-v", f"{path}:{HOST}{path}:ro"]
    for var, value in env.items():
        argv += ["-e", f"{var}={value}"]
    subprocess.run([*argv, tb.BASE_IMAGE, "sleep", "infinity"], check=True, capture_output=True)
    log = tmp_path / "quickstart.log"
    try:
        # The repository as a clone has it (git's files; the working tree's versions).
        files = "\0".join(tb.source_files()).encode()
        subprocess.run(["docker", "exec", name, "mkdir", "/switchagg"], check=True)
        tar = subprocess.Popen(
            ["tar", "-C", str(REPO), "-c", "--null", "-T", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        untar = subprocess.Popen(
            ["docker", "exec", "-i", name, "tar", "-C", "/switchagg", "-x"], stdin=tar.stdout
        )
        assert tar.stdout is not None and tar.stdin is not None
        tar.stdout.close()
        tar.stdin.write(files)
        tar.stdin.close()
        assert tar.wait() == 0 and untar.wait() == 0
        apt = f"apt-get update -q && apt-get install -y -q {' '.join(packages)}"
        steps = [
            ("apt-get install (the README's line)", apt),
            ("make demo", "make demo"),
            ("make test", f'make test PYTEST_ARGS="{FIRST_TESTS}"'),
        ]
        execute = ["docker", "exec", "-w", "/switchagg", "-e", "DEBIAN_FRONTEND=noninteractive", name]
        with open(log, "w") as out:
            for title, command in steps:
                started = time.monotonic()
                done = subprocess.run(
                    [*execute, "sh", "-c", command], stdout=out, stderr=subprocess.STDOUT, timeout=1500
                )
                print(f"{title}: {time.monotonic() - started:.0f} s, exit {done.returncode}")
                out.flush()
                if done.returncode != 0 and OFFLINE.search(log.read_text()):
                    pytest.skip(f"{title}: the package registries are out of reach here ({OFFLINE.pattern})")
                assert done.returncode == 0, f"{title} failed:\n{log.read_text()[-8000:]}"
        text = log.read_text()
        # The demo checked its sum; pytest ran the tests and all passed.
        assert re.search(r"\d+ passed", text) and not re.search(r"\d+ (failed|error)", text), text[-8000:]
        version = "import torch; print(torch.__version__)"
        torch = subprocess.run(
            [*execute, ".venv/bin/python", "-c", version], capture_output=True, text=True
        ).stdout.strip()
        print(f"torch in the container: {torch}")
    finally:
        subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True)
