"""A hostile neighbour on the same host floods the software aggregator and the workers while a
job runs (issue: a foreign sender must never change a sum). Every sum stays exact; the flood is
counted by drop reason; the job's time with and without the flood is printed (-s)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from switchagg.aggregator import SoftwareAggregator
from switchagg_lab.testing.checks import check_results
from switchagg_lab.testing.local import run_job
from switchagg_lab.testing.reliability import Reliability

K, SLOTS = 256, 8
TENSORS = [("int32", 20_000)] * 150 + [("float32", 20_000)] * 10


def _run(tmp: Path, n: int, flood: bool) -> tuple[float, dict, dict[str, int]]:
    """-> (job seconds, aggregator counters, what the flooder sent)."""
    flooder: list[subprocess.Popen[str]] = []

    def start_flood(addrs: list[tuple[str, int]]) -> None:
        if not flood:
            return
        cfg = {
            "aggregator": list(agg.address),
            "workers": [list(a) for a in addrs],
            "job": 1,
            "n": n,
            "slot_base": 0,
            "slots": SLOTS,
            "k": K,
            "count": 40_000,  # bounded in count and time
            "seconds": 60,
        }
        cmd = [sys.executable, "-m", "switchagg_lab.testing.flood", json.dumps(cfg)]
        flooder.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(0.5)  # the flood is under way when the first allreduce starts

    with SoftwareAggregator() as agg:
        t0 = time.monotonic()
        procs = run_job(agg, 1, n, TENSORS, tmp, slots=SLOTS, k=K, before_go=start_flood, timeout=60.0)
        seconds = time.monotonic() - t0
        sent: dict[str, int] = {}
        if flooder:
            out, err = flooder[0].communicate(timeout=120)
            assert flooder[0].returncode == 0, err
            sent = json.loads(out)
        counters = agg.counters()
    assert all(p.returncode == 0 for p in procs), [p.stderr for p in procs]
    return seconds, counters, sent


@pytest.mark.reliability(
    "foreign flood",
    "40,000 foreign datagrams (bad headers, random bytes, well-formed DATA from foreign sockets) at "
    "the aggregator and forged RESULTs at the workers, {n} ranks x 160 allreduces, loopback",
    state="nothing: the flood counted by drop reason, the job's counters as without it",
)
@pytest.mark.parametrize("n", [2, 4])
def test_a_flood_of_foreign_packets_changes_no_sum(tmp_path: Path, n: int, reliability: Reliability) -> None:
    quiet_dir, flood_dir = tmp_path / "quiet", tmp_path / "flood"
    quiet_dir.mkdir()
    flood_dir.mkdir()
    quiet_s, quiet, _ = _run(quiet_dir, n, flood=False)
    flood_s, c, sent = _run(flood_dir, n, flood=True)

    stats = check_results(1, n, K, TENSORS, flood_dir)  # every one of the 160 sums, on every rank
    check_results(1, n, K, TENSORS, quiet_dir)
    drops = c["drops"]
    assert sent["data"] > 1000 and sent["result"] > 100
    # A valid job and rank from a foreign source is refused as spoofed before its slot and length
    # are looked at: well-formed DATA, and the bad-slot and truncated kinds too.
    assert sent["data"] // 2 < drops["spoofed"] <= sent["data"] + sent["bad_pool"] + sent["truncated"]
    for reason in ("bad_version", "bad_type", "unknown_job", "bad_rank"):
        assert drops[reason] > 0, (reason, drops)
    assert sum(quiet["drops"].values()) == 0
    # The job counted exactly its workers' contributions, flood or not.
    assert c["jobs"][1]["aggregated"] == quiet["jobs"][1]["aggregated"]
    # Forged results never reach a worker: its connected socket only takes the aggregator's. The
    # only stale results are the aggregator's answers to the worker's own needless resends.
    assert all(s["stale"] <= s["retransmits"] for s in stats), stats
    reliability.record(
        sums=len(TENSORS) * n,
        recovery=f"none needed; the job took {flood_s / quiet_s:.2f}x its time without the flood",
    )
    print(
        f"\nn={n}: {len(TENSORS)} allreduces of {TENSORS[0][1]} elements: {quiet_s:.2f} s quiet, "
        f"{flood_s:.2f} s under a flood of {sum(sent.values())} datagrams "
        f"({flood_s / quiet_s:.2f}x the time); drops {drops}; flood sent {sent}"
    )
