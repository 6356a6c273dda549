"""A DDP comm hook that sums gradient buckets through switchagg, for code that keeps gloo as its
process group: ``ddp.register_comm_hook(SwitchaggHookState(), allreduce_hook)``."""

# No "from __future__ import annotations": DDP checks the hook's annotations as real objects.
import atexit

import torch
import torch.distributed as dist

from switchagg.torch.dataplane import DataPlane, open_data_plane


class GroupExchange:
    """The data plane's start-up exchange over the process group's own collectives."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def share(self, value: str | None) -> str:
        box: list[str | None] = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        if box[0] is None:
            raise RuntimeError("rank 0 published nothing")
        return box[0]

    def gather(self, value: str) -> list[str]:
        values: list[str] = [""] * dist.get_world_size(self.group)
        dist.all_gather_object(values, value, group=self.group)
        return values

    def settle(self) -> None:
        pass  # the group belongs to the caller and outlives a failed start-up


class SwitchaggHookState:
    """Owns this rank's switchagg data plane; collective: every rank of the group creates one,
    after init_process_group and in the same order (addresses are exchanged over the group)."""

    _created = 0

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        group = process_group if process_group is not None else dist.group.WORLD
        if group is None or not dist.is_initialized():
            raise RuntimeError("SwitchaggHookState needs an initialised process group")
        self.process_group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        SwitchaggHookState._created += 1
        tag = f"hook{SwitchaggHookState._created}"

        self.plane: DataPlane | None = open_data_plane(self.rank, self.world_size, GroupExchange(group), tag)
        atexit.register(self.close)

    def close(self) -> None:
        atexit.unregister(self.close)  # a closed state is not kept alive until exit
        plane, self.plane = self.plane, None
        if plane is not None:
            plane.close()


def allreduce_hook(state: SwitchaggHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket like torch's default allreduce_hook, summing it in the network.

    Buckets of other dtypes than float32 (the network path takes float32 and int32; gradients are
    floating point) go to the process group's own allreduce.
    """
    tensor = bucket.buffer()
    # Divide first, as the default hook does, so results match it to the quantization bound.
    tensor.div_(state.world_size)
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or state.plane is None:
        work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: fut.value()[0])
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    pending = state.plane.session.allreduce_async(tensor)

    def complete(done: object) -> None:
        try:
            pending.result()
        except BaseException as e:
            result.set_exception(e)  # type: ignore[arg-type]  # torch's stub is wrong
        else:
            result.set_result(tensor)

    pending.add_done_callback(complete)
    return result
