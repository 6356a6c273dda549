"""One rank of a torch.distributed job on the "switchagg" backend, for tests/test_torch_*.py.

    python -m switchagg_lab.testing.torch_worker SCENARIO OUT_DIR     (RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

Each rank writes OUT_DIR/rankR.json with what it observed; the test does the asserting.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import gc
import json
import math
import os
import signal
import socket
import sys
import time
import warnings
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import switchagg
import switchagg.torch as satorch
from switchagg import protocol
from switchagg.torch import backend_of, precision, widths
from switchagg_lab.testing.checks import block_exponents

K = protocol.DEFAULT_SW_K
CAP_MB = 0.25  # DDP bucket cap: two buckets from the second backward on, two works in flight


def rank_input(rank: int, size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank r's input; every rank can rebuild every other rank's, for the exact reference."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if dtype == torch.int32:
        return torch.randint(-(2**20), 2**20, (size,), generator=g, dtype=torch.int32)
    # Magnitudes spread over many binades so blocks get different exponents.
    scale = torch.pow(2.0, torch.randint(-12, 12, (size,), generator=g).float())
    return (torch.randn(size, generator=g) * scale).float()


def network_allreduces(pg: Any) -> int:
    return int(backend_of(pg).data_plane.stats()["allreduces"])  # summed over the lanes


def check_sums(pg: Any, rank: int, n: int) -> dict[str, Any]:
    gloo = backend_of(pg).gloo
    out: dict[str, Any] = {}
    before = network_allreduces(pg)

    size = 3 * K + 17  # several chunks and a padded last one
    t = rank_input(rank, size, torch.int32, 1)
    ref = t.clone()
    dist.all_reduce(t)
    gloo.allreduce([ref]).wait()
    exact = torch.stack([rank_input(r, size, torch.int32, 1).long() for r in range(n)]).sum(0).int()
    out["int32_equal_gloo"] = bool(torch.equal(t, ref))
    out["int32_equal_exact"] = bool(torch.equal(t, exact))

    f = rank_input(rank, size, torch.float32, 2)
    fref = f.clone()
    dist.all_reduce(f)
    gloo.allreduce([fref]).wait()
    exact64 = torch.stack([rank_input(r, size, torch.float32, 2).double() for r in range(n)]).sum(0).numpy()
    bound = call_bound(pg, [rank_input(r, size, torch.float32, 2) for r in range(n)], exact64)
    # gloo's own float32 sum is off the exact one by a few ulps of the block maximum.
    out["float32_within_bound_exact"] = bool(np.all(np.abs(f.numpy() - exact64) <= bound))
    out["float32_within_bound_gloo"] = bool(np.all(np.abs(f.numpy() - fref.numpy()) <= 2 * bound))
    out["float32_max_rel_err"] = float(np.max(np.abs(f.numpy() - exact64) / bound))
    out["float32_differs_from_input"] = not bool(torch.equal(f, rank_input(rank, size, torch.float32, 2)))

    # A list with a non-contiguous member is coalesced into one network allreduce.
    a = torch.full((4, 3), float(rank + 1)).t()
    b = torch.full((5,), float(10 * (rank + 1)))
    pg.allreduce([a, b]).wait()
    tri = n * (n + 1) / 2
    out["list_ok"] = bool(
        torch.equal(a, torch.full((3, 4), tri)) and torch.equal(b, torch.full((5,), 10 * tri))
    )
    out["network_allreduces"] = network_allreduces(pg) - before

    # Async: the work's future completes from the session thread.
    c = torch.full((100,), float(rank))
    work = dist.all_reduce(c, async_op=True)
    assert work is not None
    value = work.get_future().wait()
    out["async_ok"] = bool(torch.equal(value[0], torch.full((100,), tri - n)))
    out.update(check_pinned(pg, rank))
    return out


def check_pinned(pg: Any, rank: int) -> dict[str, Any]:
    """The embedded aggregator pinned every rank's address: a well-formed DATA packet for a valid
    rank from a foreign socket is dropped as spoofed (rank 0 runs the aggregator and tries)."""
    plane = backend_of(pg).data_plane
    if rank != 0:
        return {"pinned": True}
    aggregator = plane.aggregator
    assert aggregator is not None  # rank 0 hosts it
    before = aggregator.counters()["drops"]["spoofed"]
    packet = protocol.Header(job=1, rank=1, slot=0, values=[7] * plane.session.k).pack()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as foreign:
        foreign.sendto(packet, plane.session.aggregator)
    deadline = time.monotonic() + 10
    while aggregator.counters()["drops"]["spoofed"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"pinned": aggregator.counters()["drops"]["spoofed"] == before + 1}


def lane_width(pg: Any, dtype: torch.dtype) -> int:
    """The lanes the group sends a tensor of ``dtype`` in (SWITCHAGG_WIRE_BITS, else the dtype's)."""
    return widths.lane_bits(dtype, backend_of(pg).data_plane.wire_bits)


def call_bound(pg: Any, inputs: list[torch.Tensor], exact: Any, average: bool = False) -> np.ndarray:
    """precision.error_bound per element of one network call of every rank's ``inputs`` (one tensor
    each, in the order the call flattens them), in the lanes the group sends them in."""
    bits = lane_width(pg, inputs[0].dtype)
    per_packet = backend_of(pg).data_plane.lanes.values_per_packet(bits)
    peak = np.max([x.float().abs().reshape(-1).numpy() for x in inputs], axis=0)
    e_max = block_exponents(peak, per_packet, bits)
    return np.asarray(precision.error_bound(inputs[0].dtype, len(inputs), e_max, exact, average, bits))


def precision_case(
    pg: Any, rank: int, n: int, dtype: torch.dtype, average: bool, seed: int
) -> dict[str, Any]:
    """One network allreduce of `dtype` against the float64 sum (or mean) and gloo's: the worst error
    over the documented bound (precision.error_bound at the group's lane width), and gloo's own worst
    error, for the report."""
    size = 3 * K + 17
    scale = 1 / 16 if dtype == torch.float16 else 1.0  # float16 tops out at 65504
    inputs = [(rank_input(r, size, torch.float32, seed) * scale).to(dtype) for r in range(n)]
    exact = torch.stack([x.double() for x in inputs]).sum(0).numpy()
    if average:
        exact = exact / n
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    mine, theirs = inputs[rank].clone(), inputs[rank].clone()
    dist.all_reduce(mine, op=op)
    backend_of(pg).gloo.allreduce([theirs], _avg_opts() if average else dist.AllreduceOptions()).wait()
    bound = call_bound(pg, inputs, exact, average)
    err = np.abs(mine.double().numpy() - exact)
    gloo_err = np.abs(theirs.double().numpy() - exact)
    return {
        "bits": lane_width(pg, dtype),
        "worst_over_bound": float(np.max(err / bound)),
        "max_err": float(err.max()),
        "gloo_max_err": float(gloo_err.max()),
    }


def _avg_opts() -> Any:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]  # c10d converts the RedOpType
    return opts


