"""The C engines alone (host/csrc/tests/test_engines.c): the aggregator engine, the worker engine
and quant through their plain C interfaces, no Python in between. Compiled here with the system
gcc from the engines' sources, then run: real UDP sockets on 127.0.0.1, an aggregator with two
serving threads, three workers, exact int32 sums, float32 within the bound, drop counters by
reason, the interfaces' error codes. Once as the extension builds it (-O3, warnings are errors),
once under AddressSanitizer and UndefinedBehaviorSanitizer where the toolchain has them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "host/csrc"
ENGINES = ("aggregator", "gaps", "worker", "quant", "sockets")
SOURCES = [CSRC / "tests/test_engines.c", *(CSRC / f"{name}.c" for name in ENGINES)]
FLAGS = ["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", "-fno-strict-aliasing"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover"]
BUILDS = {
    "O3": ["-O3", "-fno-math-errno"],
    "sanitized": ["-O1", "-g", "-fno-omit-frame-pointer", *SANITIZE],
}
GCC = shutil.which("gcc")


@pytest.mark.skipif(GCC is None, reason="no gcc on PATH (apt-get install gcc libc6-dev)")
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_c_engines(build: str, tmp_path: Path) -> None:
    assert GCC is not None
    exe = tmp_path / "test_engines"
    cmd = [GCC, *FLAGS, *BUILDS[build], f"-I{CSRC}", *map(str, SOURCES), "-lpthread", "-lm", "-o", str(exe)]
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if build == "sanitized" and built.returncode != 0 and "asan" in built.stderr.lower():
        pytest.skip(f"no sanitizer runtime: {built.stderr.strip()[-300:]}")
    assert built.returncode == 0, built.stderr
    assert built.stderr == "", built.stderr  # no warning either
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    checks = int(run.stdout.split(" checks")[0])
    assert checks >= 50 and run.stdout.strip().endswith(", 0 failed"), run.stdout
