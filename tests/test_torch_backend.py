"""The "switchagg" torch backend and DDP hook, in real worker processes over real UDP and gloo."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from switchagg_lab.testing.kit import free_port  # noqa: E402
from switchagg_lab.testing.torch_launch import HANG_GUARD, finish, launch, read  # noqa: E402


def consecutive_tcp_ports(count: int) -> int:
    """A base port such that base .. base + count - 1 are free for TCP now."""
    for _ in range(100):
        base = free_port(socket.SOCK_STREAM)
        socks = [socket.socket() for _ in range(count)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free TCP ports")


@pytest.fixture(scope="module")
def collectives(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    n = 3
    out = tmp_path_factory.mktemp("collectives")
    # SWITCHAGG_DEBUG=INFO: where each kind of call ran goes to stderr (test_debug_log_says_where).
    # SWITCHAGG_METRICS_PORT: each rank serves its worker metrics on base + LOCAL_RANK.
    env = {"SWITCHAGG_DEBUG": "INFO", "SWITCHAGG_METRICS_PORT": str(consecutive_tcp_ports(n))}
    for rank, (code, err) in enumerate(finish(launch("collectives", n, out, **env))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
        (out / f"log{rank}.txt").write_text(err)
    return [read(out, r) | {"log": (out / f"log{r}.txt").read_text()} for r in range(n)]


def test_is_the_switchagg_group(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["type"] == "Network"  # backend_of's: the Python side of the C++ c10d backend
        assert r["backends"] == {"cpu": "switchagg", "cuda": "switchagg"}
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_sum_and_avg_within_the_dtype_bound(collectives: list[dict[str, Any]], dtype: str, op: str) -> None:
    """In the network, against the float64 sum (mean) of the ranks' inputs: within
    precision.error_bound for the dtype (docs/TORCH.md, Precision); gloo's error is in the report."""
    for r in collectives:
        case = r["precision"][f"{dtype}_{op}"]
        assert case["worst_over_bound"] <= 1.0, case
        print(f"{dtype} {op}: max |err| {case['max_err']:.3g} (gloo {case['gloo_max_err']:.3g})")