def check_precision(pg: Any, rank: int, n: int) -> dict[str, Any]:
    """SUM and AVG of float32, bfloat16 and float16 in the network, and a bfloat16 list coalesced."""
    before = backend_of(pg).stats()["network"].get("allreduce", 0)
    cases = {}
    for i, (dtype, average) in enumerate(
        [(d, a) for d in (torch.float32, torch.bfloat16, torch.float16) for a in (False, True)]
    ):
        name = f"{str(dtype).removeprefix('torch.')}_{'avg' if average else 'sum'}"
        cases[name] = precision_case(pg, rank, n, dtype, average, 10 + i)
    a = torch.full((4, 3), float(rank + 1), dtype=torch.bfloat16).t()
    b = torch.full((5,), float(10 * (rank + 1)), dtype=torch.bfloat16)
    pg.allreduce([a, b], _avg_opts()).wait()
    mean = (n + 1) / 2
    got = torch.cat([a.reshape(-1), b]).double().numpy()
    want = np.r_[np.full(12, mean), np.full(5, 10 * mean)]
    parts = [torch.cat([torch.full((12,), r + 1.0), torch.full((5,), 10.0 * (r + 1))]) for r in range(n)]
    exact_in_32 = lane_width(pg, torch.bfloat16) != 32 or np.array_equal(got, want)  # small integers
    return {
        "precision": cases,
        "bf16_list_avg_ok": exact_in_32
        and bool(np.all(np.abs(got - want) <= call_bound(pg, [p.bfloat16() for p in parts], want, True))),
        "precision_network_calls": backend_of(pg).stats()["network"].get("allreduce", 0) - before,
    }


def check_more_groups(pg: Any, rank: int, n: int) -> dict[str, Any]:
    """allreduce_coalesced, and a switchagg subgroup with its own embedded aggregator."""
    out: dict[str, Any] = {}
    before = network_allreduces(pg)
    ts = [
        torch.full((3,), rank + 1, dtype=torch.int32),
        torch.full((2, 2), 2 * (rank + 1), dtype=torch.int32),
    ]
    pg.allreduce_coalesced(ts).wait()
    tri = n * (n + 1) // 2
    out["coalesced_ok"] = ts[0].tolist() == [tri] * 3 and ts[1].tolist() == [[2 * tri] * 2] * 2
    out["coalesced_network_allreduces"] = network_allreduces(pg) - before
    members = [0, n - 1]
    sub = dist.new_group(members, backend="switchagg")  # collective over all ranks, even non-members
    if rank in members:
        x = torch.full((5,), float(rank))
        dist.all_reduce(x, group=sub)
        out["subgroup_ok"] = x.tolist() == [float(n - 1)] * 5
        own = backend_of(sub).data_plane.session is not backend_of(pg).data_plane.session
        out["subgroup_own_session"] = own
        out["subgroup_network_allreduces"] = network_allreduces(sub)
    else:
        out["subgroup_ok"] = out["subgroup_own_session"] = True
        out["subgroup_network_allreduces"] = 1
    return out


