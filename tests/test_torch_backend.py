"""The "switchagg" torch backend and DDP hook, in real worker processes over real UDP and gloo."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from tests.torch_launch import HANG_GUARD, finish, launch, read  # noqa: E402


@pytest.fixture(scope="module")
def collectives(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    n = 3
    out = tmp_path_factory.mktemp("collectives")
    for rank, (code, err) in enumerate(finish(launch("collectives", n, out))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    return [read(out, r) for r in range(n)]


def test_is_the_switchagg_group(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["type"] == "ProcessGroupSwitchagg"
        assert r["backend_name"] == "switchagg"


def test_int32_sum_is_exact(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["int32_equal_exact"] and r["int32_equal_gloo"]


def test_float32_sum_within_error_bound(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["float32_differs_from_input"]
        assert r["float32_within_bound_exact"], r["float32_max_rel_err"]
        assert r["float32_within_bound_gloo"]


def test_sums_go_through_the_network(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["list_ok"] and r["async_ok"]
        assert r["pinned"], "the embedded aggregator took a foreign packet for a rank"
        assert r["network_allreduces"] == 3  # int32, float32, one coalesced list


def test_other_ops_and_dtypes_are_delegated(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["max_ok"] and r["float64_ok"]
        assert r["delegated_network_allreduces"] == 0


def test_coalesced_and_subgroup(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["coalesced_ok"] and r["coalesced_network_allreduces"] == 1
        assert r["subgroup_ok"] and r["subgroup_own_session"] and r["subgroup_network_allreduces"] == 1


def test_delegated_collectives(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["broadcast_ok"] and r["allgather_ok"] and r["allgather_object_ok"] and r["barrier_ok"]


def test_ddp_backend_and_hook_match_gloo_gradients(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["ddp_grads_nonzero"]
        # One bucket in the first backward, two in the second, all through switchagg.
        assert r["ddp_backend_network_allreduces"] >= 3
        assert r["ddp_hook_network_allreduces"] >= 3
        assert r["ddp_backend_max_diff"] <= r["ddp_bound"]
        assert r["ddp_hook_max_diff"] <= r["ddp_bound"]
        assert r["hook_state_freed_after_close"]


def test_job_service_data_plane(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    from switchagg_lab.testing.controller import Controller

    n = 2
    controller = Controller(tmp_path, ["--software", "--software-listen", "127.0.0.1:0"]).start()
    try:
        env = {
            "SWITCHAGG_JOB_SERVICE": controller.address,
            "SWITCHAGG_SECRET_FILE": str(controller.secret_file),
        }
        procs = launch("job_service", n, tmp_path, **env)
        for rank, (code, err) in enumerate(finish(procs)):
            assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
        results = [read(tmp_path, r) for r in range(n)]
        jobs_after = controller.ctl("jobs", *controller.client_args()).stdout
    finally:
        controller.stop()
    for rank, r in enumerate(results):
        assert r["int32_equal_exact"] and r["network_allreduces"] == 1
        assert not r["embedded_aggregator"] and r["data_plane"] == "software"
        assert r["rank"] == rank and r["job_id"] == results[0]["job_id"]
    assert "torch-127.0.0.1" not in jobs_after  # both ranks left the job on close


def test_aggregator_that_cannot_start_fails_every_rank(tmp_path: Path) -> None:
    n = 2
    # 192.0.2.1 (TEST-NET-1) is on no local interface, so binding it fails; nothing is sent.
    for rank, (code, err) in enumerate(
        finish(launch("bad_aggregator", n, tmp_path, SWITCHAGG_BIND="192.0.2.1"))
    ):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    first, second = read(tmp_path, 0), read(tmp_path, 1)
    assert first["error"] is not None
    assert second["error"] == "RuntimeError" and "rank 0 could not start" in second["message"]


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("SWITCHAGG_K", "abc", "SWITCHAGG_K='abc' is not an integer"),
        ("SWITCHAGG_K", "0", "must be within"),
        ("SWITCHAGG_SLOTS", "99999999", "must be within"),
        ("SWITCHAGG_TIMEOUT", "-1", "must be positive"),
        ("SWITCHAGG_JOB_SERVICE", "nocolon", "is not host:port"),
    ],
)
def test_bad_environment_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    from switchagg.torch.dataplane import open_data_plane

    monkeypatch.setenv(name, value)
    if name != "SWITCHAGG_JOB_SERVICE":
        monkeypatch.delenv("SWITCHAGG_JOB_SERVICE", raising=False)

    with pytest.raises(ValueError, match=message):
        open_data_plane(0, 2, RefusingExchange(), "g1")


def test_job_service_needs_a_secret(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from switchagg.torch.dataplane import open_data_plane

    monkeypatch.setenv("SWITCHAGG_JOB_SERVICE", "127.0.0.1:1")
    monkeypatch.delenv("SWITCHAGG_SECRET", raising=False)
    monkeypatch.delenv("SWITCHAGG_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match="SWITCHAGG_SECRET"):
        open_data_plane(0, 2, RefusingExchange(), "g1")
    monkeypatch.setenv("SWITCHAGG_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot be read"):
        open_data_plane(0, 2, RefusingExchange(), "g1")


class RefusingExchange:
    def share(self, value: str | None) -> str:
        raise AssertionError("the environment must be checked before anything is shared")

    def gather(self, value: str) -> list[str]:
        raise AssertionError("the environment must be checked before anything is gathered")

    def settle(self) -> None:
        raise AssertionError("the environment must be checked before the start-up can fail collectively")


def test_killed_peer_raises_instead_of_hanging(tmp_path: Path) -> None:
    n = 3
    timeout = 2.0
    procs = launch("killed_peer", n, tmp_path, SWITCHAGG_TIMEOUT=str(timeout))
    deadline = time.monotonic() + HANG_GUARD
    while not all((tmp_path / f"ready{r}").exists() for r in range(n)):
        if time.monotonic() > deadline or any(w.proc.poll() is not None for w in procs):
            for w in procs:
                w.proc.kill()
                w.proc.wait()
            logs = "\n----\n".join(w.stderr() for w in procs)
            pytest.fail(f"workers did not reach the first allreduce:\n{logs}")
        time.sleep(0.05)
    victim = procs[-1].proc
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=HANG_GUARD)
    (tmp_path / "go").write_text("")
    results = finish(procs[:-1])
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
        r = read(tmp_path, rank)
        assert r["first_ok"]
        assert r["error"] == "SwitchaggTimeout", r
        assert r["is_switchagg_error"]
        assert r["seconds"] >= timeout * 0.5  # it waited for the peer rather than failing at once
        # A DDP step afterwards raises in backward() (it used to crash the process in C++).
        assert r["ddp_error"] == "RuntimeError" and "switchagg" in r["ddp_message"].lower(), r


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_mismatched_calls_fail_on_every_rank(tmp_path: Path, dtype: str) -> None:
    """docs/PROTOCOL.md, Call identity: rank 0 calls all_reduce on 100k + 100k elements, its peers
    once on 200k: every rank raises a SwitchaggError that names both lengths; none returns."""
    n = 3
    for rank, (code, err) in enumerate(finish(launch("mismatched_calls", n, tmp_path, MISMATCH_DTYPE=dtype))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    for rank in range(n):
        r = read(tmp_path, rank)
        assert r["error"] is not None and r["is_switchagg_error"], r
        assert "100000" in r["message"] and "200000" in r["message"], r["message"]
