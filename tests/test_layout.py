"""The house's layout, checked statically (ast, no imports): the three top-level packages import
only downward (switchagg <- switchagg_controller <- switchagg_lab), nothing imports tests or
benchmarks, no test or benchmark imports a test module or edits sys.path, no two modules of the
packages share a file name, and no function reaches 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # package -> where it lives, what it may import of ours
    "switchagg": (ROOT / "host/switchagg", set()),
    "switchagg_controller": (ROOT / "controller/switchagg_controller", {"switchagg"}),
    "switchagg_lab": (ROOT / "lab/switchagg_lab", {"switchagg", "switchagg_controller"}),
}
OURS = {*PACKAGES, "tests", "bmv2_tests", "bench"}
USERS = ["tests", "bmv2_tests", "bench", "examples", "tools", "docker"]
MAX_FUNCTION_LINES = 80
SKIP_PARTS = {"_proto", "build", ".venv", "__pycache__"}


def _sources(where: Path) -> list[Path]:
    return sorted(p for p in where.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(ROOT).parts))


def _imports(path: Path) -> set[str]:
    """Every module name an import statement in ``path`` names (also inside functions)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_packages_import_only_downward(package: str) -> None:
    where, allowed = PACKAGES[package]
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _sources(where)
        for name in sorted(_imports(path))
        if (top := name.split(".")[0]) in OURS and top != package and top not in allowed
    ]
    assert not bad, "\n".join(bad)


def test_no_test_module_is_imported_and_no_sys_path_edit() -> None:
    bad = []
    for path in (p for d in USERS for p in _sources(ROOT / d)):
        for name in _imports(path):
            if name.split(".")[-1].startswith("test_") or name.split(".")[0] in {"conftest", "bench"}:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path":
                if isinstance(node.value, ast.Name) and node.value.id == "sys":
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} touches sys.path")
    assert not bad, "\n".join(bad)


def test_module_names_are_unique_across_the_packages() -> None:
    """One name, one meaning: no two modules of the three packages share a file name."""
    seen: dict[str, list[str]] = {}
    for where, _ in PACKAGES.values():
        for path in _sources(where):
            if path.name != "__init__.py":
                seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {n: ps for n, ps in seen.items() if len(ps) > 1}


def test_every_function_is_shorter_than_80_lines() -> None:
    dirs = [where for where, _ in PACKAGES.values()] + [ROOT / d for d in USERS]
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in (p for d in dirs for p in _sources(d))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 >= MAX_FUNCTION_LINES
    ]
    assert not long, "\n".join(long)