def check_delegated(pg: Any, rank: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    before = network_allreduces(pg)
    m = torch.tensor([rank, -rank], dtype=torch.int32)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["max_ok"] = m.tolist() == [n - 1, 0]
    d = torch.full((3,), 0.25 * rank, dtype=torch.float64)
    dist.all_reduce(d)
    out["float64_ok"] = d.tolist() == [0.25 * (n * (n - 1) / 2)] * 3
    out["delegated_network_allreduces"] = network_allreduces(pg) - before

    bc = torch.full((6,), float(rank))
    dist.broadcast(bc, src=n - 1)
    out["broadcast_ok"] = bool(torch.equal(bc, torch.full((6,), float(n - 1))))
    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(gathered, torch.tensor([rank, rank * rank]))
    out["allgather_ok"] = [g.tolist() for g in gathered] == [[r, r * r] for r in range(n)]
    objs: list[Any] = [None] * n
    dist.all_gather_object(objs, {"rank": rank})
    out["allgather_object_ok"] = objs == [{"rank": r} for r in range(n)]
    dist.barrier()
    out["barrier_ok"] = True
    out["backend_name"] = dist.get_backend()
    return out


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 1.5 MB of parameters: more than DDP's 1 MB first bucket, so a small cap splits them.
    layers = [torch.nn.Linear(32, 512), torch.nn.Tanh(), torch.nn.Linear(512, 700), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(700, 7))


def grads(ddp: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    # Twice: DDP puts everything in one bucket on the first backward and rebuilds buckets to
    # bucket_cap_mb after it; the weights do not change, so both passes give the same gradients.
    for _ in range(2):
        ddp.zero_grad()
        ddp(x).pow(2).sum().backward()
    return [p.grad.detach().clone() for p in ddp.parameters() if p.grad is not None]


def ddp_bounds(pg: Any, n: int, peak: float) -> tuple[float, float]:
    """Bounds on |network - gloo| for DDP's averaged float32 gradients, on the backend and with the hook
    (which has error feedback by default in 8-bit lanes), E from the largest local gradient ``peak``:
    the sum's bound plus gloo's own rounding. With error feedback the hook sends x + r, |r| under a
    step of the last call: E one higher covers the larger block and the step left in the residual."""
    bits = lane_width(pg, torch.float32)
    e = math.frexp(peak)[1]
    bound = 2 * protocol.lane_error_bound(n, e, bits)
    feedback = bits != 32 and widths.feedback_default(bits)
    return bound, 2 * protocol.lane_error_bound(n, e + 1, bits) if feedback else bound


def check_ddp(pg: Any, rank: int, n: int) -> dict[str, Any]:
    """DDP on the switchagg group and with the hook on a gloo group, against DDP on gloo."""
    gloo_group = dist.new_group(backend="gloo")
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    reference = grads(DDP(make_model(), process_group=gloo_group, bucket_cap_mb=CAP_MB), x)

    # Bound on |network - gloo| for the averaged gradients: E from the largest local value.
    local = grads(make_model(), x)
    peak = torch.tensor([max(g.abs().max().item() for g in local)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=gloo_group)
    bound, hook_bound = ddp_bounds(pg, n, peak.item())

    before = network_allreduces(pg)
    on_switchagg = DDP(make_model(), process_group=pg, bucket_cap_mb=CAP_MB)
    backend = grads(on_switchagg, x)
    backend_calls = network_allreduces(pg) - before
    logged = on_switchagg._get_ddp_logging_data()  # what torch's test_ddp_logging_data_cpu reads

    state = satorch.SwitchaggHookState(gloo_group)
    hooked = DDP(make_model(), process_group=gloo_group, bucket_cap_mb=CAP_MB)
    hooked.register_comm_hook(state, satorch.allreduce_hook)
    hooked_grads = grads(hooked, x)
    hook_calls = int(state.plane.stats()["allreduces"]) if state.plane else 0
    state.close()
    # A closed state is not kept alive until exit (its atexit registration did; DDP's reducer
    # keeps the state it was given, so this one is not given to DDP).
    spare = satorch.SwitchaggHookState(gloo_group)
    spare.close()
    spare_ref = weakref.ref(spare)
    del spare
    gc.collect()

    def max_diff(gs: list[torch.Tensor]) -> float:
        return max((a - b).abs().max().item() for a, b in zip(gs, reference, strict=True))

    # float64 gradients fall back to gloo: counted, and warned about once however many buckets.
    fallback = satorch.SwitchaggHookState(gloo_group)
    doubled = DDP(make_model().double(), process_group=gloo_group, bucket_cap_mb=CAP_MB)
    doubled.register_comm_hook(fallback, satorch.allreduce_hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads(doubled, x.double())
    fallback_stats = fallback.stats()
    fallback.close()
    hook_stats = state.stats()

    return {
        "ddp_logged_backend_name": logged.get("backend_name"),
        "group_backend_names": [pg.name(), dist.get_backend(pg)],
        "ddp_backend_max_diff": max_diff(backend),
        "ddp_hook_max_diff": max_diff(hooked_grads),
        "ddp_bound": bound,
        "ddp_hook_bound": hook_bound,
        "ddp_backend_network_allreduces": backend_calls,
        "ddp_hook_network_allreduces": hook_calls,
        "ddp_grads_nonzero": bool(max(g.abs().max().item() for g in reference) > 0),
        "hook_state_freed_after_close": spare_ref() is None,
        "hook_stats": hook_stats,
        "fallback_stats": fallback_stats,
        "fallback_warnings": [str(w.message) for w in caught if "fall back" in str(w.message)],
    }


def other_width(pg: Any) -> int:
    """A lane width for float32 other than the group's: what a hook asks for of its own."""
    return 8 if lane_width(pg, torch.float32) != 8 else 16


def check_hook_bits(pg: Any, rank: int, n: int) -> dict[str, Any]:
    """A hook state whose buckets travel in lanes of their own width (other_width, with its default
    error feedback), given the three ways docs/TORCH.md names: the state's ``bits``, the hook wrapped
    by functools.update_wrapper(functools.partial(...)), and a hook of the caller's that passes
    ``bits`` on (it also records each bucket's size per pass: DDP rebuilds them after the first). A
    bare functools.partial is refused by DDP itself (it reads the hook's __qualname__)."""
    bits = other_width(pg)
    gloo_group = dist.new_group(backend="gloo")
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    reference = grads(DDP(make_model(), process_group=gloo_group, bucket_cap_mb=CAP_MB), x)
    seen: list[tuple[int, int]] = []

    # Unannotated: this module's annotations are strings (__future__), which DDP's check refuses.
    def own(state, bucket):  # noqa: ANN001
        seen.append((bucket.index(), bucket.buffer().numel()))
        return satorch.allreduce_hook(state, bucket, bits=bits)

    wrapped = functools.update_wrapper(
        functools.partial(satorch.allreduce_hook, bits=bits), satorch.allreduce_hook
    )
    forms: dict[str, tuple[satorch.SwitchaggHookState, Any]] = {
        "state": (satorch.SwitchaggHookState(gloo_group, bits=bits), satorch.allreduce_hook),
        "update_wrapper": (satorch.SwitchaggHookState(gloo_group), wrapped),
        "own_hook": (satorch.SwitchaggHookState(gloo_group), own),
    }
    out: dict[str, Any] = {"hook_bits": bits, "hook_forms": {}}
    for name, (state, hook) in forms.items():
        ddp = DDP(make_model(), process_group=gloo_group, bucket_cap_mb=CAP_MB)
        ddp.register_comm_hook(state, hook)
        got = grads(ddp, x)
        diff = max((a - b).abs().max().item() for a, b in zip(got, reference, strict=True))
        residuals = state.feedback.sizes()
        out["hook_forms"][name] = {"max_diff": diff, "bytes": state.stats()["bytes"], "residuals": residuals}
        state.close()
    out["own_hook_buckets"] = seen
    try:
        DDP(make_model(), process_group=gloo_group).register_comm_hook(
            forms["state"][0], functools.partial(satorch.allreduce_hook, bits=bits)
        )
        out["bare_partial_error"] = None
    except Exception as e:
        out["bare_partial_error"] = f"{type(e).__name__}: {e}"
    local = grads(make_model(), x)
    peak = torch.tensor([max(g.abs().max().item() for g in local)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=gloo_group)
    out["hook_bits_bound"] = 2 * protocol.lane_error_bound(n, math.frexp(peak.item())[1] + 1, bits)
    return out


def scrape_worker_metrics(pg: Any, *names: str) -> dict[str, list[str]]:
    """Per metric name, its lines in this process's worker metrics (SWITCHAGG_METRICS_PORT)."""
    import urllib.request

    address = backend_of(pg).data_plane.session.metrics_address
    if address is None:
        return {name: [] for name in names}
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=30) as page:
        lines = page.read().decode().splitlines()
    return {name: [line for line in lines if line.startswith(name + "{")] for name in names}


def scenario_collectives(rank: int, n: int, out_dir: Path) -> None:
    dist.init_process_group("switchagg")
    pg: Any = dist.group.WORLD
    result: dict[str, Any] = {
        "type": type(backend_of(pg)).__name__,
        "backends": {d.type: pg._get_backend(d).name() for d in pg._device_types},
    }
    result.update(check_sums(pg, rank, n))
    result.update(check_precision(pg, rank, n))
    result.update(check_delegated(pg, rank, n))
    result.update(check_more_groups(pg, rank, n))
    result.update(check_ddp(pg, rank, n))
    result["stats"] = backend_of(pg).stats()
    scraped = scrape_worker_metrics(pg, "switchagg_torch_calls_total", "switchagg_worker_lane_bytes_total")
    result["metrics"] = scraped["switchagg_torch_calls_total"]
    result["lane_bytes"] = scraped["switchagg_worker_lane_bytes_total"]
    dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def scenario_widths(rank: int, n: int, out_dir: Path) -> None:
    """SWITCHAGG_WIRE_BITS on every rank: SUM and AVG of float32, bfloat16 and float16 within the
    bound of that width, DDP (backend and hook, the hook with its default error feedback) against
    gloo, a hook with a width of its own, and the bytes per lane width in stats() and the log."""
    dist.init_process_group("switchagg")
    pg: Any = dist.group.WORLD
    result: dict[str, Any] = {"wire_bits": backend_of(pg).data_plane.wire_bits}
    result.update(check_precision(pg, rank, n))
    result.update(check_ddp(pg, rank, n))
    result.update(check_hook_bits(pg, rank, n))
    result["stats"] = backend_of(pg).stats()
    dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()  # the group logs its bytes per lane width as it closes


def _wait_for(path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path.name} from the test")
        time.sleep(0.02)


def scenario_killed_peer(rank: int, n: int, out_dir: Path) -> None:
    """The last rank parks after one allreduce; the others start a second one and say so, and the
    test SIGKILLs the last rank mid-call. The group's timeout is long (PG_TIMEOUT s): the liveness
    connections report the dead rank first. Then a DDP step on the group, and a hook state made
    before the kill, fail at once too."""
    timeout = timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "1800")))
    dist.init_process_group("switchagg", timeout=timeout)
    ddp = DDP(make_model(), bucket_cap_mb=CAP_MB)  # built while every rank lives (it broadcasts)
    gloo_group = dist.new_group(backend="gloo")
    state = satorch.SwitchaggHookState(gloo_group)
    hooked = DDP(make_model(), process_group=gloo_group, bucket_cap_mb=CAP_MB)
    hooked.register_comm_hook(state, satorch.allreduce_hook)
    t = torch.ones(K + 5)
    dist.all_reduce(t)
    (out_dir / f"ready{rank}").write_text(str(os.getpid()))
    if rank == n - 1:
        _wait_for(out_dir / "never", 120)  # the test kills this rank
        return
    result: dict[str, Any] = {"first_ok": bool(torch.equal(t, torch.full((K + 5,), float(n))))}
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(K + 5), async_op=True)
    assert work is not None
    (out_dir / f"calling{rank}").write_text("")
    try:
        work.wait()
        result["error"] = None
    except Exception as e:  # the session's timeout reaches the caller through the Work
        result["error"] = type(e).__name__
        result["message"] = str(e)
        result["is_switchagg_error"] = isinstance(e, switchagg.SwitchaggError)
    result["failed_at"] = time.time()  # the test compares it with when it sent SIGKILL
    result["seconds"] = time.monotonic() - start
    # DDP's reducer reads the failed future in C++: a clear error, not a crash of the process.
    try:
        ddp(torch.randn(4, 32)).sum().backward()
        result["ddp_error"] = None
    except Exception as e:
        result["ddp_error"] = type(e).__name__
        result["ddp_message"] = str(e)
    start = time.monotonic()
    try:
        hooked(torch.randn(4, 32)).sum().backward()
        result["hook_error"] = None
    except Exception as e:
        result["hook_error"] = type(e).__name__
        result["hook_message"] = str(e)
    result["hook_seconds"] = time.monotonic() - start
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:  # rank 0 serves the store: leaving first would show the others "store unreachable"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            (out_dir / f"rank{r}.json").exists() for r in range(n - 1)
        ):
            time.sleep(0.05)


