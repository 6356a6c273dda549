"""The "switchagg" c10d backend: SUM and AVG allreduces of float32/int32/bfloat16/float16 tensors, on
the CPU or CUDA, in the network; everything else on an inner gloo group built on the same store."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from switchagg.torch.calls import DELEGATED as ON_GLOO
from switchagg.torch.calls import NETWORK, CallLog, first_tensor
from switchagg.torch.dataplane import DataPlane, open_data_plane, session_timeout
from switchagg.torch.liveness import PeerWatch
from switchagg.torch.stager import Stager, chunk_elements
from switchagg.torch.work import FutureWork, completed_work

BACKEND_NAME = "switchagg"
EXCHANGE_PREFIX = "switchagg/exchange"
# How long rank 0 waits for the others to see a failed start-up before it tears down.
SETTLE_TIMEOUT = timedelta(seconds=30)
# What the network sums (docs/TORCH.md): int32 exactly, float32 within protocol.error_bound, and
# bfloat16/float16 as float32 (exact in it) rounded back; AVG is the sum divided by the group's size.
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


# Every collective the inner gloo backend has, called on it from Python. They must not fall through
# to the C++ ProcessGroup: its Python trampoline calls gloo's enqueue with the GIL held, and a gloo
# worker thread destroying a finished work holds gloo's queue mutex while it waits for the GIL to
# release the work's tensors; both block forever (seen as a hang in all_gather after an allreduce).
# gloo's own bindings release the GIL before they enqueue.
DELEGATED = (
    "broadcast",
    "allgather",
    "_allgather_base",
    "allgather_coalesced",
    "gather",
    "scatter",
    "reduce",
    "reduce_scatter",
    "_reduce_scatter_base",
    "alltoall",
    "alltoall_base",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "recv_anysource",
)


def _delegate(name: str) -> Any:
    def collective(self: ProcessGroupSwitchagg, *args: Any, **kwargs: Any) -> Any:
        self.calls.record(name, ON_GLOO, first_tensor(args), "not an allreduce")
        return getattr(self._gloo, name)(*args, **kwargs)

    collective.__name__ = name
    collective.__doc__ = f"{name} on the inner gloo backend."
    return collective


class ProcessGroupSwitchagg(dist.ProcessGroup):
    """A Python ProcessGroup: SUM/AVG allreduces of float32/int32/bfloat16/float16 go to the network,
    every other collective explicitly to an inner gloo backend (DELEGATED), so DDP's broadcasts,
    barriers and allgathers work unchanged. gloo is also registered as the group's CPU backend, for
    the c10d helpers that ask a group for its backend (sequence numbers, object collectives).

    A network call waits for a slow live peer up to the group's ``timeout`` (init_process_group's);
    a peer that is gone (its heartbeat in the store stopped for SWITCHAGG_TIMEOUT seconds) fails it
    sooner, naming the rank (liveness.PeerWatch).
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, group_tag: str) -> None:
        # Only the (rank, size) constructor builds the Python-overridable trampoline; the stub lacks it.
        super().__init__(rank, size)  # type: ignore[call-arg]
        # Any: the torch stubs do not declare Backend's collectives.
        self._gloo: Any = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._lock = threading.Lock()
        self.timeout = timeout
        self.calls = CallLog(f"switchagg group {group_tag} (rank {rank} of {size})")
        self._watch = PeerWatch(store, rank, size, session_timeout(), self._peer_gone)
        exchange = StoreExchange(store, rank, size)
        try:
            self._plane: DataPlane | None = open_data_plane(
                rank, size, exchange, group_tag, call_timeout=timeout.total_seconds()
            )
        except BaseException:
            self._watch.close()
            raise
        self._plane.session.torch_calls = self.calls
        self._stager = Stager(self._plane.lanes.allreduce_async, chunk_elements(self._plane.lanes.k))
        self._watch.start()
        atexit.register(self.close)

    def getBackendName(self) -> str:  # noqa: N802 (the C++ virtual's name)
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    @property
    def gloo(self) -> Any:
        return self._gloo

    @property
    def data_plane(self) -> DataPlane:
        if self._plane is None:
            raise RuntimeError("the switchagg process group is closed")
        return self._plane

    def stats(self) -> dict[str, dict[str, int]]:
        """Calls per op: ``{"network": {"allreduce": 12}, "delegated": {"broadcast": 1, ...}}``."""
        return self.calls.stats()

    def _peer_gone(self, reason: str) -> None:
        plane = self._plane
        if plane is not None:
            plane.lanes.cancel(reason)

    def close(self) -> None:
        atexit.unregister(self.close)  # a closed group is not kept alive until exit
        with self._lock:
            plane, self._plane = self._plane, None
        if plane is not None:
            self._watch.close()
            plane.close()

    def allreduce(self, tensors: Any, opts: Any = None, timeout: timedelta | None = None) -> dist.Work:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None:
            opts = dist.AllreduceOptions()
        elif not isinstance(opts, dist.AllreduceOptions):  # the allreduce(tensors, op) form
            opts = _options(opts)
        op = opts.reduceOp
        return self._allreduce("allreduce", tensors, op, lambda: self._gloo.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        if opts is None:
            opts = dist.AllreduceCoalescedOptions()
        return self._allreduce(
            "allreduce_coalesced",
            tensors,
            opts.reduceOp,
            lambda: self._gloo.allreduce_coalesced(tensors, opts),
        )

    def _allreduce(
        self, name: str, tensors: list[torch.Tensor], op: Any, on_gloo: Callable[[], dist.Work]
    ) -> dist.Work:
        why = network_reducible(tensors, op)
        if why:
            self.calls.record(name, ON_GLOO, first_tensor(tensors), why)
            return on_gloo()
        self.calls.record(name, NETWORK, tensors[0])
        return self._network_sum(tensors, self.size() if op == dist.ReduceOp.AVG else 1)

    def _network_sum(self, tensors: list[torch.Tensor], divide_by: int = 1) -> dist.Work:
        """One network allreduce over all tensors: in place for one contiguous CPU float32/int32
        tensor, else staged (stager.Stager: flattened, converted, copied off the device chunk by chunk)."""
        lanes = self.data_plane.lanes
        cuda = tensors[0].device.type == "cuda"
        devices: list[int | str | torch.device] | None = [tensors[0].device] if cuda else None
        if sum(t.numel() for t in tensors) == 0:
            return completed_work(tensors, devices)
        t = tensors[0]
        if len(tensors) == 1 and t.device.type == "cpu" and t.dtype in DIRECT and t.is_contiguous():
            pending = lanes.allreduce_async(t)

            def finish() -> list[torch.Tensor]:
                if divide_by != 1:
                    t.div_(divide_by)
                return tensors

        else:
            pending = self._stager.run(tensors, divide_by)

            def finish() -> list[torch.Tensor]:
                return tensors

        self._watch.track(pending)
        return FutureWork(pending, finish, devices)


# Summed where they are, without a copy.
DIRECT = (torch.float32, torch.int32)


for _name in DELEGATED:
    setattr(ProcessGroupSwitchagg, _name, _delegate(_name))


def _options(op: dist.ReduceOp) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


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


def create_process_group(
    store: dist.Store, rank: int, size: int, timeout: timedelta
) -> ProcessGroupSwitchagg:
    """The creator function c10d calls for init_process_group("switchagg") and new_group()."""
    # c10d hands each group a store prefixed with its own name, so the tag only names the job.
    tag = f"g{_next_group_tag()}"
    return ProcessGroupSwitchagg(store, rank, size, timeout, tag)


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
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=list(DEVICES))
