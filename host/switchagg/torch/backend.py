"""The "switchagg" c10d backend: SUM allreduce of float32/int32 CPU tensors in the network,
everything else on an inner gloo group built on the same store."""

from __future__ import annotations

import atexit
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from switchagg.torch.dataplane import DataPlane, open_data_plane
from switchagg.torch.work import FutureWork, completed_work

BACKEND_NAME = "switchagg"
EXCHANGE_PREFIX = "switchagg/exchange"
# How long rank 0 waits for the others to see a failed start-up before it tears down.
SETTLE_TIMEOUT = timedelta(seconds=30)
SUPPORTED_DTYPES = (torch.float32, torch.int32)


def network_reducible(tensors: list[torch.Tensor], op: Any) -> bool:
    """Whether switchagg can sum these: SUM of dense CPU float32/int32 tensors of one dtype."""
    if op != dist.ReduceOp.SUM or not tensors:
        return False
    dtype = tensors[0].dtype
    return dtype in SUPPORTED_DTYPES and all(
        t.dtype == dtype and t.device.type == "cpu" and t.layout == torch.strided for t in tensors
    )


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
        return getattr(self._gloo, name)(*args, **kwargs)

    collective.__name__ = name
    collective.__doc__ = f"{name} on the inner gloo backend."
    return collective


class ProcessGroupSwitchagg(dist.ProcessGroup):
    """A Python ProcessGroup: SUM allreduces of float32/int32 go to the network, every other
    collective explicitly to an inner gloo backend (DELEGATED), so DDP's broadcasts, barriers
    and allgathers work unchanged. gloo is also registered as the group's CPU backend, for the
    c10d helpers that ask a group for its backend (sequence numbers, object collectives).
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, group_tag: str) -> None:
        # Only the (rank, size) constructor builds the Python-overridable trampoline; the stub lacks it.
        super().__init__(rank, size)  # type: ignore[call-arg]
        # Any: the torch stubs do not declare Backend's collectives.
        self._gloo: Any = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._lock = threading.Lock()
        exchange = StoreExchange(store, rank, size)
        self._plane: DataPlane | None = open_data_plane(rank, size, exchange, group_tag)
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

    def close(self) -> None:
        atexit.unregister(self.close)  # a closed group is not kept alive until exit
        with self._lock:
            plane, self._plane = self._plane, None
        if plane is not None:
            plane.close()

    def allreduce(self, tensors: Any, opts: Any = None, timeout: timedelta | None = None) -> dist.Work:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None:
            opts = dist.AllreduceOptions()
        elif not isinstance(opts, dist.AllreduceOptions):  # the allreduce(tensors, op) form
            opts = _options(opts)
        if not network_reducible(tensors, opts.reduceOp):
            return self._gloo.allreduce(tensors, opts)
        return self._network_sum(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        if opts is None:
            opts = dist.AllreduceCoalescedOptions()
        if not network_reducible(tensors, opts.reduceOp):
            return self._gloo.allreduce_coalesced(tensors, opts)
        return self._network_sum(tensors)

    def _network_sum(self, tensors: list[torch.Tensor]) -> dist.Work:
        """One network allreduce over all tensors (flattened into one buffer when there are several)."""
        session = self.data_plane.session
        if len(tensors) == 1 and tensors[0].is_contiguous():
            pending = session.allreduce_async(tensors[0])
            return FutureWork(pending, lambda: tensors)
        if sum(t.numel() for t in tensors) == 0:
            return completed_work(tensors)
        flat = torch.cat([t.reshape(-1) for t in tensors])

        def scatter_back() -> list[torch.Tensor]:
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
            return tensors

        return FutureWork(session.allreduce_async(flat), scatter_back)


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

    def share(self, value: str | None) -> str:
        self.round += 1
        if value is not None:
            self.store.set(self._key("0"), value)
            return value
        return self.store.get(self._key("0")).decode()  # blocks up to the store's timeout

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
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["cpu"])