def scenario_stalled_peer(rank: int, n: int, out_dir: Path) -> None:
    """Rank STALL_RANK stalls STALL_SECONDS (longer than SWITCHAGG_TIMEOUT, shorter than the group's
    PG_TIMEOUT) while the others are in an allreduce: STALL=gil holds the GIL in one C call
    (ctypes.PyDLL keeps it); STALL=sigstop: the test stops and continues the process. Every rank's
    call must complete with the right sum."""
    dist.init_process_group("switchagg", timeout=timedelta(seconds=float(os.environ["PG_TIMEOUT"])))
    victim = int(os.environ["STALL_RANK"])
    t = torch.ones(K + 5)
    dist.all_reduce(t)
    (out_dir / f"ready{rank}").write_text(str(os.getpid()))
    _wait_for(out_dir / "go")
    if rank == victim and os.environ["STALL"] == "gil":
        libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held through the call
        libc.sleep(int(os.environ["STALL_SECONDS"]))
    size = 2 * K + 3
    x = torch.full((size,), float(rank + 1))
    result = timed_allreduce(x)
    result["ok"] = bool(torch.equal(x, torch.full((size,), float(n * (n + 1) // 2))))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if result["error"] is None:
        dist.barrier()


def timed_allreduce(t: torch.Tensor, group: Any = None) -> dict[str, Any]:
    start = time.monotonic()
    try:
        dist.all_reduce(t, group=group)
        out: dict[str, Any] = {"error": None}
    except Exception as e:
        out = {"error": type(e).__name__, "message": str(e)}
    out["seconds"] = time.monotonic() - start
    return out


def scenario_paused_peer(rank: int, n: int, out_dir: Path) -> None:
    """init_process_group(timeout=PG_TIMEOUT s): the last rank pauses PAUSE s (an evaluation, a
    checkpoint) before an allreduce of the backend, then before a DDP backward with the hook; the
    others wait in the network meanwhile. With a pause under the group's timeout every call completes;
    over it, the waiting ranks fail after the group's timeout, not SWITCHAGG_TIMEOUT."""
    pause = float(os.environ["PAUSE"])
    dist.init_process_group("switchagg", timeout=timedelta(seconds=float(os.environ["PG_TIMEOUT"])))
    pg: Any = dist.group.WORLD
    result: dict[str, Any] = {}
    t = torch.ones(K + 5)
    dist.all_reduce(t)  # every rank is up
    if rank == n - 1:
        time.sleep(pause)
    t = torch.full((2 * K + 3,), float(rank))
    result["backend"] = timed_allreduce(t)
    result["backend"]["ok"] = bool(torch.equal(t, torch.full((2 * K + 3,), float(n * (n - 1) // 2))))
    if os.environ.get("HOOK_PAUSE"):
        gloo_group = dist.new_group(backend="gloo")
        state = satorch.SwitchaggHookState(gloo_group)
        ddp = DDP(make_model(), process_group=gloo_group, bucket_cap_mb=CAP_MB)
        ddp.register_comm_hook(state, satorch.allreduce_hook)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
        if rank == n - 1:
            time.sleep(float(os.environ["HOOK_PAUSE"]))
        start = time.monotonic()
        try:
            ddp(x).pow(2).sum().backward()
            result["hook"] = {"error": None}
        except Exception as e:
            result["hook"] = {"error": type(e).__name__, "message": str(e)}
        result["hook"]["seconds"] = time.monotonic() - start
        result["hook"]["network"] = state.stats()["network"].get("allreduce", 0)
    result["stats"] = backend_of(pg).stats()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if result["backend"]["error"] is None:
        dist.barrier()


def scenario_bind(rank: int, n: int, out_dir: Path) -> None:
    """MASTER_ADDR is this host's routed address, SWITCHAGG_BIND unset: the aggregator listens there."""
    dist.init_process_group("switchagg")
    pg: Any = dist.group.WORLD
    t = torch.full((K + 3,), rank + 1, dtype=torch.int32)
    dist.all_reduce(t)
    session = backend_of(pg).data_plane.session
    result = {
        "ok": bool(torch.equal(t, torch.full((K + 3,), n * (n + 1) // 2, dtype=torch.int32))),
        "aggregator": list(session.aggregator),
        "worker": list(session.local_address),
    }
    dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def scenario_cuda(rank: int, n: int, out_dir: Path) -> None:
    """CUDA tensors (tests/test_torch_setup.py, where a GPU is present): sums and DDP, backend and hook."""
    dist.init_process_group("switchagg")
    pg: Any = dist.group.WORLD
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            t = torch.full((3 * K + 5,), float(rank + 1), dtype=dtype, device=device)
            dist.all_reduce(t, op=op)
            want = n * (n + 1) / 2 / (n if op == dist.ReduceOp.AVG else 1)
            ok = (
                ok
                and t.device == device
                and bool(torch.allclose(t.float(), torch.full_like(t.float(), want)))
            )
    gloo_group = dist.new_group(backend="gloo")
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank)).to(device)

    def cuda_grads(group: Any, hook: Any = None) -> list[torch.Tensor]:
        model = make_model().to(device)
        ddp = DDP(model, device_ids=[device], process_group=group, bucket_cap_mb=CAP_MB)
        if hook is not None:
            ddp.register_comm_hook(hook, satorch.allreduce_hook)
        return [g.cpu() for g in grads(ddp, x)]

    reference = cuda_grads(gloo_group)
    before = backend_of(pg).stats()["network"].get("allreduce", 0)
    backend = cuda_grads(pg)
    state = satorch.SwitchaggHookState(gloo_group)
    hooked = cuda_grads(gloo_group, state)
    local = grads(make_model().to(device), x)
    peak = torch.tensor([max(g.abs().max().item() for g in local)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=gloo_group)
    bound = 2 * protocol.error_bound(n, math.frexp(peak.item())[1])

    def max_diff(gs: list[torch.Tensor]) -> float:
        return max((a - b).abs().max().item() for a, b in zip(gs, reference, strict=True))

    result = {
        "sums_ok": ok,
        "network_calls": backend_of(pg).stats()["network"].get("allreduce", 0),
        "ddp_backend_network": backend_of(pg).stats()["network"].get("allreduce", 0) - before,
        "ddp_backend_max_diff": max_diff(backend),
        "ddp_hook_max_diff": max_diff(hooked),
        "ddp_bound": bound,
        "hook_network": state.stats()["network"].get("allreduce", 0),
        "hook_delegated": state.stats()["delegated"].get("allreduce", 0),
    }
    dist.barrier()
    state.close()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def scenario_job_service(rank: int, n: int, out_dir: Path) -> None:
    """SWITCHAGG_JOB_SERVICE is set: the ranks join through the controller, no embedded aggregator."""
    dist.init_process_group("switchagg")
    pg: Any = dist.group.WORLD
    plane = backend_of(pg).data_plane
    t = rank_input(rank, 2 * K + 3, torch.int32, 3)
    dist.all_reduce(t)
    exact = torch.stack([rank_input(r, 2 * K + 3, torch.int32, 3).long() for r in range(n)]).sum(0).int()
    # One more call per lane after the first: with lanes, each lane's job must carry it.
    extra = [torch.full((K + 1,), rank + 1, dtype=torch.int32) for _ in range(len(plane.lanes) - 1)]
    works = [dist.all_reduce(x, async_op=True) for x in extra]
    for w in works:
        assert w is not None
        w.wait()
    tri = n * (n + 1) // 2
    result = {
        "int32_equal_exact": bool(torch.equal(t, exact)) and all(bool((x == tri).all()) for x in extra),
        "lane_jobs": [s.assignment.job_id for s in plane.lanes.sessions],
        "network_allreduces": network_allreduces(pg) - len(extra),
        "embedded_aggregator": plane.aggregator is not None,
        "data_plane": plane.session.data_plane,
        "job_id": plane.session.assignment.job_id,
        "rank": plane.session.assignment.rank,
    }
    dist.barrier()
    backend_of(pg).close()  # leaves the job
    dist.barrier()  # gloo still works after the network side is closed
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def scenario_bad_aggregator(rank: int, n: int, out_dir: Path) -> None:
    """SWITCHAGG_BIND names no local address: every rank's init_process_group must raise."""
    try:
        dist.init_process_group("switchagg")
        result: dict[str, Any] = {"error": None}
    except Exception as e:
        result = {"error": type(e).__name__, "message": str(e)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:  # rank 0 serves the store: stay until the others have read what it published
        deadline = time.monotonic() + 60
        while not all((out_dir / f"rank{r}.json").exists() for r in range(n)) and time.monotonic() < deadline:
            time.sleep(0.05)


def scenario_stress(rank: int, n: int, out_dir: Path) -> None:
    """Delegated collectives interleaved with network allreduces in flight and DDP steps."""
    iterations = int(os.environ.get("STRESS_ITERATIONS", "200"))
    dist.init_process_group("switchagg")
    pg: Any = dist.group.WORLD
    ddp = DDP(make_model(), process_group=pg, bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    size = 2 * K + 5
    wrong: list[str] = []
    tri = n * (n - 1) // 2
    for it in range(iterations):
        t = torch.full((size,), it, dtype=torch.int32) + rank
        work = dist.all_reduce(t, async_op=True)  # in flight while gloo runs the delegated ones
        assert work is not None
        bc = torch.full((4,), float(rank))
        dist.broadcast(bc, src=it % n)
        gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(gathered, torch.tensor([rank, it]))
        objs: list[Any] = [None] * n
        dist.all_gather_object(objs, (rank, it))
        rs = torch.zeros(3)
        dist.reduce_scatter(rs, [torch.full((3,), float(rank + r)) for r in range(n)])
        dist.barrier()
        work.wait()
        s = torch.full((size,), it, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(s)
        if it % 10 == 0:
            opt.zero_grad()
            ddp(x).pow(2).sum().backward()
            opt.step()
        checks = {
            "network int32": torch.equal(t, torch.full((size,), n * it + tri, dtype=torch.int32)),
            "network float32": torch.allclose(s, torch.full((size,), float(it * n * (n + 1) // 2))),
            "broadcast": torch.equal(bc, torch.full((4,), float(it % n))),
            "all_gather": [g.tolist() for g in gathered] == [[r, it] for r in range(n)],
            "all_gather_object": objs == [(r, it) for r in range(n)],
            "reduce_scatter": torch.equal(rs, torch.full((3,), float(tri + n * rank))),
        }
        wrong += [f"iteration {it}: {name}" for name, good in checks.items() if not good]
    dist.barrier()
    result = {
        "iterations": iterations,
        "wrong": wrong[:20],
        "network_allreduces": network_allreduces(pg),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


# GradScaler parity (tests/test_torch_grad_scaler.py): a tiny model, SCALER_STEPS steps, and an
# overflow injected on some ranks only, before DDP's allreduce, at the steps below.
SCALER_STEPS = 12
SCALER_OVERFLOWS = {
    3: "one +Inf gradient element on rank 0",
    7: "the loss times Inf on the last rank (Inf and NaN gradients)",
    10: "+Inf on rank 0 and -Inf on rank 1 at the same gradient element (NaN in the sum)",
}
SCALER_LR = 0.05
SCALER_INIT_SCALE = 2.0**10
SCALER_GROWTH_INTERVAL = 3  # the scale grows as well as backs off within the run


def scaler_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _poke(value: float) -> Any:
    """A tensor hook: runs before the gradient is accumulated, so DDP's allreduce sees the value."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[5] = value
        return grad

    return hook


def train_with_scaler(ddp: torch.nn.Module, rank: int, n: int) -> dict[str, Any]:
    """SCALER_STEPS steps of DDP + GradScaler("cpu") without autocast: the scaler's unscale_,
    found_inf, skipped step and update are what is compared (a bfloat16 forward would turn the
    network's float32 rounding into bfloat16 rounding flips, so parameters could not be compared
    within the float32 bound)."""
    params = list(ddp.parameters())
    opt = torch.optim.SGD(params, lr=SCALER_LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALER_INIT_SCALE, growth_interval=SCALER_GROWTH_INTERVAL)
    # The largest local (scaled) gradient of each step, before the allreduce: the network's
    # block exponent, hence the error bound of the step's sum.
    peak = [0.0]

    def watch(grad: torch.Tensor) -> torch.Tensor:
        peak[0] = max(peak[0], grad.abs().max().item())
        return grad

    for p in params:
        p.register_hook(watch)
    target = params[0]  # the first layer's weight
    out: dict[str, list[Any]] = {"scales": [], "stepped": [], "finite": [], "peaks": []}
    for step in range(SCALER_STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
        injected = SCALER_OVERFLOWS.get(step, "")
        handles = []
        if injected.startswith("one +Inf") and rank == 0:
            handles.append(target.register_hook(_poke(math.inf)))
        if injected.startswith("+Inf on rank 0") and rank in (0, 1):
            handles.append(target.register_hook(_poke(math.inf if rank == 0 else -math.inf)))
        opt.zero_grad()
        peak[0] = 0.0
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if injected.startswith("the loss times Inf") and rank == n - 1:
            loss = loss * math.inf
        before = [p.detach().clone() for p in params]
        scaler.scale(loss).backward()
        for h in handles:
            h.remove()
        out["finite"].append(all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None))
        out["peaks"].append(peak[0])
        scaler.step(opt)
        scaler.update()
        out["stepped"].append(
            any(not torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True))
        )
        out["scales"].append(scaler.get_scale())
    out["params"] = torch.cat([p.detach().reshape(-1) for p in params]).tolist()
    return out


def scenario_grad_scaler(rank: int, n: int, out_dir: Path) -> None:
    """The same GradScaler run three ways: DDP on gloo (the baseline), DDP on the switchagg
    backend, and DDP on gloo with the switchagg comm hook."""
    dist.init_process_group("switchagg")
    pg: Any = dist.group.WORLD
    gloo_group = dist.new_group(backend="gloo")
    result: dict[str, Any] = {"overflows": sorted(SCALER_OVERFLOWS)}

    result["gloo"] = train_with_scaler(DDP(scaler_model(), process_group=gloo_group), rank, n)

    before = network_allreduces(pg)
    result["switchagg"] = train_with_scaler(DDP(scaler_model(), process_group=pg), rank, n)
    result["switchagg"]["network_allreduces"] = network_allreduces(pg) - before

    state = satorch.SwitchaggHookState(gloo_group)
    hooked = DDP(scaler_model(), process_group=gloo_group)
    hooked.register_comm_hook(state, satorch.allreduce_hook)
    result["hook"] = train_with_scaler(hooked, rank, n)
    result["hook"]["network_allreduces"] = int(state.plane.stats()["allreduces"]) if state.plane else 0
    dist.barrier()
    state.close()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


# The user's calls that must fail on every rank (tests/test_torch_backend.py, test_mismatched_calls_*):
# rank 1 makes the first, the other ranks the second. STAGED: one chunk of the stager (K = 16368).
STAGED = 1_047_552
MISMATCHES: dict[str, tuple[list[tuple[int, str, str]], list[tuple[int, str, str]]]] = {
    # (elements, dtype, op) per call; a list of lengths is one coalesced call
    "split": ([(200_000, "", "sum")], [(100_000, "", "sum"), (100_000, "", "sum")]),
    "staged_dtype": (
        [(2 * STAGED, "bfloat16", "sum")],
        [(STAGED, "float32", "sum"), (STAGED, "float32", "sum")],
    ),
    "dtype": ([(50_000, "float16", "sum")], [(50_000, "float32", "sum")]),
    "op": ([(50_000, "float32", "avg")], [(50_000, "float32", "sum")]),
}


def _mismatch_tensor(elements: int, dtype: str) -> torch.Tensor:
    if not dtype:  # MISMATCH_DTYPE's (the original split case runs with int32 and float32)
        dtype = "int32" if os.environ.get("MISMATCH_DTYPE") == "int32" else "float32"
    return torch.ones(elements, dtype=getattr(torch, dtype))


class FakeBucket:
    """What the hook reads of DDP's GradBucket, for a bucket of one's own."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self.tensor

    def index(self) -> int:
        return 0

    def parameters(self) -> list[torch.Tensor]:
        return []


def scenario_mismatched_calls(rank: int, n: int, out_dir: Path) -> None:
    """MISMATCH_CASE (default split): rank 1's user calls differ from the others' (MISMATCHES; also
    "coalesced": a list of two tensors against one of their total length, "hook": the DDP hook on a
    bfloat16 bucket against float32, "hook_bits": a hook state with bits=8 against the default;
    "bits": rank 0's SWITCHAGG_WIRE_BITS is 16, the others' unset): every rank must fail its call
    with what differed, in the user's terms, never return a partial sum as success."""
    case = os.environ.get("MISMATCH_CASE", "split")
    if case == "bits" and rank == 0:
        os.environ["SWITCHAGG_WIRE_BITS"] = "16"
    dist.init_process_group("switchagg")
    result: dict[str, Any] = {"case": case}
    try:
        if case == "coalesced":
            if rank == 1:
                dist.all_reduce_coalesced([torch.ones(3000), torch.ones(5000)])
            else:
                dist.all_reduce(torch.ones(8000))
        elif case in ("hook", "hook_bits"):
            gloo = dist.new_group(backend="gloo")
            state = satorch.SwitchaggHookState(gloo, bits=8 if case == "hook_bits" and rank == 1 else None)
            bucket = torch.ones(50_000, dtype=torch.bfloat16 if case == "hook" and rank == 1 else None)
            satorch.allreduce_hook(state, FakeBucket(bucket)).wait()  # type: ignore[arg-type]
        elif case == "bits":
            dist.all_reduce(torch.ones(STAGED))
        else:
            mine, theirs = MISMATCHES[case]
            for elements, dtype, op in mine if rank == 1 else theirs:
                reduce_op = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
                dist.all_reduce(_mismatch_tensor(elements, dtype), op=reduce_op)
        result["error"] = None
    except Exception as e:
        result.update(
            error=type(e).__name__, message=str(e), is_switchagg_error=isinstance(e, switchagg.SwitchaggError)
        )
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


# Lanes (tests/test_torch_backend.py, test_lanes_*): bucket-like calls of several sizes and dtypes,
# issued back to front as DDP issues its buckets, all in flight before the first is waited for.
LANE_CALLS = [
    (3 * K + 17, torch.int32, "sum"),
    (100, torch.float32, "sum"),
    (5 * K, torch.float32, "sum"),
    (1, torch.int32, "sum"),
    (2 * K + 3, torch.bfloat16, "avg"),
    (40_000, torch.int32, "sum"),
    (7, torch.float32, "avg"),
    (K, torch.float32, "sum"),
    (2 * K + 1, torch.int32, "sum"),  # a list of two tensors: staged, coalesced into one call
]


def _lane_inputs(rank: int, size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return rank_input(rank, size, torch.int32 if dtype == torch.int32 else torch.float32, seed).to(dtype)


def check_lane_calls(pg: Any, rank: int, n: int, rounds: int) -> dict[str, Any]:
    """Every round issues all LANE_CALLS asynchronously (the last first) and then waits: int32 sums
    exact, float sums (means) within precision.error_bound, on every call of every round."""
    wrong: list[str] = []
    worst = 0.0
    for rnd in range(rounds):
        pending = []
        for i, (size, dtype, op) in reversed(list(enumerate(LANE_CALLS))):
            seed = 1000 * rnd + i
            mine = _lane_inputs(rank, size, dtype, seed)
            reduce_op = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
            if i == len(LANE_CALLS) - 1:  # a list, one of it non-contiguous
                half = size // 2
                parts = [mine[:half].clone(), mine[half:].clone().view(1, -1).t()]
                work = pg.allreduce(parts)
                pending.append((i, seed, parts, work))
            else:
                work = dist.all_reduce(mine, op=reduce_op, async_op=True)
                pending.append((i, seed, [mine], work))
        for i, seed, parts, work in pending:
            work.wait()
            size, dtype, op = LANE_CALLS[i]
            got = torch.cat([p.reshape(-1) for p in parts])
            inputs = [_lane_inputs(r, size, dtype, seed) for r in range(n)]
            if dtype == torch.int32:
                exact = torch.stack([x.long() for x in inputs]).sum(0).int()
                if not torch.equal(got, exact):
                    wrong.append(f"round {rnd} call {i}: int32 sum of {size} differs")
                continue
            exact64 = torch.stack([x.double() for x in inputs]).sum(0).numpy()
            if op == "avg":
                exact64 = exact64 / n
            bound = call_bound(pg, inputs, exact64, op == "avg")
            over = float(np.max(np.abs(got.double().numpy() - exact64) / bound))
            worst = max(worst, over)
            if over > 1.0:
                wrong.append(f"round {rnd} call {i}: {dtype} {op} of {size} at {over:.3g} x the bound")
    return {"lane_wrong": wrong, "lane_worst_over_bound": worst}


def scenario_lanes(rank: int, n: int, out_dir: Path) -> None:
    """SWITCHAGG_LANES lanes: concurrent calls of mixed sizes and dtypes, DDP (backend and hook)
    against gloo, then a call that differs on one lane fails on every rank and ends the group."""
    dist.init_process_group("switchagg")
    pg: Any = dist.group.WORLD
    lanes = backend_of(pg).data_plane.lanes
    result: dict[str, Any] = {"lanes": len(lanes)}
    result.update(check_lane_calls(pg, rank, n, rounds=3))
    result["lane_calls"] = [int(s.stats()["allreduces"]) for s in lanes.sessions]
    result["lane_jobs"] = [s.job for s in lanes.sessions]
    result["lane_slots"] = [[s.slot_base, s.slot_count] for s in lanes.sessions]
    result.update(check_ddp(pg, rank, n))

    # Training: a few SGD steps on the switchagg group; every rank ends with the same parameters.
    ddp = DDP(make_model(), process_group=pg, bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(4):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        ddp(x).pow(2).sum().backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    gathered = [torch.zeros_like(params) for _ in range(n)]
    dist.all_gather(gathered, params)
    result["trained_identical"] = all(torch.equal(g, gathered[0]) for g in gathered)
    dist.barrier()

    # A mismatch on one lane: rank 0's second call has 100000 elements, the others' 200000.
    sizes = [1000, 100_000 if rank == 0 else 200_000, 3000]
    works = [dist.all_reduce(torch.ones(m, dtype=torch.int32), async_op=True) for m in sizes]
    outcomes: list[dict[str, Any] | None] = []
    for w in works:
        assert w is not None
        try:
            w.wait()
            outcomes.append(None)
        except Exception as e:
            outcomes.append({"error": type(e).__name__, "message": str(e),
                             "is_switchagg_error": isinstance(e, switchagg.SwitchaggError)})  # fmt: skip
    result["mismatch"] = outcomes
    try:  # the group is out of step now: a later call fails at once
        dist.all_reduce(torch.ones(10))
        result["after"] = None
    except Exception as e:
        result["after"] = {"error": type(e).__name__, "message": str(e)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def scenario_shards(rank: int, n: int, out_dir: Path) -> None:
    """SWITCHAGG_SHARDS aggregators hosted by the ranks: concurrent calls of mixed sizes and dtypes,
    and DDP (backend and hook) against gloo, striped over them."""
    dist.init_process_group("switchagg")
    pg: Any = dist.group.WORLD
    plane = backend_of(pg).data_plane
    result: dict[str, Any] = {
        "hosts": plane.aggregator is not None,
        "shards": [["{}:{}".format(*sh.aggregator) for sh in s.shards] for s in plane.lanes.sessions],
    }
    result.update(check_lane_calls(pg, rank, n, rounds=2))
    result.update(check_ddp(pg, rank, n))
    dist.barrier()  # every rank's calls are done: the counters of this rank's aggregator are final
    if plane.aggregator is not None:
        counters = plane.aggregator.counters()
        result["aggregated"] = sum(j["aggregated"] for j in counters["jobs"].values())
        result["dropped"] = sum(counters["drops"].values())
    dist.barrier()  # no aggregator stops before the others read theirs
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def _train(ddp: torch.nn.Module, rank: int, steps: int) -> list[torch.Tensor]:
    """``steps`` SGD steps of ``ddp`` on rank-own data; its parameters after them."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g)
        opt.zero_grad()
        ddp(x).pow(2).sum().backward()
        opt.step()
    return [p.detach().clone() for p in ddp.parameters()]


def _hooks() -> dict[str, Any]:
    """torch's own comm hooks (name -> (state factory, hook)); PowerSGD in several forms."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    def powersgd(rank: int, **kw: Any) -> Any:
        return lambda pg: psgd.PowerSGDState(pg, matrix_approximation_rank=rank, random_seed=0, **kw)

    # (state factory, hook, DDP bucket cap in MB): PowerSGD in one bucket (its callbacks' collectives
    # and the next bucket's, made on two threads, would race for their order between ranks).
    return {
        "allreduce": (lambda pg: pg, default.allreduce_hook, CAP_MB),
        "fp16_compress": (lambda pg: pg, default.fp16_compress_hook, CAP_MB),
        "powersgd_rank1": (powersgd(1, start_powerSGD_iter=2), psgd.powerSGD_hook, 25),
        "powersgd_rank2_cold": (powersgd(2, start_powerSGD_iter=2, warm_start=False), psgd.powerSGD_hook, 25),
        "powersgd_rank4_no_feedback": (
            powersgd(4, start_powerSGD_iter=2, use_error_feedback=False),
            psgd.powerSGD_hook,
            25,
        ),
    }


def scenario_hooks(rank: int, n: int, out_dir: Path) -> None:
    """Each torch comm hook with DDP on the switchagg group (several buckets, a few steps) against the
    same on a gloo group of the same ranks; and a future callback that makes a second collective and
    waits for it. Every wait is bounded by the group timeout: a hang fails the call, not the test run."""
    dist.init_process_group("switchagg", timeout=timedelta(seconds=60))
    pg: Any = dist.group.WORLD
    gloo_group = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}

    # A callback that makes a collective and waits for it, on the thread that completed the first.
    first, second = torch.ones(1000) * (rank + 1), torch.ones(10) * (rank + 1)

    def then(f: Any) -> float:
        dist.all_reduce(second, group=pg)  # synchronous: waits inside the callback
        return float(f.value()[0][0].item())

    fut = dist.all_reduce(first, group=pg, async_op=True).get_future().then(then)
    out["nested"] = [fut.wait(), float(second[0].item())]

    for name, (make_state, hook, cap_mb) in _hooks().items():
        params = {}
        for where, group in (("switchagg", pg), ("gloo", gloo_group)):
            model = DDP(make_model(), process_group=group, bucket_cap_mb=cap_mb)
            model.register_comm_hook(make_state(group), hook)
            params[where] = _train(model, rank, 5)
        everyone = [torch.zeros(1) for _ in range(n)]
        digest = torch.tensor([float(sum(p.double().sum() for p in params["switchagg"]))])
        dist.all_gather(everyone, digest, group=gloo_group)
        pairs = zip(params["switchagg"], params["gloo"], strict=True)
        diff = max((a - b).abs().max().item() for a, b in pairs)
        scale = max(p.abs().max().item() for p in params["gloo"])
        equal = len({float(t.item()) for t in everyone}) == 1
        out[name] = {"replicas_equal": equal, "max_diff": diff, "scale": scale}
    out["stats"] = backend_of(pg).stats()
    dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(out))


SCENARIOS = {
    "hooks": scenario_hooks,
    "widths": scenario_widths,
    "lanes": scenario_lanes,
    "shards": scenario_shards,
    "mismatched_calls": scenario_mismatched_calls,
    "grad_scaler": scenario_grad_scaler,
    "stress": scenario_stress,
    "bad_aggregator": scenario_bad_aggregator,
    "collectives": scenario_collectives,
    "killed_peer": scenario_killed_peer,
    "paused_peer": scenario_paused_peer,
    "stalled_peer": scenario_stalled_peer,
    "bind": scenario_bind,
    "cuda": scenario_cuda,
    "job_service": scenario_job_service,
}


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # the test asks for stacks before killing a hung worker
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    SCENARIOS[scenario](rank, n, out_dir)
    sys.stdout.flush()
    # Skip interpreter teardown: with a dead peer gloo's destructors may wait on it.
    os._exit(0)


if __name__ == "__main__":
    main()
