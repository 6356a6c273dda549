"""The "switchagg" c10d backend: SUM and AVG allreduces of float32/int32/bfloat16/float16 tensors, on
the CPU or CUDA, in the network (float in the lanes of widths.lane_bits); everything else on an inner
gloo group built on the same store.

c10d sees a C++ Backend (native.py); this module is its Python side (Network) and its registration.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from switchagg.errors import SwitchaggPeerGone
from switchagg.torch import identity, native, widths
from switchagg.torch.calls import DELEGATED as ON_GLOO
from switchagg.torch.calls import NETWORK, CallLog, first_tensor
from switchagg.torch.dataplane import DataPlane, open_data_plane, session_timeout
from switchagg.torch.liveness import PeerWatch
from switchagg.torch.stager import Stager

BACKEND_NAME = "switchagg"
EXCHANGE_PREFIX = "switchagg/exchange"
# How long rank 0 waits for the others to see a failed start-up before it tears down.
SETTLE_TIMEOUT = timedelta(seconds=30)
# What the network sums (docs/TORCH.md): int32 exactly, float32 within protocol.lane_error_bound of its
# lanes (widths.py), and bfloat16/float16 as float32 (exact in it) rounded back; AVG is the sum divided
# by the group's size. No error feedback here: a plain allreduce does not know what its tensor is, nor
# that it will be summed again (the hook does: hook.ErrorFeedback).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_DTYPES = (*FLOAT_DTYPES, torch.int32)
DEVICES = ("cpu", "cuda")


def network_reducible(tensors: list[torch.Tensor], op: Any) -> str:
    """Why switchagg cannot sum these in the network, or "" if it can: SUM or AVG of dense CPU or
    CUDA tensors of one supported dtype on one device (AVG of floating dtypes only)."""
    if not tensors:
        return "no tensors"
    # op == X, not op in (...): a RedOpType compared with a ReduceOp object says False
    if not (op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG):
        return f"op {_op_name(op)}"
    first = tensors[0]
    if first.dtype not in SUPPORTED_DTYPES:
        return f"dtype {_dtype_name(first.dtype)}"
    if op == dist.ReduceOp.AVG and first.dtype not in FLOAT_DTYPES:
        return f"AVG of {_dtype_name(first.dtype)}"
    if first.device.type not in DEVICES:
        return f"device {first.device.type}"
    for t in tensors:
        if t.layout != torch.strided:
            return f"layout {t.layout}"
        if t.dtype != first.dtype or t.device != first.device:
            return "mixed dtypes or devices"
    return ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _op_name(op: Any) -> str:
    op = getattr(op, "op", op)  # a ReduceOp object holds its RedOpType
    return str(getattr(op, "name", op))


class Network:
    """The Python side of one "switchagg" group, held by its C++ c10d backend (native.py,
    csrc/c10d_backend.cpp): the data plane that sums SUM/AVG allreduces of float32/int32/bfloat16/
    float16 tensors in the network, the counters of where each collective ran, and the inner gloo
    backend the C++ side hands every other collective to (DDP's broadcasts, barriers, allgathers).

    A network call waits for a slow live peer up to the group's ``timeout`` (init_process_group's);
    a peer that is gone (its process ended: its liveness connection closed) fails it at once,
    naming the rank (liveness.PeerWatch). ``backend_of(group)`` returns it.
    """

    def __init__(
        self, store: dist.Store, rank: int, size: int, timeout: timedelta, group_tag: str, gloo: Any
    ) -> None:
        self.gloo = gloo  # Any: the torch stubs do not declare Backend's collectives
        self.rank, self.size, self.timeout = rank, size, timeout
        self._lock = threading.Lock()
        self.calls = CallLog(f"switchagg group {group_tag} (rank {rank} of {size})")
        self.identity = identity.CallIdentity(store, rank, size, f"switchagg group {group_tag}")
        self._watch = PeerWatch(rank, size, session_timeout(), self._peer_gone)
        exchange = StoreExchange(store, rank, size)
        try:
            self._plane: DataPlane | None = open_data_plane(
                rank, size, exchange, group_tag, call_timeout=timeout.total_seconds(), watch=self._watch
            )
        except BaseException:
            self._watch.close()
            raise
        self._plane.session.torch_calls = self.calls
        self._stager = Stager(self._plane.lanes.allreduce_async, self._plane.lanes.values_per_packet)
        self._watch.start()
        # Works complete on a thread of their own, in call order, not on the data plane's: a Work's
        # future runs its callbacks where it completes, and a comm hook's callback may make another
        # collective and wait for it (PowerSGD's do), which only the data plane's thread can sum. Such a
        # collective, made on the completing thread, completes on the data plane's thread instead.
        self._completer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="switchagg-done")
        self._completer_thread = self._completer.submit(threading.get_ident).result()
        self._store = store  # shutdown(): who has left
        atexit.register(self.close)

    @property
    def data_plane(self) -> DataPlane:
        if self._plane is None:
            raise RuntimeError("the switchagg process group is closed")
        return self._plane

    def stats(self) -> dict[str, dict[str, int]]:
        """Calls per op, and the datagram bytes per lane width: ``{"network": {"allreduce": 12},
        "delegated": {"broadcast": 1, ...}, "bytes": {"lanes32": 123456, "lanes16": 0, "lanes8": 0}}``."""
        plane = self._plane
        return {**self.calls.stats(), "bytes": widths.lane_bytes(plane.stats() if plane else {})}

    def _peer_gone(self, reason: str) -> None:
        plane = self._plane
        if plane is not None:
            plane.lanes.cancel(reason, SwitchaggPeerGone)

    def close(self) -> None:
        atexit.unregister(self.close)  # a closed group is not kept alive until exit
        with self._lock:
            plane, self._plane = self._plane, None
        if plane is not None:
            self.calls.closed(widths.lane_bytes(plane.stats()))
            self._watch.close()
            plane.close()
            self._completer.shutdown(wait=False)  # close() may run on one of its threads

    def shutdown(self) -> None:
        """destroy_process_group() (the C++ backend's shutdown): the data plane closes. A rank that
        hosts an aggregator first waits, up to SWITCHAGG_TIMEOUT, for every rank to get here: a peer
        still repairing a lost result of its last call needs it."""
        plane, left = self._plane, f"{EXCHANGE_PREFIX}-left/"
        try:
            self._store.set(f"{left}{self.rank}", "1")
            if plane is not None and plane.aggregator is not None:
                self._store.wait(
                    [f"{left}{r}" for r in range(self.size)], timedelta(seconds=session_timeout())
                )
        except Exception:  # noqa: BLE001 (a peer that never leaves, or a store gone: close anyway)
            pass
        self.close()

    # Called by the C++ backend, with the GIL, from the thread that issued the collective.

    def delegated(self, op: str, tensor: torch.Tensor | None) -> None:
        self.calls.record(op, ON_GLOO, tensor, "not an allreduce")

    def start(
        self,
        op: str,
        tensors: list[torch.Tensor],
        reduce_op: int,
        done: Callable[[BaseException | None], None],
    ) -> bool:
        """Starts the allreduce in the network and returns True, ``done`` to be called once with
        None when the sum is in place or with the error; False if the network cannot sum it (the
        C++ side gives it to gloo). The call is counted and logged either way."""
        red_op = dist.ReduceOp.RedOpType(reduce_op)
        why = network_reducible(tensors, red_op)
        if why:
            self.calls.record(op, ON_GLOO, first_tensor(tensors), why)
            return False
        average = red_op == dist.ReduceOp.AVG
        divide_by = self.size if average else 1
        bits = widths.lane_bits(tensors[0].dtype, self.data_plane.wire_bits)
        how = f"AVG: SUM in the network, then / {divide_by} on each rank" if average else "SUM"
        self.calls.record(op, NETWORK, tensors[0], how=how + widths.in_lanes(bits))
        # Numbered and described even when empty, so that every rank's numbers stay in step.
        description = self.identity.next("AVG" if average else "SUM", tensors, bits)
        if sum(t.numel() for t in tensors) == 0:
            done(None)
            return True
        pending, finish = self._network_sum(tensors, divide_by, description, bits)
        self._watch.track(pending)

        def complete(f: concurrent.futures.Future[None]) -> None:
            try:
                f.result()
                finish()
            except BaseException as e:  # the Work's future carries it to whoever waits
                done(self.identity.explain(e))
                return
            done(None)

        def hand_over(f: concurrent.futures.Future[None]) -> None:
            try:
                self._completer.submit(complete, f)
            except RuntimeError:  # the group closed meanwhile: nobody else is left to complete it
                complete(f)

        nested = threading.get_ident() == self._completer_thread  # a callback waits for it there
        pending.add_done_callback(complete if nested else hand_over)
        return True

    def _network_sum(
        self, tensors: list[torch.Tensor], divide_by: int, description: str, bits: int
    ) -> tuple[concurrent.futures.Future[None], Callable[[], None]]:
        """One network allreduce over all tensors in lanes of ``bits``: in place for one contiguous
        CPU float32/int32 tensor, else staged (stager.Stager: flattened, converted, copied off the
        device chunk by chunk, divided there); the second value finishes the sum on the data plane's
        thread."""
        lanes = self.data_plane.lanes
        t = tensors[0]
        if len(tensors) == 1 and t.device.type == "cpu" and t.dtype in DIRECT and t.is_contiguous():

            def divide() -> None:
                if divide_by != 1:
                    t.div_(divide_by)

            return lanes.allreduce_async(t, tag=identity.tag(description, 0, 1), bits=bits), divide
        return self._stager.run(tensors, divide_by, description, bits), lambda: None


# Summed where they are, without a copy.
DIRECT = (torch.float32, torch.int32)


class StoreExchange:
    """The data plane's start-up exchange over the group's c10d store (one key per round and rank)."""

    def __init__(self, store: dist.Store, rank: int, size: int) -> None:
        self.store, self.rank, self.size = store, rank, size
        self.round = 0

    def _key(self, who: str) -> str:
        return f"{EXCHANGE_PREFIX}{self.round}/{who}"

    def gather(self, value: str) -> list[str]:
        self.round += 1
        self.store.set(self._key(str(self.rank)), value)
        return [self.store.get(self._key(str(r))).decode() for r in range(self.size)]

    def settle(self) -> None:
        # Rank 0 serves the store and its gloo context is the peer of every mesh: it leaves last.
        key = f"{EXCHANGE_PREFIX}-settled/"
        try:
            if self.rank != 0:
                self.store.set(f"{key}{self.rank}", "1")
            else:
                self.store.wait([f"{key}{r}" for r in range(1, self.size)], SETTLE_TIMEOUT)
        except Exception:  # noqa: BLE001 (best effort: the start-up error is what the caller raises)
            pass


def create_backend(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """The creator function c10d calls for init_process_group("switchagg") and new_group(): the C++
    backend around gloo and the group's Network, in a ProcessGroup that names itself "switchagg"
    (c10d's own would say "custom", e.g. to DDP's logging)."""
    # c10d hands each group a store prefixed with its own name, so the tag only names the job.
    tag = f"g{_next_group_tag()}"
    store = dist.PrefixStore(f"{incarnation(store, size)}/", store)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
    cpp = native.load()  # compiled before the data plane opens: a build error leaves nothing behind
    network = Network(store, rank, size, timeout, tag, gloo)
    return cpp.group(store, rank, size, cpp.create(rank, size, gloo, network), list(DEVICES))


def incarnation(store: dist.Store, size: int) -> int:
    """Which time a group of this name is made on this store. Re-made under the same name on a store
    that outlived it (destroy_process_group, then init_process_group again under torchrun, whose
    agent keeps the store), it must not meet the last one's keys: gloo's rendezvous, the exchange
    and the heartbeats each take the incarnation's prefix. Every rank adds 1 before it reads any
    key, so value // size is the same on every rank of one incarnation."""
    return (int(store.add("switchagg/incarnations", 1)) - 1) // size


def backend_of(group: dist.ProcessGroup | None = None) -> Network:
    """The switchagg side of a group made with backend "switchagg" (default: the default group):
    ``stats()``, ``data_plane``, ``gloo``, ``close()``."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return native.load().network_of(pg._get_backend(torch.device("cpu")))


_group_counter = 0
_group_counter_lock = threading.Lock()


def _next_group_tag() -> int:
    # Groups are created in the same order on every rank (a c10d requirement), so counters agree.
    global _group_counter
    with _group_counter_lock:
        _group_counter += 1
        return _group_counter


def register() -> None:
    """Make "switchagg" a c10d backend name (idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create_backend, devices=list(DEVICES))
