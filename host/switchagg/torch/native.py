"""The C++ half of the "switchagg" c10d backend (csrc/c10d_backend.cpp), compiled by torch's own
C++-extension builder (torch.utils.cpp_extension.load, with ninja) against the installed torch the
first time a process needs it, and cached: later processes import the finished library directly
(no compiler, no ninja, no Python headers needed then).

Built at first use rather than at ``pip install``: a torch C++ extension is tied to the exact torch it
was compiled against (its C++ ABI), and the install must work whatever torch the environment holds
and keep working when it changes. ``python -m switchagg.torch`` builds it ahead (a Docker image, a
cluster's shared home) and prints where it is. The cache lies under ``$TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), one directory per Python, torch version and source hash;
ranks that start together build it once (torch's file lock), the others wait for it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
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
    """One build per Python and torch version (a library built for another torch would not load:
    C++ ABI) and per source (a newer switchagg builds beside, not over, a library that running jobs
    have loaded)."""
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    version = re.sub(r"\W", "_", torch.__version__)
    return f"switchagg_c10d_py{sys.version_info.major}{sys.version_info.minor}_{version}_{source}"


def build_directory() -> Path:
    # cpp_extension.get_default_build_root(), without importing cpp_extension: its import looks for
    # CUDA and, with a CUDA build of torch on a machine without a GPU, warns "No CUDA runtime is
    # found" in every rank. Only a build (once) imports it.
    from torch import _appdirs  # what get_default_build_root() asks

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.realpath(
        _appdirs.user_cache_dir(appname="torch_extensions")
    )
    return Path(root) / module_name()


def _cpp_extension() -> ModuleType:
    """torch.utils.cpp_extension, imported without its CUDA notice: the backend is CPU-only."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension


def load() -> ModuleType:
    """The compiled backend module, built first if this torch has none in the cache."""
    global _module
    with _lock:
        if _module is None:
            _module = _import_built() or _build()
        return _module


def _import_built() -> ModuleType | None:
    """The library a finished build left, imported as it is; None if there is none yet (or a build
    is under way: torch's lock file is there until it ends)."""
    where = build_directory()
    library = where / f"{module_name()}.so"
    if not library.is_file() or (where / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(module_name(), library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build() -> ModuleType:
    cpp_extension = _cpp_extension()
    _put_ninja_on_path()
    where = build_directory()
    where.mkdir(parents=True, exist_ok=True)
    verbose = os.environ.get("SWITCHAGG_DEBUG", "").strip().upper() == "DEBUG"
    try:
        return cpp_extension.load(
            module_name(), [str(SOURCE)], extra_cflags=["-O2"], build_directory=str(where), verbose=verbose
        )
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
