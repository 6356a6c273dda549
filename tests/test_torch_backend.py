"""The "switchagg" torch backend and DDP hook, in real worker processes over real UDP and gloo."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from switchagg_lab.testing.kit import free_port  # noqa: E402
from switchagg_lab.testing.reliability import Reliability  # noqa: E402
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
        # Unless told, float32 and int32 travel in 32-bit lanes, bfloat16 and float16 in 16-bit lanes.
        lanes = r["stats"]["bytes"]
        assert lanes["lanes32"] > 0 and lanes["lanes16"] > 0 and lanes["lanes8"] == 0, lanes
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
        for bits in (32, 16, 8):  # the group's one lane: its bytes per lane width, as stats() says
            lane = [line for line in r["lane_bytes"] if '-g1"' in line and f'bits="{bits}"' in line]
            assert len(lane) == 1, r["lane_bytes"]
            assert float(lane[0].rsplit(" ", 1)[1]) == r["stats"]["bytes"][f"lanes{bits}"]


def test_debug_log_says_where(collectives: list[dict[str, Any]]) -> None:
    for r in collectives:
        log = r["log"]
        assert "allreduce float32 on cpu runs in the network (SUM)" in log
        assert "allreduce bfloat16 on cpu runs in the network (SUM in 16-bit lanes)" in log
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
        assert r["ddp_hook_max_diff"] <= r["ddp_hook_bound"]
        assert r["hook_state_freed_after_close"]


@pytest.fixture(scope="module", params=[32, 16, 8], ids=["bits32", "bits16", "bits8"])
def widths_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """3 ranks with SWITCHAGG_WIRE_BITS=32, 16 and 8 (torch_worker's scenario_widths): every float
    dtype in those lanes, the hook with its default error feedback."""
    n, bits = 3, int(request.param)
    out = tmp_path_factory.mktemp(f"widths{bits}")
    env = {"SWITCHAGG_WIRE_BITS": str(bits), "SWITCHAGG_DEBUG": "INFO"}
    for rank, (code, err) in enumerate(finish(launch("widths", n, out, **env))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    logs = [(out / f"stderr{r}.txt").read_text() for r in range(n)]
    return [read(out, r) | {"bits": bits, "log": logs[r]} for r in range(n)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_every_width_sums_within_its_bound(widths_run: list[dict[str, Any]], dtype: str, op: str) -> None:
    """SWITCHAGG_WIRE_BITS applies to every float dtype: SUM and AVG in its lanes, against the float64
    sum (mean), within precision.error_bound at that width; gloo's error is in the report."""
    for r in widths_run:
        assert r["wire_bits"] == r["bits"]
        case = r["precision"][f"{dtype}_{op}"]
        assert case["bits"] == r["bits"] and case["worst_over_bound"] <= 1.0, case
    case, bits = widths_run[0]["precision"][f"{dtype}_{op}"], widths_run[0]["bits"]
    print(
        f"{bits}-bit lanes, {dtype} {op}: max |err| {case['max_err']:.3g} "
        f"(gloo {case['gloo_max_err']:.3g}), {case['worst_over_bound']:.2f} of the bound"
    )
    assert all(r["bf16_list_avg_ok"] and r["precision_network_calls"] == 7 for r in widths_run)


def test_every_width_ddp_matches_gloo(widths_run: list[dict[str, Any]]) -> None:
    """DDP on the backend (no error feedback) and with the hook (error feedback in 8-bit lanes)."""
    for r in widths_run:
        assert r["ddp_grads_nonzero"]
        assert r["ddp_backend_network_allreduces"] >= 3 and r["ddp_hook_network_allreduces"] >= 3
        assert r["ddp_backend_max_diff"] <= r["ddp_bound"], r["ddp_backend_max_diff"]
        assert r["ddp_hook_max_diff"] <= r["ddp_hook_bound"], r["ddp_hook_max_diff"]


def test_every_width_counts_its_bytes_and_says_so(widths_run: list[dict[str, Any]]) -> None:
    """stats()'s bytes per lane width: only the chosen width's carried anything; the log says the
    lanes of each kind of call, the hook's error feedback, and the bytes as the group closes."""
    for r in widths_run:
        bits = r["bits"]
        lanes = r["stats"]["bytes"]
        assert lanes[f"lanes{bits}"] > 0 and sum(lanes.values()) == lanes[f"lanes{bits}"], lanes
        narrow = f" in {bits}-bit lanes" if bits != 32 else ""
        log = r["log"]
        assert f"allreduce float32 on cpu runs in the network (SUM{narrow})" in log
        assert f"allreduce bfloat16 on cpu runs in the network (SUM{narrow})" in log
        feedback = " with error feedback" if bits == 8 else ""
        hooked = f"(AVG: / 3 on each rank, then SUM in the network{narrow}{feedback})"
        assert f"float32 on cpu runs in the network {hooked}" in log
        closed = re.search(
            r"switchagg group g1 \(rank \d of 3\): closed; datagram bytes of its network calls: (.*)", log
        )
        assert closed, log[-3000:]
        said = {f"lanes{b}": int(n) for n, b in re.findall(r"(\d+) in (\d+)-bit lanes", closed.group(1))}
        assert said == lanes, (said, lanes)


def test_a_hook_of_its_own_width_in_every_documented_form(widths_run: list[dict[str, Any]]) -> None:
    """SwitchaggHookState(bits=...), functools.update_wrapper(functools.partial(allreduce_hook,
    bits=...), allreduce_hook), and a hook of one's own passing bits on: DDP takes each, the buckets
    travel in those lanes (whatever SWITCHAGG_WIRE_BITS says) within the bound, and each bucket's
    residual has the size of its bucket after DDP rebuilt them. A bare partial is refused by DDP."""
    for r in widths_run:
        bits = r["hook_bits"]
        assert bits != r["bits"]
        for name, form in r["hook_forms"].items():
            lanes = form["bytes"]
            assert lanes[f"lanes{bits}"] > 0 and sum(lanes.values()) == lanes[f"lanes{bits}"], (name, lanes)
            assert form["max_diff"] <= r["hook_bits_bound"], (name, form["max_diff"])
        passes: list[dict[int, int]] = []
        for index, numel in r["own_hook_buckets"]:
            if index == 0:
                passes.append({})
            passes[-1][index] = numel
        assert len(passes) == 2 and passes[0] != passes[1], passes  # DDP rebuilt its buckets
        if bits == 8:  # error feedback by default: one residual per bucket, of the last pass's size
            residuals = {int(i): v for i, v in r["hook_forms"]["own_hook"]["residuals"].items()}
            assert all(residuals[i] == numel for i, numel in passes[1].items()), (residuals, passes)
        assert r["bare_partial_error"] and "__name__" in r["bare_partial_error"], r["bare_partial_error"]


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
    # Rank 0 binds SWITCHAGG_BIND first for its liveness listener, then for its aggregator.
    assert second["error"] == "RuntimeError" and "rank 0 cannot listen on 192.0.2.1" in second["message"]


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("SWITCHAGG_K", "abc", "SWITCHAGG_K='abc' is not an integer"),
        ("SWITCHAGG_K", "0", "must be within"),
        ("SWITCHAGG_SLOTS", "99999999", "must be within"),
        ("SWITCHAGG_TIMEOUT", "-1", "must be positive"),
        ("SWITCHAGG_JOB_SERVICE", "nocolon", "is not host:port"),
        ("SWITCHAGG_WIRE_BITS", "12", "SWITCHAGG_WIRE_BITS='12' is not one of 32, 16, 8"),
        ("SWITCHAGG_WIRE_BITS", "fp16", "is not one of 32, 16, 8"),
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


def _wait_for_files(procs: list[Any], paths: list[Path], what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline or any(w.proc.poll() is not None for w in procs):
            for w in procs:
                w.proc.kill()
                w.proc.wait()
            logs = "\n----\n".join(w.stderr() for w in procs)
            pytest.fail(f"workers did not {what}:\n{logs}")
        time.sleep(0.02)


@pytest.mark.reliability(
    "worker killed",
    "torch backend and hook: 1 of 3 ranks SIGKILLed while the others are in an allreduce, the group's "
    "timeout 30 min, SWITCHAGG_TIMEOUT 10 s, loopback",
    sums=0,
    outcome="failed cleanly: the 2 others raise naming the killed rank, nothing written",
    state="the group failed: every later call on it (and a DDP step, a hook bucket) raises at once",
)
def test_killed_peer_mid_call_is_reported_at_once(tmp_path: Path, reliability: Reliability) -> None:
    """The group's timeout is 30 minutes and SWITCHAGG_TIMEOUT 10 s: a rank SIGKILLed while the
    others are in an allreduce is reported by its number as soon as its liveness connection ends
    (docs/TORCH.md, Slow peers, gone peers), on the backend's group and on a hook state's."""
    n = 3
    procs = launch("killed_peer", n, tmp_path, PG_TIMEOUT="1800")
    _wait_for_files(procs, [tmp_path / f"ready{r}" for r in range(n)], "reach the first allreduce")
    _wait_for_files(procs, [tmp_path / f"calling{r}" for r in range(n - 1)], "start the second allreduce")
    time.sleep(0.5)  # the call is on the wire, waiting for the last rank
    victim = procs[-1].proc
    killed_at = time.time()
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=HANG_GUARD)
    results = finish(procs[:-1])
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
        r = read(tmp_path, rank)
        assert r["first_ok"]
        assert r["error"] == "SwitchaggPeerGone", r
        assert r["is_switchagg_error"]
        assert f"rank {n - 1} is gone" in r["message"], r["message"]
        after = r["failed_at"] - killed_at
        print(f"rank {rank}: the killed rank reported {after:.2f} s after SIGKILL: {r['message']}")
        assert after < 10  # the old heartbeat took SWITCHAGG_TIMEOUT (10 s) plus a beat
        # A DDP step afterwards raises in backward(), with the error itself (it once crashed the process).
        assert r["ddp_error"] == "SwitchaggPeerGone" and r["ddp_message"], r
        # The hook's own watch saw the death too: its bucket fails at once, naming the rank (DDP's
        # reducer raises a hook's failed future as a RuntimeError with its message).
        assert r["hook_error"] is not None and f"rank {n - 1} is gone" in r["hook_message"], r
        print(f"rank {rank}: the hook's bucket failed after {r['hook_seconds']:.2f} s")
        assert r["hook_seconds"] < 10
    slowest = max(read(tmp_path, rank)["failed_at"] for rank in range(n - 1)) - killed_at
    reliability.record(recovery_s=slowest, recovery="the liveness connection's end, plus a 0.5 s grace")


@pytest.mark.parametrize(("stall", "victim"), [("sigstop", 0), ("sigstop", 2), ("gil", 0), ("gil", 2)])
@pytest.mark.reliability(
    "worker stalled",
    "torch backend: rank {victim} of 3 stalled 6 s by {stall} (SIGSTOP, or one C call keeping the GIL) while "
    "the others are in an allreduce, SWITCHAGG_TIMEOUT 2 s, the group's timeout 30 s, loopback",
    sums=3,
    outcome="exact",
    recovery="none needed: the others wait out the stall, as on gloo",
    state="nothing: the group goes on",
)
def test_stalled_peer_is_waited_for(tmp_path: Path, stall: str, victim: int) -> None:
    """A live rank stalled for 6 s (SIGSTOP, or one C call that keeps the GIL), with SWITCHAGG_TIMEOUT
    2 s and the group's timeout 30 s, while the others are in an allreduce: as on gloo, every rank's
    call completes with the right sum. Rank 0 serves the store, the aggregator and the relays."""
    n, seconds = 3, 6
    env = {"PG_TIMEOUT": "30", "SWITCHAGG_TIMEOUT": "2", "STALL": stall, "STALL_RANK": str(victim)}
    procs = launch("stalled_peer", n, tmp_path, STALL_SECONDS=str(seconds), **env)
    _wait_for_files(procs, [tmp_path / f"ready{r}" for r in range(n)], "reach the first allreduce")
    if stall == "sigstop":
        os.kill(procs[victim].proc.pid, signal.SIGSTOP)
    (tmp_path / "go").write_text("")
    if stall == "sigstop":
        time.sleep(seconds)
        os.kill(procs[victim].proc.pid, signal.SIGCONT)
    for rank, (code, err) in enumerate(finish(procs)):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    for rank in range(n):
        r = read(tmp_path, rank)
        assert r["error"] is None and r["ok"], r
        print(f"rank {rank}: the call took {r['seconds']:.1f} s")
        if rank != victim:
            assert r["seconds"] >= seconds / 2  # it did wait across the stall


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


# What each case's message must say, per rank (lab/switchagg_lab/testing/torch_worker.py, MISMATCHES);
# a rank's description ends at ";" (the next rank) or " (" (what the data plane said).
USER_TERMS = {
    "bits": ("rank 0: SUM of float32 [1047552] in 16-bit lanes;", "rank 1: SUM of float32 [1047552];"),
    "hook_bits": ("rank 1: AVG of float32 [50000] in 8-bit lanes;", "rank 0: AVG of float32 [50000];"),
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
    "coalesced list against one tensor, the DDP hook on bfloat16 against float32, a lane width of its own "
    "(SWITCHAGG_WIRE_BITS, the hook's bits); 1 and 3 lanes, loopback",
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
    call, on 1 and 3 lanes (where a user's chunks go to different lanes). Also a rank whose lanes are
    narrower (SWITCHAGG_WIRE_BITS=16 on rank 0 alone, a hook state with bits=8 on rank 1 alone):
    the wire refuses it too, and the message says which lanes."""
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
        assert r["ddp_hook_max_diff"] <= r["ddp_hook_bound"]
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
        assert r["ddp_backend_max_diff"] <= r["ddp_bound"] and r["ddp_hook_max_diff"] <= r["ddp_hook_bound"]
    for r in results[:2]:
        assert r["aggregated"] > 0 and r["dropped"] == 0, r


def test_more_shards_than_ranks_is_refused(tmp_path: Path) -> None:
    for rank, (code, err) in enumerate(finish(launch("bad_aggregator", 2, tmp_path, SWITCHAGG_SHARDS="3"))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
        r = read(tmp_path, rank)
        assert r["error"] == "ValueError" and "SWITCHAGG_SHARDS='3' must be within [0, 2]" in r["message"], r


@pytest.mark.parametrize("n", [2, 3])
def test_torch_comm_hooks_run_on_the_switchagg_group(tmp_path: Path, n: int) -> None:
    """torch's own DDP comm hooks on a switchagg group (several buckets): allreduce, fp16_compress and
    PowerSGD (ranks 1, 2, 4; warm start and not; error feedback and not), whose callbacks make more
    collectives and wait for them, run and match the same hooks on gloo; so does a future callback that
    waits for a second collective (issue 43: it hung on the thread that had to complete it)."""
    for rank, (code, err) in enumerate(finish(launch("hooks", n, tmp_path))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    hooks = ["allreduce", "fp16_compress", "powersgd_rank1", "powersgd_rank2_cold"]
    hooks.append("powersgd_rank4_no_feedback")
    for r in [read(tmp_path, rank) for rank in range(n)]:
        assert r["nested"] == [sum(range(1, n + 1))] * 2
        for name in hooks:
            got = r[name]
            assert got["replicas_equal"], name
            # float32 through the network, fp16 on both: the same training within a small relative error
            assert got["max_diff"] <= 1e-3 * max(1.0, got["scale"]), (name, got)
        assert r["stats"]["network"]["allreduce"] > 0
