"""The reliability suite's recorder: each fault test adds a row to docs/RELIABILITY.md.

A test is a row of the table by its marker, and fills in what it measured through the
``reliability`` fixture::

    @pytest.mark.reliability("worker killed", "1 of 3 ranks SIGKILLed mid-allreduce", sums=0,
                             outcome="failed cleanly", state="...")
    def test_killed_worker(reliability: Reliability) -> None:
        ...
        reliability.record(recovery_s=elapsed)  # overrides or adds to the marker's fields

Rows are written only when ``$SWITCHAGG_RELIABILITY_OUT`` names a file (``make reliability``): one
JSON line per row, with how the test ended. A test that was skipped still gives its row (status
``skipped`` and the reason); one that failed gives its row with status ``failed`` (its wrong sums
unknown unless it recorded them before failing). ``tools/reliability_table.py`` turns the lines
into the table. The marker's ``tried`` and ``fault`` may name the test's parameters,
``"n={n} workers"``.

Loaded as a pytest plugin by the repository's root conftest.py.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

ENV = "SWITCHAGG_RELIABILITY_OUT"

# The faults the table must cover (issue 23), in the order it lists them; a row's fault is one of
# these. The table names any of them that has no row.
FAULTS = (
    "loss",
    "duplicated packets",
    "worker killed",
    "rank restarted alone",
    "standing job reused",
    "worker stalled",
    "aggregator restarted",
    "controller restarted",
    "bmv2 restarted",
    "foreign flood",
    "squatter",
    "mismatched calls",
    "caught Inf",
    "malformed packets",
    "fuzzer",
)

# What a row says (JSON keys). runs: how many times the fault was tried; sums: allreduce results
# checked (one per rank and call); wrong: wrong sums among them (None: unknown, the test failed);
# outcome: "exact", "failed cleanly" (every rank got an error, no rank a wrong sum), or both;
# recovery_s: seconds from the fault to exact sums again or to the clean failure; recovery: the
# same in words where no number was measured; state: what the fault left behind.
FIELDS = ("fault", "tried", "runs", "sums", "wrong", "outcome", "recovery_s", "recovery", "state", "note")

_ROWS = pytest.StashKey[list[dict[str, Any]]]()
# Which pytest run wrote a row: the table keeps only each test's latest run (tools/reliability_table.py).
_SESSION = pytest.StashKey[str]()


class Reliability:
    """The rows one test records (usually one); each starts from the marker's fields."""

    def __init__(self, item: pytest.Item) -> None:
        self._item = item
        self.started = time.monotonic()

    def record(self, **fields: Any) -> None:
        """Adds a row: the marker's fields, overridden by ``fields`` (see FIELDS). Calling it again
        adds another row (e.g. one per fault rate in one test)."""
        unknown = set(fields) - set(FIELDS)
        if unknown:
            raise TypeError(f"unknown reliability fields: {sorted(unknown)}")
        row = {**marker_fields(self._item), **fields}
        self._item.stash.setdefault(_ROWS, []).append(row)


def marker_fields(item: pytest.Item) -> dict[str, Any]:
    """The row the test's ``reliability`` marker declares, its parameters filled in."""
    marker = item.get_closest_marker("reliability")
    if marker is None:
        return {}
    row: dict[str, Any] = {"runs": 1, "wrong": 0, "outcome": "exact"}
    names = ("fault", "tried")
    row.update(dict(zip(names, marker.args, strict=False)))
    row.update(marker.kwargs)
    params = getattr(getattr(item, "callspec", None), "params", {})
    for key in names:
        if isinstance(row.get(key), str):
            try:
                row[key] = row[key].format(**params)
            except (KeyError, IndexError, ValueError):
                pass
    unknown = set(row) - set(FIELDS)
    if unknown:
        raise TypeError(f"{item.nodeid}: unknown reliability marker fields {sorted(unknown)}")
    return row


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).splitlines()[0][:300]
    return str(longrepr).strip().splitlines()[-1][:300] if longrepr else ""


def _emit(item: pytest.Item, report: pytest.TestReport) -> None:
    out = os.environ.get(ENV)
    if not out:
        return
    rows = item.stash.get(_ROWS, [])
    base = marker_fields(item)
    if not rows and not base:
        return
    status = "passed" if report.passed else "skipped" if report.skipped else "failed"
    if not rows:
        rows = [dict(base)]
    lines = []
    for row in rows:
        row = dict(row)
        if status != "passed":
            row["note"] = _reason(report)
        if status == "skipped":
            row.update(runs=0, sums=0, wrong=0, outcome="skipped")
        elif status == "failed":
            row["outcome"] = "test failed"
            if item.stash.get(_ROWS, None) is None:  # it never said how many sums were wrong
                row["wrong"] = None
        session = item.config.stash.setdefault(_SESSION, f"{time.time():.6f}-{os.getpid()}")
        row.update(test=item.nodeid, status=status, seconds=round(report.duration, 2), session=session)
        lines.append(json.dumps(row, sort_keys=True))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write("".join(line + "\n" for line in lines))


# ---- the plugin ----


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "reliability(fault, tried, **fields): this test is a row of docs/RELIABILITY.md "
        "(switchagg_lab.testing.reliability)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    # The row is written once: after the test body, or at setup when it never ran (a skip there).
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _emit(item, report)


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Iterator[Reliability]:
    """Records this test's rows of the reliability table (see the module's doc)."""
    yield Reliability(request.node)
