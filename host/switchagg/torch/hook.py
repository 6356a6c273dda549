"""A DDP comm hook that sums gradient buckets through switchagg, for code that keeps gloo as its
process group: ``ddp.register_comm_hook(SwitchaggHookState(), allreduce_hook)``.

Buckets travel in the lanes of their dtype's width unless told (SWITCHAGG_WIRE_BITS, the state's or the
hook's ``bits``: widths.py), and in narrow lanes with error feedback where it is on (8 bits by default):
each bucket's rounding error is carried into the same bucket's next step (ErrorFeedback)."""

# No "from __future__ import annotations": DDP checks the hook's annotations as real objects.
import atexit
import concurrent.futures
import logging
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from switchagg.errors import SwitchaggPeerGone
from switchagg.torch import identity, widths
from switchagg.torch.calls import DELEGATED, NETWORK, CallLog
from switchagg.torch.dataplane import DataPlane, open_data_plane, session_timeout
from switchagg.torch.liveness import PeerWatch
from switchagg.torch.stager import Stager

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


class ErrorFeedback:
    """Each bucket's residual (what rounding took from what this rank sent), keyed by the bucket's
    index as PowerSGD's state keys its errors, and added to the same bucket's next step. A residual is
    float32 in host memory, summed in place by the session (Session.allreduce's ``residual``).

    DDP rebuilds its buckets after the first step (and may again), so an index can name other
    parameters later: a residual is only reused for the same parameters (their storage, in order) and
    size, and dropped otherwise rather than added to other gradients."""

    def __init__(self) -> None:
        self._residuals: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}

    @staticmethod
    def fingerprint(bucket: dist.GradBucket) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in bucket.parameters())

    def residual(self, index: int, fingerprint: tuple[int, ...], numel: int) -> torch.Tensor:
        """Bucket ``index``'s residual from its last step, or zeros where there is none that fits."""
        kept = self._residuals.get(index)
        if kept is not None and kept[0] == fingerprint and kept[1].numel() == numel:
            return kept[1]
        fresh = torch.zeros(numel, dtype=torch.float32)
        self._residuals[index] = (fingerprint, fresh)
        return fresh

    def sizes(self) -> dict[int, int]:
        """Values of each bucket's residual, by bucket index."""
        return {index: r.numel() for index, (_, r) in self._residuals.items()}

    def clear(self) -> None:
        self._residuals.clear()


class SwitchaggHookState:
    """Owns this rank's switchagg data plane; collective: every rank of the group creates one,
    after init_process_group and in the same order (addresses are exchanged over the group).

    A bucket waits for a slow live peer up to ``timeout`` (default: the group's own timeout); a peer
    that is gone (its process ended: its liveness connection closed) fails it at once.

    ``bits`` (32, 16 or 8): the lanes of every bucket (default: SWITCHAGG_WIRE_BITS if set, else the
    bucket dtype's own width); every rank must choose the same. ``error_feedback``: carry each bucket's
    rounding error into its next step in narrow lanes (default: on for 8 bits only; 32-bit lanes round
    to nearest and have none)."""

    _created = 0

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        timeout: timedelta | None = None,
        bits: int | None = None,
        error_feedback: bool | None = None,
    ) -> None:
        self.bits = None if bits is None else widths.checked(bits, "SwitchaggHookState bits")
        self.error_feedback = error_feedback
        group = process_group if process_group is not None else dist.group.WORLD
        if group is None or not dist.is_initialized():
            raise RuntimeError("SwitchaggHookState needs an initialised process group")
        self.feedback = ErrorFeedback()
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
        self._stager = Stager(self.plane.lanes.allreduce_async, self.plane.lanes.values_per_packet)
        self._watch.start()
        atexit.register(self.close)

    def stats(self) -> dict[str, dict[str, int]]:
        """Buckets per path, and the datagram bytes per lane width: ``{"network": {"allreduce": 40},
        "delegated": {"allreduce": 2}, "bytes": {"lanes32": 0, "lanes16": 0, "lanes8": 1234567}}``."""
        plane = self.plane
        return {**self.calls.stats(), "bytes": widths.lane_bytes(plane.stats() if plane else {})}

    def lanes_of(self, dtype: torch.dtype, bits: int | None = None) -> tuple[int, bool]:
        """A bucket's lane width (the hook's ``bits``, else the state's, else SWITCHAGG_WIRE_BITS, else
        the dtype's) and whether it gets error feedback."""
        chosen = bits if bits is not None else self.bits
        if chosen is None and self.plane is not None:
            chosen = self.plane.wire_bits
        width = widths.lane_bits(dtype, chosen)
        feedback = widths.feedback_default(width) if self.error_feedback is None else self.error_feedback
        return width, feedback and width != 32

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
            self.calls.closed(widths.lane_bytes(plane.stats()))
            self._watch.close()
            plane.close()
        self.feedback.clear()


def _why_not(state: SwitchaggHookState, tensor: torch.Tensor) -> str:
    if state.plane is None:
        return "the hook state is closed"
    if tensor.dtype not in HOOK_DTYPES:
        return f"dtype {str(tensor.dtype).removeprefix('torch.')}"
    if tensor.device.type not in HOOK_DEVICES:
        return f"device {tensor.device.type}"
    return ""


def allreduce_hook(
    state: SwitchaggHookState, bucket: dist.GradBucket, bits: int | None = None
) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket like torch's default allreduce_hook, summing it in the network.

    float32 buckets on the CPU are divided by the world size and summed in place; bfloat16/float16
    and CUDA buckets are staged through a float32 host buffer and divided after the sum. Others
    (float64) go to the process group's own allreduce, with a one-time warning. ``bits``: the lanes
    (default: the state's, SWITCHAGG_WIRE_BITS, the dtype's; DDP passes only state and bucket, so a
    width of its own is the state's ``bits``, or this from a hook of the caller's that passes it on).
    With error feedback (SwitchaggHookState) the bucket's residual is what rounding took from what
    was sent: the averaged bucket on the CPU, the bucket before its sum is divided when staged.
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
    width, feedback = state.lanes_of(tensor.dtype, bits)
    cpu_float = tensor.device.type == "cpu" and tensor.dtype == torch.float32
    order = f"/ {n} on each rank, then SUM in the network" if cpu_float else f"SUM in the network, then / {n}"
    feeds = " with error feedback" if feedback else ""
    state.calls.record("allreduce", NETWORK, tensor, how=f"AVG: {order}{widths.in_lanes(width)}{feeds}")
    description = state.identity.next("AVG", [tensor], width)  # the hook averages, as torch's default hook
    residual = None
    if feedback:
        residual = state.feedback.residual(bucket.index(), ErrorFeedback.fingerprint(bucket), tensor.numel())
    devices: list[int | str | torch.device] | None = [tensor.device] if tensor.device.type == "cuda" else None
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
    pending: concurrent.futures.Future[None]
    if cpu_float:
        # Divide first, as the default hook does, so results match it to the quantization bound.
        tensor.div_(state.world_size)
        tag = identity.tag(description, 0, 1)
        pending = state.plane.lanes.allreduce_async(tensor, tag=tag, bits=width, residual=residual)
    else:
        pending = state._stager.run([tensor], state.world_size, description, width, residual)
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
