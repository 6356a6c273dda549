"""The engines' automatic fallback when the kernel refuses UDP GSO (issue 34): EIO from a device that
cannot finish checksums, ENOPROTOOPT before Linux 4.18. Today's kernels segment in software instead, so
the refusal is injected at the libc boundary (lab/switchagg_lab/testing/shims/refuse_gso.c, LD_PRELOADed
into real worker and aggregator processes): each engine's first train fails with EIO, and from then on it
sends one datagram per packet, and every sum is exact."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from switchagg import protocol
from switchagg.aggregator_control import RemoteAggregator
from switchagg_lab.testing.checks import check_results
from switchagg_lab.testing.control import ControlledAggregator
from switchagg_lab.testing.local import run_job

SHIM = Path(__file__).resolve().parents[1] / "lab/switchagg_lab/testing/shims/refuse_gso.c"
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="the GSO-refusing shim needs gcc")
N, K = 3, protocol.k_for_mtu(1500)  # frame-sized packets: GSO is on for them


def _shim(tmp: Path) -> Path:
    lib = tmp / "refuse_gso.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(SHIM), "-ldl"], check=True)
    return lib


def test_both_engines_fall_back_to_a_datagram_per_send_when_gso_is_refused(tmp_path: Path) -> None:
    lib = _shim(tmp_path)
    logs = {name: tmp_path / f"{name}.refused" for name in ("aggregator", "workers")}
    env = {"LD_PRELOAD": str(lib), "REFUSE_GSO_LOG": str(logs["aggregator"])}
    tensors = [("int32", 200_000), ("float32", 100_000), ("float32/8", 100_000)]
    with ControlledAggregator(tmp_path, "agg", "secret", env=env) as agg:
        with RemoteAggregator(agg.target, "secret", address=agg.address) as remote:
            out = tmp_path / "out"
            out.mkdir()
            prefix = ["env", f"LD_PRELOAD={lib}", f"REFUSE_GSO_LOG={logs['workers']}"]
            procs = run_job(
                remote, 1, N, tensors, out, slots=protocol.window_slots(K), k=K, launcher=lambda r: prefix
            )
            assert all(p.returncode == 0 for p in procs), [p.stderr[-2000:] for p in procs]
            counters = remote.counters()
    stats = check_results(1, N, K, tensors, out)
    # Each worker's first train was refused once, then no GSO send again; the aggregator's too.
    assert logs["workers"].read_text().count("refused") == N
    assert logs["aggregator"].read_text().count("refused") >= 1
    assert all(s["gso_sends"] == 0 and s["sent"] > 0 for s in stats), stats
    # every contribution was answered (a resend to a round still waiting is not), one datagram per send
    ignored = sum(j["retrans_ignored"] for j in counters["jobs"].values())
    assert counters["gso_sends"] == 0, json.dumps(counters)[:400]
    assert counters["tx"] >= counters["rx"] - ignored > 0, json.dumps(counters)[:400]
    assert sum(counters["drops"].values()) == 0
    assert np.all([s["allreduces"] == len(tensors) for s in stats])
