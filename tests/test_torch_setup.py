"""The torch integration's set-up and staging: where the embedded aggregator binds, the backend's
registration through torch's entry points, and the staging pipeline (stager.Stager) on real sessions
and a real software aggregator, on the CPU and, where there is one, on a CUDA device."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from switchagg import Session, protocol  # noqa: E402
from switchagg.aggregator import SoftwareAggregator, new_key  # noqa: E402
from switchagg.torch import precision  # noqa: E402
from switchagg.torch.dataplane import check_reachable, default_bind, network_identity  # noqa: E402
from switchagg.torch.hook import ErrorFeedback, SwitchaggHookState  # noqa: E402
from switchagg.torch.stager import Stager  # noqa: E402
from switchagg_lab.testing.checks import block_exponents  # noqa: E402
from switchagg_lab.testing.kit import free_port  # noqa: E402
from switchagg_lab.testing.torch_launch import finish, launch, read  # noqa: E402

NO_CUDA = "no CUDA device on this machine (torch.cuda.is_available() is False)"


def routed_address() -> str | None:
    """This host's address routed toward a TEST-NET-1 address, if it has a non-loopback route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        ip: str = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


def test_default_bind_follows_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    for local in ("127.0.0.1", "localhost", ""):
        monkeypatch.setenv("MASTER_ADDR", local)
        assert default_bind() == "127.0.0.1"
    ip = routed_address()
    if ip is not None:
        monkeypatch.setenv("MASTER_ADDR", ip)
        assert default_bind() == ip  # the address the other ranks reach this host's store at
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    with pytest.raises(ValueError, match="SWITCHAGG_BIND"):
        default_bind()


def test_loopback_aggregator_from_another_network_fails_naming_switchagg_bind() -> None:
    mine = network_identity()
    assert mine  # Linux: boot id and network namespace
    check_reachable("127.0.0.1", mine, mine)  # same host: fine
    check_reachable("192.0.2.2", "another-host/1", mine)  # a routable address: not judged
    with pytest.raises(RuntimeError, match="SWITCHAGG_BIND"):
        check_reachable("127.0.0.1", "another-host/1", mine)
    with pytest.raises(RuntimeError, match="rank 2's embedded switchagg aggregator"):  # SWITCHAGG_SHARDS
        check_reachable("127.0.0.1", "another-host/1", mine, hosting_rank=2)


