"""The C++ half of the "switchagg" c10d backend (csrc/c10d_backend.cpp), compiled by torch's own
C++-extension builder (torch.utils.cpp_extension.load, with ninja) against the torch that is
installed, the first time a process needs it, and cached: later processes only load the library.

Built at first use rather than at ``pip install``: a torch C++ extension is tied to the exact torch it
was compiled against (its C++ ABI), and the install must work whatever torch the environment holds
and keep working when it changes; the cache is per torch version. ``python -m switchagg.torch``
builds it ahead (a Docker image, a cluster's shared home) and prints where it is. The cache lies
under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``); ranks that start together
build it once (torch's file lock), the others wait for it. A build lies in a directory named
after the torch version and the source's hash.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("csrc") / "c10d_backend.cpp"
NEEDS = "g++ and Python's headers (Debian: apt-get install g++ python3-dev) and the ninja package"

_module: ModuleType | None = None
_lock = threading.Lock()


class NativeBuildError(RuntimeError):
    """The C++ backend could not be compiled here."""


def module_name() -> str:
    """One build per torch version (a library built for another torch would not load: C++ ABI) and
    per source (a newer switchagg builds beside, not over, a library that running jobs have loaded)."""
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    version = re.sub(r"\W", "_", torch.__version__)
    return f"switchagg_c10d_{version}_{source}"


def load() -> ModuleType:
    """The compiled backend module, built first if this torch has none in the cache."""
    global _module
    with _lock:
        if _module is None:
            _module = _build()
        return _module


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    verbose = os.environ.get("SWITCHAGG_DEBUG", "").strip().upper() == "DEBUG"
    try:
        return cpp_extension.load(module_name(), [str(SOURCE)], extra_cflags=["-O2"], verbose=verbose)
    except (RuntimeError, OSError, ImportError) as e:
        raise NativeBuildError(
            f"switchagg's c10d backend ({SOURCE.name}) is compiled with torch's C++ extension builder the "
            f"first time it is used, which needs {NEEDS}; the build failed: {e}"
        ) from e


def _put_ninja_on_path() -> None:
    """torch looks for ``ninja`` on PATH; the ninja package puts it beside the interpreter, which a
    script run as ``.venv/bin/python x.py`` (no activated environment) does not have on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja

        where = str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        where = str(Path(sys.executable).parent)
    os.environ["PATH"] = where + os.pathsep + os.environ.get("PATH", "")


def main() -> int:
    """``python -m switchagg.torch``: build (or find) the library and say where it is."""
    module = load()
    print(f"{module_name()}: {module.__file__}")
    return 0
