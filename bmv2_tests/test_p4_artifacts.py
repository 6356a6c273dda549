"""The committed p4/build artifacts are what p4c makes of p4/switchagg.p4 today."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from switchagg_controller import p4_program
from switchagg_lab.testbed.tools import find_tool

ROOT = Path(__file__).resolve().parents[1]


def _without_source_info(node: Any) -> Any:
    """The JSON minus what depends on where it was compiled (source file names and positions)."""
    if isinstance(node, dict):
        return {k: _without_source_info(v) for k, v in node.items() if k not in ("source_info", "program")}
    if isinstance(node, list):
        return [_without_source_info(v) for v in node]
    return node


@pytest.fixture(scope="module")
def fresh_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p4c = find_tool("p4c")
    if p4c is None:
        pytest.skip("p4c is not installed (PATH or /opt/p4/bin): cannot check p4/build against the source")
    out = tmp_path_factory.mktemp("p4build")
    from switchagg_lab.testbed.tools import tool_env

    proc = subprocess.run(
        [
            p4c,
            "--target",
            "bmv2",
            "--arch",
            "v1model",
            "--p4runtime-files",
            str(out / "switchagg.p4info.txtpb"),
            "-o",
            str(out),
            "switchagg.p4",
        ],
        cwd=ROOT / "p4",
        capture_output=True,
        text=True,
        timeout=600,
        env=tool_env(),
    )
    assert proc.returncode == 0, f"p4c failed:\n{proc.stderr}"
    return out


def test_committed_artifacts_exist() -> None:
    assert p4_program.BMV2_JSON.is_file(), "run `make -C p4` and commit p4/build/switchagg.json"
    assert p4_program.P4INFO.is_file(), "run `make -C p4` and commit p4/build/switchagg.p4info.txtpb"


def test_bmv2_json_matches_source(fresh_build: Path) -> None:
    fresh = json.loads((fresh_build / "switchagg.json").read_text())
    committed = json.loads(p4_program.BMV2_JSON.read_text())
    assert _without_source_info(committed) == _without_source_info(fresh), (
        "p4/build/switchagg.json is stale: run `make -C p4` and commit it"
    )


def test_p4info_matches_source(fresh_build: Path) -> None:
    fresh = (fresh_build / "switchagg.p4info.txtpb").read_text()
    assert p4_program.P4INFO.read_text() == fresh, (
        "p4/build/switchagg.p4info.txtpb is stale: run `make -C p4`"
    )


def test_p4info_has_every_name_the_controller_uses() -> None:
    text = p4_program.P4INFO.read_text()
    names = [
        p4_program.L2_TABLE,
        p4_program.AGGREGATOR_TABLE,
        p4_program.JOB_TABLE,
        p4_program.WORKER_TABLE,
        p4_program.RESULT_TABLE,
        p4_program.DROP_COUNTER,
        *p4_program.JOB_COUNTER_NAMES.values(),
        *p4_program.LEAF_COUNTER_NAMES.values(),
        *p4_program.REGISTERS,
        "MyIngress.l2_unicast",
        "MyIngress.l2_broadcast",
        "MyIngress.to_aggregator",
        "MyIngress.set_job",
        "MyIngress.set_leaf_job",
        "MyIngress.set_worker",
        "MyEgress.set_result_dst",
    ]
    for name in names:
        assert f'name: "{name}"' in text, name
