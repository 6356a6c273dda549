"""The software aggregator's control service: a real ``switchagg-aggregator`` process, jobs
installed and removed through its gRPC control socket, real worker processes summing through it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from switchagg._proto import aggregator_pb2 as pb
from switchagg.aggregator_control import ControlError, RemoteAggregator
from switchagg_lab.testing.checks import check_results
from switchagg_lab.testing.control import ControlledAggregator
from switchagg_lab.testing.local import run_job

SECRET = "control-test-secret"
KEY = 0x1234ABCD  # the jobs' result key


@pytest.fixture
def aggregator(tmp_path: Path) -> Iterator[ControlledAggregator]:
    with ControlledAggregator(tmp_path, "agg", SECRET) as p:
        yield p


def test_workers_sum_exactly_through_a_job_installed_over_the_control_service(
    aggregator: ControlledAggregator, tmp_path: Path
) -> None:
    with RemoteAggregator(aggregator.target, SECRET) as remote:
        info = remote.info()
        assert info.boot_id == aggregator.boot_id
        assert remote.address[1] == info.udp_port > 0
        tensors = [("int32", 5000), ("float32", 3000)]
        done = run_job(remote, 41, 3, tensors, tmp_path, slots=16, k=64)
        for p in done:
            assert p.returncode == 0, p.stderr[-1500:]
        check_results(41, 3, 64, tensors, tmp_path)
        assert set(remote.jobs()) == {41}
        c = remote.counters()
        assert c["jobs"][41]["aggregated"] > 0 and c["drops"]["spoofed"] == 0
        assert remote.remove_job(41) is True
        assert remote.remove_job(41) is False  # idempotent
        assert remote.jobs() == {}


def test_a_wrong_secret_changes_nothing(aggregator: ControlledAggregator) -> None:
    addrs = [("127.0.0.1", 5000), ("127.0.0.1", 5001)]
    remote, foe = RemoteAggregator(aggregator.target, SECRET), RemoteAggregator(aggregator.target, "guess")
    with remote, foe:
        remote.add_job(7, 2, 0, 8, 16, 1, addrs, key=KEY)
        for call in (
            lambda: foe.add_job(8, 2, 8, 8, 16, 1, [("127.0.0.1", 6000), ("127.0.0.1", 6001)], key=KEY),
            lambda: foe.remove_job(7),
            foe.jobs,
            foe.counters,
            foe.info,
        ):
            with pytest.raises(ControlError) as e:
                call()
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert set(remote.jobs()) == {7}


def test_a_refused_job_leaves_what_was_installed(aggregator: ControlledAggregator) -> None:
    a = [("127.0.0.1", 5000), ("127.0.0.1", 5001)]
    with RemoteAggregator(aggregator.target, SECRET) as remote:
        assert remote.add_job(7, 2, 0, 8, 16, 1, a, key=KEY) is False
        with pytest.raises(ControlError, match="overlap|slot") as e:
            remote.add_job(
                9, 2, 4, 8, 16, 1, [("127.0.0.1", 6000), ("127.0.0.1", 6001)], key=KEY
            )  # slots 4..11
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ControlError, match="same address"):
            remote.add_job(7, 2, 0, 8, 16, 2, [a[0], a[0]], key=KEY)  # a bad replacement of job 7
        jobs = remote.jobs()
        assert set(jobs) == {7} and (jobs[7].slot_base, jobs[7].slot_count) == (0, 8)
        assert remote.add_job(7, 2, 0, 8, 16, 2, a, key=KEY) is True  # a good one replaces it


def _info_within(remote: RemoteAggregator, seconds: float) -> pb.InfoReply:
    """The channel reconnects on its own, within its (short) backoff."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return remote.info()
        except ControlError as e:
            if e.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_restart_shows_as_a_new_boot_id_with_no_jobs(tmp_path: Path) -> None:
    with ControlledAggregator(tmp_path, "agg", SECRET) as agg, RemoteAggregator(agg.target, SECRET) as remote:
        remote.add_job(3, 2, 0, 4, 8, 1, [("127.0.0.1", 5000), ("127.0.0.1", 5001)], key=KEY)
        first, address = agg.boot_id, agg.address
        agg.kill()
        with pytest.raises(ControlError) as e:
            remote.info()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        agg.start()
        info = _info_within(remote, 15.0)
        assert info.boot_id == agg.boot_id != first and (info.ip, info.udp_port) == address
        assert remote.jobs() == {}


def test_control_needs_a_secret_file(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "switchagg.aggregator_cli", "--port", "0",
         "--control", f"unix:{tmp_path}/x.sock"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--control needs --control-secret-file" in proc.stderr