def test_embedded_binds_the_address_routed_toward_master_addr(tmp_path: Path) -> None:
    ip = routed_address()
    if ip is None:
        pytest.skip("no non-loopback IPv4 route on this machine")
    n = 2
    for rank, (code, err) in enumerate(finish(launch("bind", n, tmp_path, MASTER_ADDR=ip))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    for rank in range(n):
        r = read(tmp_path, rank)
        assert r["ok"] and r["aggregator"][0] == ip and r["worker"][0] == ip, r


def test_backend_registers_without_import_switchagg_torch(tmp_path: Path) -> None:
    """torch's entry points (group torch.backends) register "switchagg" when torch is imported: a
    script that never imports switchagg.torch inits the group and sums in the network."""
    names = [e.name for e in entry_points(group="torch.backends")]
    assert "switchagg" in names, (
        "entry point missing: reinstall (pip install -e . --no-deps --no-build-isolation)"
    )
    script = tmp_path / "plain.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('switchagg')\n"
        "t = torch.ones(10)\n"
        "dist.all_reduce(t)\n"
        "from switchagg.torch import backend_of\n"  # imported already, by the entry point
        "print(dist.get_backend(), backend_of().stats()['network'], t.sum().item(), flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    env.pop("SWITCHAGG_JOB_SERVICE", None)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["switchagg", "{'allreduce':", "1}", "10.0"], done.stdout


def test_the_cpp_backend_is_built_once_per_torch_and_loaded_after(tmp_path: Path) -> None:
    """native.py: the first process compiles the C++ c10d backend into TORCH_EXTENSIONS_DIR and the
    next one imports that library without building (CXX names no compiler then, and neither the
    library nor its object file is written again)."""
    code = "from switchagg.torch import native; native.main()"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    library = Path(first.stdout.split(": ", 1)[1].strip())
    assert library.is_file() and library.is_relative_to(tmp_path), first.stdout
    built = {p: p.stat().st_mtime_ns for p in (library, library.with_name("c10d_backend.o"))}
    env["CXX"] = str(tmp_path / "no-compiler")
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout == first.stdout
    assert {p: p.stat().st_mtime_ns for p in built} == built


def test_a_missing_compiler_is_named(tmp_path: Path) -> None:
    """Where the C++ backend cannot be compiled, the error says what it needs."""
    code = "from switchagg.torch import native; native.load()"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), CXX=str(tmp_path / "no-compiler"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "NativeBuildError" in done.stderr and "g++" in done.stderr and "python3-dev" in done.stderr, (
        done.stderr[-3000:]
    )


def test_exit_waits_for_the_gloo_threads(tmp_path: Path) -> None:
    """Importing switchagg.torch registers leaving.settle at exit: it finds gloo's worker threads
    and returns once they all sleep, so none frees a Python tensor during finalization; the
    process, which leaves normally, exits 0 with nothing on stderr."""
    script = tmp_path / "leave.py"
    script.write_text(
        "import atexit, torch, torch.distributed as dist\n"
        "import switchagg.torch\n"
        "from switchagg.torch import leaving\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1000)\n"
        "works = [dist.all_reduce(t.clone(), async_op=True) for _ in range(20)]\n"
        "dist.barrier()\n"
        "threads = leaving.gloo_threads()\n"
        "atexit.register(lambda: print('exit handler ran', flush=True))\n"
        "print(len(threads), sorted(set(threads.values()) - set('RS')), leaving.settle(), flush=True)\n"
    )
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    first, handler = done.stdout.splitlines()
    threads, odd, quiet = first.split(" ", 2)
    assert int(threads) >= 1 and odd == "[]" and quiet == "True", done.stdout
    assert handler == "exit handler ran"


def test_leaving_under_gloo_frees_exits_cleanly(tmp_path: Path) -> None:
    """The race that aborted ranks at exit (switchagg_lab.testing.exit_race; without settle it
    aborts some runs with "terminate called without an active exception", docs/TORCH.md has the
    rates): 10 runs of 2 ranks under torchrun, every rank exits 0 and nothing aborts."""
    for run in range(10):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += ["-m", "switchagg_lab.testing.exit_race"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        out = done.stdout + done.stderr
        assert done.returncode == 0 and "terminate called" not in out, f"run {run}:\n{out[-3000:]}"


def test_settle_gives_up_after_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from switchagg.torch import leaving

    monkeypatch.setattr(leaving, "gloo_threads", lambda: {1: "R"})  # one that never sleeps
    assert leaving.settle(bound=0.05) is False
    monkeypatch.setattr(leaving, "gloo_threads", dict)  # none at all
    assert leaving.settle() is True


def test_lane_widths_per_dtype() -> None:
    """docs/TORCH.md, Lane widths: each float dtype's own width unless a width is chosen, which
    applies to every float dtype; int32 always in 32-bit lanes; anything but 32, 16, 8 refused."""
    from switchagg.torch.widths import lane_bits

    assert [lane_bits(d) for d in (torch.float32, torch.bfloat16, torch.float16, torch.int32)] == [
        32,
        16,
        16,
        32,
    ]
    for bits in (32, 16, 8):
        assert [lane_bits(d, bits) for d in (torch.float32, torch.bfloat16, torch.float16)] == [bits] * 3
        assert lane_bits(torch.int32, bits) == 32
    with pytest.raises(ValueError, match="lanes are 32, 16, 8 bits wide"):
        lane_bits(torch.float32, 12)
    with pytest.raises(ValueError, match="SwitchaggHookState bits=4"):
        SwitchaggHookState(bits=4)  # refused before it needs a process group


def test_a_residual_is_kept_only_for_the_same_parameters_and_size() -> None:
    """hook.ErrorFeedback: DDP may rebuild its buckets, so an index's residual is reused only while
    the index holds the same parameters of the same size; otherwise it starts from zeros."""
    feedback = ErrorFeedback()
    first = feedback.residual(0, (1, 2), 10)
    first += 1.0  # what rounding left
    assert feedback.residual(0, (1, 2), 10) is first
    assert not feedback.residual(0, (2, 1), 10).any()  # other parameters, the same size
    assert not feedback.residual(0, (2, 1), 12).any() and feedback.sizes() == {0: 12}
    assert feedback.residual(1, (3,), 5) is not feedback.residual(0, (2, 1), 12)
    assert feedback.sizes() == {0: 12, 1: 5}


class Job:
    """n sessions of one job on an in-process software aggregator (real sockets)."""

    def __init__(self, n: int, k: int, slots: int = 8) -> None:
        self.aggregator = SoftwareAggregator("127.0.0.1", 0).start()
        key = new_key()
        self.sessions = [
            Session(1, r, n, self.aggregator.address, 0, slots, k, timeout=30, key=key) for r in range(n)
        ]
        pinned = [s.local_address for s in self.sessions]
        self.aggregator.add_job(1, n, 0, slots, k, 7, pinned, key=key)

    def close(self) -> None:
        for s in self.sessions:
            s.close()
        self.aggregator.stop()


def stage_everywhere(
    job: Job,
    inputs: list[list[Any]],
    packets: int,
    divide_by: int,
    pin: bool,
    bits: int = 32,
    residuals: list[Any] | None = None,
) -> list[Any]:
    """Every rank runs Stager.run on its tensors at once (one thread per rank), chunks of ``packets``
    packets (of lanes of ``bits``); returns the errors."""
    errors: list[Any] = [None] * len(job.sessions)
    chunk_bytes = 4 * packets * job.sessions[0].values_per_packet(bits)

    def rank(r: int) -> None:
        session = job.sessions[r]
        stager = Stager(session.allreduce_async, session.values_per_packet, chunk_bytes, pin_memory=pin)
        residual = residuals[r] if residuals else None
        try:
            stager.run(inputs[r], divide_by, bits=bits, residual=residual).result(60)
        except BaseException as e:  # noqa: BLE001
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(job.sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def staged_inputs(n: int, size: int, seed: int = 5) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(size, generator=g) * 2.0 ** torch.randint(-6, 6, (size,), generator=g) for _ in range(n)
    ]


def staged_case(device: str, dtype: Any, average: bool, several: bool, bits: int = 32) -> None:
    n, k = 3, 64
    per_packet = protocol.lanes_per_packet(k, bits)
    size = 5 * per_packet + 7  # three chunks of two packets, the last one short
    job = Job(n, k)
    try:
        inputs = [v.to(dtype) for v in staged_inputs(n, size)]
        if several:  # a non-contiguous tensor and a plain one, flattened into one buffer
            tensors = [[x[:200].reshape(20, 10).t().to(device), x[200:].clone().to(device)] for x in inputs]
        else:
            tensors = [[x.clone().to(device)] for x in inputs]
        # In the order the stager flattens them: its packets and blocks are cut in that order.
        wire = [torch.cat([t.reshape(-1) for t in ts]).cpu() for ts in tensors]
        exact = torch.stack([x.double() for x in wire]).sum(0).numpy() / (n if average else 1)
        errors = stage_everywhere(job, tensors, 2, n if average else 1, pin=device == "cuda", bits=bits)
        assert errors == [None] * n
        peak = np.max([x.float().abs().numpy() for x in wire], axis=0)
        exps = block_exponents(peak, per_packet, bits)
        bound = precision.error_bound(dtype, n, exps, exact, average, bits)
        for r in range(n):
            assert all(t.dtype == dtype and t.device.type == device for t in tensors[r])
            flat = torch.cat([t.reshape(-1) for t in tensors[r]])
            err = np.abs(flat.cpu().double().numpy() - exact)
            assert np.all(err <= bound), float(np.max(err / bound))
            assert job.sessions[r].stats()["allreduces"] == 3  # one call per chunk, in order
            assert job.sessions[r].stats()[f"bytes_lanes{bits}"] == 3 * 2 * protocol.packet_len(k)
    finally:
        job.close()


@pytest.mark.parametrize("bits", [32, 16, 8])
@pytest.mark.parametrize("several", [False, True], ids=["one", "list"])
@pytest.mark.parametrize("average", [False, True], ids=["sum", "avg"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_stager_on_cpu(dtype: str, average: bool, several: bool, bits: int) -> None:
    """Chunk by chunk through float32 host buffers (no pinned memory on the CPU), in lanes of each
    width, chunks of whole packets of the width: the sums of 3 ranks within the dtype's bound at that
    width, one session call per chunk."""
    staged_case("cpu", getattr(torch, dtype), average, several, bits)


@pytest.mark.parametrize("bits", [16, 8])
def test_staged_error_feedback_slices_the_residual_per_chunk(bits: int) -> None:
    """A tensor of three chunks staged 30 times with a float32 residual per rank (the hook's for a
    staged bucket): each chunk's call takes its slice, so what rounding took comes back in the next
    call everywhere, and the mean of the results converges on the exact sum, far closer than one call
    without feedback gets."""
    n, k, rounds = 3, 64, 30
    per_packet = protocol.lanes_per_packet(k, bits)
    size = 5 * per_packet + 7
    job = Job(n, k)
    try:
        inputs = staged_inputs(n, size, seed=9)
        exact = torch.stack([x.double() for x in inputs]).sum(0).numpy()
        residuals = [torch.zeros(size) for _ in range(n)]
        total = np.zeros(size)
        for _ in range(rounds):
            tensors = [[x.clone()] for x in inputs]
            errors = stage_everywhere(job, tensors, 2, 1, pin=False, bits=bits, residuals=residuals)
            assert errors == [None] * n
            total += tensors[0][0].double().numpy()
            assert all(torch.equal(tensors[0][0], t[0]) for t in tensors)
        assert all(int(s.stats()["allreduces"]) == 3 * rounds for s in job.sessions)
        peak = np.max([x.float().abs().numpy() for x in inputs], axis=0)
        bound = precision.error_bound(
            torch.float32, n, block_exponents(peak, per_packet, bits), exact, bits=bits
        )
        drift = np.abs(total - rounds * exact)
        # What is left in the residuals (less than a step each, of a block at most one binade up).
        assert np.all(drift <= 2 * bound), float(np.max(drift / bound))
        single = [[x.clone()] for x in inputs]
        assert stage_everywhere(job, single, 2, 1, pin=False, bits=bits) == [None] * n
        once = np.abs(single[0][0].double().numpy() - exact)
        assert float(np.mean(drift / rounds)) < float(np.mean(once)) / 5
    finally:
        job.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("bits", [32, 16, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_stager_on_cuda(dtype: str, bits: int) -> None:
    """The same through pinned memory and a side stream, device to host and back chunk by chunk."""
    staged_case("cuda", getattr(torch, dtype), True, False, bits)
    staged_case("cuda", getattr(torch, dtype), False, True, bits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_backend_and_hook(tmp_path: Path) -> None:
    """CUDA tensors through the backend (SUM, AVG; float32, bfloat16) and DDP on CUDA with the
    backend and with the hook, against gloo."""
    n = 2
    for rank, (code, err) in enumerate(finish(launch("cuda", n, tmp_path))):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"
    for rank in range(n):
        r = read(tmp_path, rank)
        assert r["sums_ok"], r
        assert r["network_calls"] >= 4, r
        assert r["ddp_backend_max_diff"] <= r["ddp_bound"] and r["ddp_hook_max_diff"] <= r["ddp_bound"], r
        assert r["hook_network"] >= 1 and not r["hook_delegated"], r


REINIT = """
import json, os, socket, sys, time, torch, torch.distributed as dist
from switchagg.torch import backend_of
rank, out = int(os.environ["RANK"]), []
for incarnation in range(2):
    if incarnation and rank == 1:
        time.sleep(3)  # rank 0 meets the store first, with the last incarnation's keys in it
    dist.init_process_group("switchagg")
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    net = backend_of()
    agg = net.data_plane.aggregator
    address = agg.address if agg is not None else None
    dist.destroy_process_group()
    try:
        net.data_plane
        closed = False
    except RuntimeError:
        closed = True
    port_free = None
    if address is not None:  # the aggregator's socket is closed: its port can be bound again
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(tuple(address))
            port_free = True
    out.append({"sum": t.tolist(), "closed": closed, "port_free": port_free})
with open(sys.argv[1] + f".{rank}", "w") as f:
    json.dump(out, f)
"""


def test_reinit_under_torchrun_and_destroy_closes_the_data_plane(tmp_path: Path) -> None:
    """init_process_group("switchagg") twice in the same processes under torchrun, whose agent's store
    outlives the first group: each incarnation has keys of its own (gloo's, the exchange's, the
    heartbeats'), so the second starts however the ranks arrive; destroy_process_group() closes each
    rank's data plane and rank 0's embedded aggregator."""
    script = tmp_path / "reinit.py"
    script.write_text(REINIT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), str(script), str(tmp_path / "out")]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=os.environ | {"SWITCHAGG_TIMEOUT": "5"}
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for rank in range(2):
        runs = json.loads((tmp_path / f"out.{rank}").read_text())
        assert [r["sum"] for r in runs] == [[3.0] * 5] * 2
        assert all(r["closed"] for r in runs), runs
        assert [r["port_free"] for r in runs] == ([True, True] if rank == 0 else [None, None]), runs
