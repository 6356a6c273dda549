"""The bmv2 suite's skip reason names exactly the tool that is missing (runs without bmv2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from switchagg_lab.testbed.tools import missing_for_switch


def _path_with(tmp_path: Path, tools: list[str]) -> str:
    for tool in tools:
        exe = tmp_path / tool
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    return str(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="the reason checked here is the one a root user sees")
@pytest.mark.parametrize(
    ("present", "named", "not_named"),
    [
        (["ip", "ethtool"], "`nft` (apt install nftables)", ["`ip`", "`ethtool`"]),
        (["nft"], "`ip` (apt install iproute2) and `ethtool` (apt install ethtool)", ["`nft`"]),
    ],
)
def test_the_skip_reason_names_only_the_missing_tools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, present: list[str], named: str, not_named: list[str]
) -> None:
    monkeypatch.setenv("PATH", _path_with(tmp_path, present))
    reason = missing_for_switch()
    assert reason is not None and named in reason
    assert not any(tool in reason for tool in not_named), reason