def test_avg_and_half_precision_go_through_the_network(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["bf16_list_avg_ok"]
        assert r["precision_network_calls"] == 7  # 3 dtypes x SUM/AVG, and a bfloat16 list


def test_stats_count_calls_per_op_and_path(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        network, delegated = r["stats"]["network"], r["stats"]["delegated"]
        assert network["allreduce"] >= 12 and network["allreduce_coalesced"] == 1
        # MAX and float64 allreduces, and every other collective, ran on gloo and were counted.
        assert delegated["allreduce"] >= 2
        assert delegated["broadcast"] >= 1 and delegated["allgather"] >= 1 and delegated["barrier"] >= 1


def test_metrics_count_calls_per_op_and_path(collectives: list[dict[str, Any]]) -> None:
    pytest.importorskip("prometheus_client")
    for rank, r in enumerate(collectives):
        world = [
            line for line in r["metrics"] if 'switchagg_job="torch-127.0.0.1-' in line and '-g1"' in line
        ]
        network = [line for line in world if 'op="allreduce"' in line and 'path="network"' in line]
        assert len(network) == 1 and f'rank="{rank}"' in network[0], r["metrics"]
        assert float(network[0].rsplit(" ", 1)[1]) == r["stats"]["network"]["allreduce"]
        assert any('op="broadcast"' in line and 'path="delegated"' in line for line in world)


def test_debug_log_says_where(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        log = r["log"]
        assert "allreduce float32 on cpu runs in the network (SUM)" in log
        assert "allreduce bfloat16 on cpu runs in the network (SUM)" in log
        n = len(collectives)
        avg = f"float32 on cpu runs in the network (AVG: SUM in the network, then / {n} on each rank)"
        assert avg in log
        hooked = f"float32 on cpu runs in the network (AVG: / {n} on each rank, then SUM in the network)"
        assert hooked in log  # the DDP comm hook divides first, as torch's default hook does
        assert "allreduce float64 on cpu runs on gloo (dtype float64)" in log
        assert "allreduce int32 on cpu runs on gloo (op MAX)" in log
        assert "broadcast float32 on cpu runs on gloo" in log
        # the first call of each kind per group only (the world group g1 made many)
        lines = log.splitlines()
        assert sum("g1" in line and "float32 on cpu runs in the network (SUM)" in line for line in lines) == 1


def test_hook_fallback_is_counted_and_warned_once(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["hook_stats"]["network"]["allreduce"] >= 3 and not r["hook_stats"]["delegated"]
        assert r["fallback_stats"]["delegated"]["allreduce"] >= 3 and not r["fallback_stats"]["network"]
        assert len(r["fallback_warnings"]) == 1, r["fallback_warnings"]
        assert "float64" in r["fallback_warnings"][0]


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


def test_the_group_names_itself_switchagg_to_ddp(collectives: list[dict[str, Any]]) -> None:
    """torch's own test_ddp_logging_data_cpu: DDP's logging data names the group's backend as
    dist.get_backend does (c10d's ProcessGroup says "custom" for every out-of-tree backend)."""
    for r in collectives:
        assert r["ddp_logged_backend_name"] == "switchagg"
        assert r["group_backend_names"] == ["switchagg", "switchagg"]


def test_ddp_backend_and_hook_match_gloo_gradients(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        assert r["ddp_grads_nonzero"]
        # One bucket in the first backward, two in the second, all through switchagg.
        assert r["ddp_backend_network_allreduces"] >= 3
        assert r["ddp_hook_network_allreduces"] >= 3
        assert r["ddp_backend_max_diff"] <= r["ddp_bound"]
        assert r["ddp_hook_max_diff"] <= r["ddp_bound"]
        assert r["hook_state_freed_after_close"]


@pytest.mark.parametrize("lanes", [1, 2])
def test_job_service_data_plane(tmp_path: Path, lanes: int) -> None:
    """Through the job service; with 2 lanes each lane is a job of its own ("NAME", "NAME/lane1")."""
    pytest.importorskip("grpc")
    from switchagg_lab.testing.controller import Controller

    n = 2
    controller = Controller(tmp_path, ["--software", "--software-listen", "127.0.0.1:0"]).start()
    try:
        env = {
            "SWITCHAGG_JOB_SERVICE": controller.address,
            "SWITCHAGG_SECRET_FILE": str(controller.secret_file),
            "SWITCHAGG_LANES": str(lanes),
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
        assert len(set(r["lane_jobs"])) == lanes and r["lane_jobs"] == results[0]["lane_jobs"]
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
    def gather(self, value: str) -> list[str]:
        raise AssertionError("the environment must be checked before anything is gathered")

    def settle(self) -> None:
        raise AssertionError("the environment must be checked before the start-up can fail collectively")


def test_killed_peer_raises_instead_of_hanging(tmp_path: Path) -> None:
    """The group's timeout is 30 minutes; the peer watch reports the killed rank by its number within
    SWITCHAGG_TIMEOUT plus a heartbeat interval (docs/TORCH.md) instead."""
    n = 3
    timeout = 2.0
    procs = launch("killed_peer", n, tmp_path, SWITCHAGG_TIMEOUT=str(timeout), PG_TIMEOUT="1800")
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
        assert r["error"] == "SwitchaggPeerGone", r
        assert r["is_switchagg_error"]
        assert r["seconds"] >= timeout * 0.5  # it waited for the peer rather than failing at once
        assert f"rank {n - 1} is gone" in r["message"], r["message"]  # the watch, not the 30 min timeout
        print(f"rank {rank}: the killed rank reported after {r['seconds']:.1f} s: {r['message']}")
        # A DDP step afterwards raises in backward(), with the error itself (it once crashed the process).
        assert r["ddp_error"] == "SwitchaggPeerGone" and r["ddp_message"], r


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_mismatched_calls_fail_on_every_rank(tmp_path: Path, dtype: str) -> None:
    """docs/PROTOCOL.md, Call identity: rank 1 calls all_reduce once on 200k elements, its peers twice
    on 100k: every rank raises SwitchaggMismatch naming both calls per rank; none returns."""
    n = 3
    for rank, (code, err) in enumerate(finish(launch("mismatched_calls", n, tmp_path, MISMATCH_DTYPE=dtype))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    for rank in range(n):
        r = read(tmp_path, rank)
        assert r["error"] == "SwitchaggMismatch" and r["is_switchagg_error"], r
        assert f"rank 1: SUM of {dtype} [200000]" in r["message"], r["message"]
        assert f"rank 0: SUM of {dtype} [100000]" in r["message"], r["message"]


# What each case's message must say, per rank (lab/switchagg_lab/testing/torch_worker.py, MISMATCHES).
USER_TERMS = {
    "staged_dtype": ("rank 1: SUM of bfloat16 [2095104]", "rank 0: SUM of float32 [1047552]"),
    "dtype": ("rank 1: SUM of float16 [50000]", "rank 2: SUM of float32 [50000]"),
    "op": ("rank 1: AVG of float32 [50000]", "rank 0: SUM of float32 [50000]"),
    "coalesced": ("rank 1: SUM of float32 [3000, 5000]", "rank 0: SUM of float32 [8000]"),
    "hook": ("rank 1: AVG of bfloat16 [50000]", "rank 0: AVG of float32 [50000]"),
}


@pytest.mark.reliability(
    "torch calls that differ",
    "rank 1's user call differs from its 2 peers' where the wire's chunk calls agree: a bfloat16 tensor "
    "staged as 2 chunks against 2 float32 calls of one chunk, float16 against float32, AVG against SUM, a "
    "coalesced list against one tensor, the DDP hook on bfloat16 against float32; 1 and 3 lanes, loopback",
    sums=0,
    outcome="failed cleanly: every rank raises SwitchaggMismatch naming each rank's op, dtype, lengths",
    recovery="none needed: the call's tag differs on the wire, so the first round is poisoned",
    state="the group's sessions broken (a new process group recovers)",
)
@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.parametrize("case", sorted(USER_TERMS))
def test_calls_that_differ_in_the_users_terms_fail_on_every_rank(
    tmp_path: Path, case: str, lanes: int
) -> None:
    """The wire sees chunks, not the user's calls: rank 1's bfloat16 tensor of 2 chunks against two
    float32 calls of one chunk each, a float16 against a float32 tensor of the same length, AVG against
    SUM, a coalesced list against one tensor, and the DDP hook on a bfloat16 bucket against float32.
    Each once summed silently (issue 33); every rank must raise SwitchaggMismatch naming each rank's
    call, on 1 and 3 lanes (where a user's chunks go to different lanes)."""
    n = 3
    env = {"MISMATCH_CASE": case, "SWITCHAGG_LANES": str(lanes)}
    for rank, (code, err) in enumerate(finish(launch("mismatched_calls", n, tmp_path, **env))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    for rank in range(n):
        r = read(tmp_path, rank)
        assert r["error"] == "SwitchaggMismatch" and r["is_switchagg_error"], r
        for words in USER_TERMS[case]:
            assert words in r["message"], r["message"]
        assert "nothing was summed" in r["message"], r["message"]


def test_paused_peer_is_waited_for(tmp_path: Path) -> None:
    """init_process_group(timeout=5 min): a rank that pauses 15 s (more than SWITCHAGG_TIMEOUT's
    default 10 s) before an allreduce, then 12 s before a DDP backward with the hook, is waited for."""
    n = 3
    env = {"PAUSE": "15", "HOOK_PAUSE": "12", "PG_TIMEOUT": "300"}
    for rank, (code, err) in enumerate(finish(launch("paused_peer", n, tmp_path, **env))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    for rank in range(n):
        r = read(tmp_path, rank)
        assert r["backend"]["error"] is None and r["backend"]["ok"], r
        assert r["hook"]["error"] is None and r["hook"]["network"] >= 1, r
        if rank < n - 1:  # they waited out the pause in the network
            assert r["backend"]["seconds"] >= 10 and r["hook"]["seconds"] >= 10, r


def test_live_peer_slower_than_the_group_timeout_fails_after_it(tmp_path: Path) -> None:
    """timeout=4 s and a pause of 10 s: the waiting ranks fail after the group's 4 s (no progress),
    with the group's timeout in the message, although the paused rank is alive."""
    n = 2
    env = {"PAUSE": "10", "PG_TIMEOUT": "4", "SWITCHAGG_TIMEOUT": "30"}
    finish(launch("paused_peer", n, tmp_path, **env))
    r = read(tmp_path, 0)
    assert r["backend"]["error"] == "SwitchaggTimeout", r
    assert "for 4.0 s" in r["backend"]["message"], r


@pytest.fixture(scope="module", params=[2, 3], ids=["L2", "L3"])
def lanes_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """3 ranks with SWITCHAGG_LANES=2 and 3 (switchagg_lab.testing.torch_worker, scenario_lanes)."""
    n, lanes = 3, int(request.param)
    out = tmp_path_factory.mktemp(f"lanes{lanes}")
    for rank, (code, err) in enumerate(finish(launch("lanes", n, out, SWITCHAGG_LANES=str(lanes)))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    return [read(out, r) for r in range(n)]


def test_lanes_are_jobs_of_their_own(lanes_run: list[dict[str, Any]]) -> None:
    """One job per lane on the embedded aggregator, on disjoint slot ranges (the window split, at
    least 2 each), and every lane carried calls."""
    for r in lanes_run:
        lanes = r["lanes"]
        assert r["lane_jobs"] == list(range(1, lanes + 1))
        ranges = r["lane_slots"]
        assert all(count >= 2 for _, count in ranges)
        assert all(ranges[i][0] + ranges[i][1] <= ranges[i + 1][0] for i in range(lanes - 1)), ranges
        assert all(calls > 0 for calls in r["lane_calls"]), r["lane_calls"]
    assert len({tuple(r["lane_calls"]) for r in lanes_run}) == 1  # the same calls on every rank's lanes


def test_lanes_concurrent_calls_are_exact_and_bounded(lanes_run: list[dict[str, Any]]) -> None:
    """Many async allreduces in flight at once over the lanes, int32/float32/bfloat16, SUM/AVG, one
    staged list: int32 exact, floats within precision.error_bound, on every rank."""
    for r in lanes_run:
        assert not r["lane_wrong"], r["lane_wrong"]
        print(f"lanes={r['lanes']}: worst float error {r['lane_worst_over_bound']:.3f} x the bound")


def test_lanes_ddp_matches_gloo(lanes_run: list[dict[str, Any]]) -> None:
    for r in lanes_run:
        assert r["ddp_grads_nonzero"]
        assert r["ddp_backend_network_allreduces"] >= 3 and r["ddp_hook_network_allreduces"] >= 3
        assert r["ddp_backend_max_diff"] <= r["ddp_bound"]
        assert r["ddp_hook_max_diff"] <= r["ddp_bound"]
        assert r["trained_identical"]


def test_lanes_mismatch_fails_every_rank(lanes_run: list[dict[str, Any]]) -> None:
    """The second of three calls differs on rank 0 (100000 elements against 200000): it fails on
    every rank naming both lengths, and the group's later calls fail at once on every rank."""
    for r in lanes_run:
        second = r["mismatch"][1]
        assert second is not None and second["is_switchagg_error"], r["mismatch"]
        assert "100000" in second["message"] and "200000" in second["message"], second
        # On the failed lane: "an earlier call ... failed"; on another: "lane l of L failed: ...".
        after = r["after"]
        assert after is not None and after["error"] == "SwitchaggMismatch", after
        assert "failed" in after["message"] and "100000" in after["message"], after


@pytest.mark.parametrize("lanes", [1, 2])
def test_shards_hosted_by_the_ranks(tmp_path: Path, lanes: int) -> None:
    """SWITCHAGG_SHARDS=2 in embedded mode, 3 ranks: ranks 0 and 1 host an aggregator each, every
    tensor is striped over both (with 2 lanes: a job per lane on each); int32 exact, floats within
    the bound, DDP (backend and hook) against gloo, and both aggregators summed and dropped nothing."""
    n = 3
    env = {"SWITCHAGG_SHARDS": "2", "SWITCHAGG_LANES": str(lanes), "SWITCHAGG_K": "512"}
    for rank, (code, err) in enumerate(finish(launch("shards", n, tmp_path, **env))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    results = [read(tmp_path, r) for r in range(n)]
    assert [r["hosts"] for r in results] == [True, True, False]
    shards = results[0]["shards"]
    assert len(shards) == lanes and all(len(lane) == 2 and lane[0] != lane[1] for lane in shards), shards
    assert all(r["shards"] == shards for r in results)  # every rank stripes over the same aggregators
    for r in results:
        assert not r["lane_wrong"], r["lane_wrong"]
        assert r["ddp_backend_network_allreduces"] >= 3 and r["ddp_hook_network_allreduces"] >= 3
        assert r["ddp_backend_max_diff"] <= r["ddp_bound"] and r["ddp_hook_max_diff"] <= r["ddp_bound"]
    for r in results[:2]:
        assert r["aggregated"] > 0 and r["dropped"] == 0, r


def test_more_shards_than_ranks_is_refused(tmp_path: Path) -> None:
    for rank, (code, err) in enumerate(finish(launch("bad_aggregator", 2, tmp_path, SWITCHAGG_SHARDS="3"))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
        r = read(tmp_path, rank)
        assert r["error"] == "ValueError" and "SWITCHAGG_SHARDS='3' must be within [0, 2]" in r["message"], r
