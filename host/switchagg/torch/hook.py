"""A DDP comm hook that sums gradient buckets through switchagg, for code that keeps gloo as its
process group: ``ddp.register_comm_hook(SwitchaggHookState(), allreduce_hook)``."""

# No "from __future__ import annotations": DDP checks the hook's annotations as real objects.
import atexit
import concurrent.futures
import logging
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from switchagg.errors import SwitchaggPeerGone
from switchagg.torch import identity
from switchagg.torch.calls import DELEGATED, NETWORK, CallLog
from switchagg.torch.dataplane import DataPlane, open_data_plane, session_timeout
from switchagg.torch.liveness import PeerWatch
from switchagg.torch.stager import Stager, chunk_elements

log = logging.getLogger("switchagg.torch")

# Gradient buckets the network sums: float32 in place on the CPU, the others staged (stager.py).
HOOK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HOOK_DEVICES = ("cpu", "cuda")


class GroupExchange:
    """The data plane's start-up exchange over the process group's own collectives."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def gather(self, value: str) -> list[str]:
        values: list[str] = [""] * dist.get_world_size(self.group)
        dist.all_gather_object(values, value, group=self.group)
        return values

    def settle(self) -> None:
        pass  # the group belongs to the caller and outlives a failed start-up


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """The process group's timeout (init_process_group's or new_group's), or c10d's default."""
    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 (no backend for that device, or no options)
            continue
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout
    return dist.default_pg_timeout


class SwitchaggHookState:
    """Owns this rank's switchagg data plane; collective: every rank of the group creates one,
    after init_process_group and in the same order (addresses are exchanged over the group).

    A bucket waits for a slow live peer up to ``timeout`` (default: the group's own timeout); a peer
    that is gone (its process ended: its liveness connection closed) fails it at once."""

    _created = 0

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, timeout: timedelta | None = None
    ) -> None:
        group = process_group if process_group is not None else dist.group.WORLD
        if group is None or not dist.is_initialized():
            raise RuntimeError("SwitchaggHookState needs an initialised process group")
        self.process_group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        SwitchaggHookState._created += 1
        tag = f"hook{SwitchaggHookState._created}"
        self.timeout = timeout if timeout is not None else group_timeout(group)
        self.calls = CallLog(f"switchagg hook {tag} (rank {self.rank} of {self.world_size})")
        self._warned = False
        store = dist.PrefixStore(f"switchagg/{tag}", dist.distributed_c10d._get_default_store())
        self.identity = identity.CallIdentity(store, self.rank, self.world_size, f"switchagg hook {tag}")
        self._watch = PeerWatch(self.rank, self.world_size, session_timeout(), self._peer_gone)
        try:
            self.plane: DataPlane | None = open_data_plane(
                self.rank, self.world_size, GroupExchange(group), tag, self.timeout.total_seconds(),
                watch=self._watch,
            )  # fmt: skip
        except BaseException:
            self._watch.close()
            raise
        self.plane.session.torch_calls = self.calls
        self._stager = Stager(self.plane.lanes.allreduce_async, chunk_elements(self.plane.lanes.k))
        self._watch.start()
        atexit.register(self.close)

    def stats(self) -> dict[str, dict[str, int]]:
        """Buckets per path: ``{"network": {"allreduce": 40}, "delegated": {"allreduce": 2}}``."""
        return self.calls.stats()

    def _peer_gone(self, reason: str) -> None:
        plane = self.plane
        if plane is not None:
            plane.lanes.cancel(reason, SwitchaggPeerGone)

    def fell_back(self, tensor: torch.Tensor, why: str) -> None:
        """Counted and logged; a one-time warning, since DDP gradients then skip the network."""
        self.calls.record("allreduce", DELEGATED, tensor, why)
        if not self._warned:
            self._warned = True
            message = (
                f"switchagg: DDP gradient buckets of {str(tensor.dtype).removeprefix('torch.')} on "
                f"{tensor.device.type} fall back to the process group's allreduce ({why}); "
                "SWITCHAGG_DEBUG=INFO logs where every kind of call runs"
            )
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        atexit.unregister(self.close)  # a closed state is not kept alive until exit
        plane, self.plane = self.plane, None
        if plane is not None:
            self._watch.close()
            plane.close()


def _why_not(state: SwitchaggHookState, tensor: torch.Tensor) -> str:
    if state.plane is None:
        return "the hook state is closed"
    if tensor.dtype not in HOOK_DTYPES:
        return f"dtype {str(tensor.dtype).removeprefix('torch.')}"
    if tensor.device.type not in HOOK_DEVICES:
        return f"device {tensor.device.type}"
    return ""


def allreduce_hook(state: SwitchaggHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket like torch's default allreduce_hook, summing it in the network.

    float32 buckets on the CPU are divided by the world size and summed in place; bfloat16/float16
    and CUDA buckets are staged through a float32 host buffer and divided after the sum. Others
    (float64) go to the process group's own allreduce, with a one-time warning.
    """
    tensor = bucket.buffer()
    why = _why_not(state, tensor)
    if why:
        state.fell_back(tensor, why)
        tensor.div_(state.world_size)
        work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: fut.value()[0])
    assert state.plane is not None
    n = state.world_size
    cpu_float = tensor.device.type == "cpu" and tensor.dtype == torch.float32
    how = (
        f"AVG: / {n} on each rank, then SUM in the network"
        if cpu_float
        else f"AVG: SUM in the network, then / {n}"
    )
    state.calls.record("allreduce", NETWORK, tensor, how=how)
    description = state.identity.next("AVG", [tensor])  # the hook averages, as torch's default hook
    devices: list[int | str | torch.device] | None = [tensor.device] if tensor.device.type == "cuda" else None
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
    pending: concurrent.futures.Future[None]
    if cpu_float:
        # Divide first, as the default hook does, so results match it to the quantization bound.
        tensor.div_(state.world_size)
        pending = state.plane.lanes.allreduce_async(tensor, tag=identity.tag(description, 0, 1))
    else:
        pending = state._stager.run([tensor], state.world_size, description)
    state._watch.track(pending)

    def complete(done: object) -> None:
        try:
            pending.result()
        except BaseException as e:
            result.set_exception(state.identity.explain(e))  # type: ignore[arg-type]  # torch's stub is wrong
        else:
            result.set_result(tensor)

    pending.add_done_callback(complete)
    return result
