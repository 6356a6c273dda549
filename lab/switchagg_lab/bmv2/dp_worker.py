"""A worker for the controller's data-path tests: joins through the job service, then allreduces
int32 tensors whose exact sum it knows, and reports per iteration whether the sum was right;
closing the session leaves the job."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from switchagg import Session, SwitchaggError


def main() -> None:
    cfg = json.loads(sys.argv[1])
    n, length = cfg["n"], cfg["length"]
    progress = Path(cfg["progress"])
    # The test ends the run early by creating it: empty, stop now; else the iteration to stop at,
    # one no worker began yet (so no peer is left waiting in an allreduce this one skips).
    stop = Path(cfg["stop"]) if cfg.get("stop") else None
    report: dict[str, object] = {}
    ok = wrong = 0
    error = None
    with Session.from_job_service(
        cfg["service"], cfg["secret"], cfg["name"], n, bind=(cfg["ip"], 0), timeout=cfg["timeout"]
    ) as s:
        a = s.assignment
        report.update(rank=a.rank, job_id=a.job_id, data_plane=a.data_plane, k=a.k)
        base = np.arange(length, dtype=np.int64)
        for it in range(cfg["iterations"]):
            if stop is not None and stop.exists():
                at = stop.read_text().strip()
                if not at or it >= int(at):
                    break
            x = (base * (it + 1) + 7 * a.rank - 3).astype(np.int32)
            want = (base * (it + 1) * n + 7 * n * (n - 1) // 2 - 3 * n).astype(np.int32)
            try:
                s.allreduce(x)
            except SwitchaggError as e:  # e.g. the switch restarted mid-round: a clear error, no sum
                error = f"{type(e).__name__}: {e}"
                break
            if np.array_equal(x, want):
                ok += 1
            else:
                wrong += 1
            progress.write_text(str(it + 1))
    report.update(ok=ok, wrong=wrong, error=error)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
