"""Staging: tensors the session cannot sum where they are (CUDA tensors, bfloat16/float16, several
tensors at once) go through a host buffer of the wire dtype (float32 or int32), chunk by chunk.

Chunk i+1 is copied in (device to host, and converted) while chunk i is on the wire, and each chunk's
result is copied back (host to device, converted) as soon as it arrives, as gloo's CUDA path and NCCL's
proxy do. On CUDA the copies run on a side stream into pinned memory and the session's thread waits for
each chunk's copy event before it sends it; on the CPU the same code runs with synchronous copies (and no
pinned memory), which is how the pipeline is tested without a GPU.

Every rank cuts the same tensor into the same chunks (the cut depends only on the element count, K and
the lane width: whole packets of the width's values_per_packet), so each chunk is one numbered call of the
session on every rank, and the 32-value blocks that share a scale in narrow lanes never straddle two.
An error-feedback residual (the hook's, float32 in host memory) is sliced like the host buffer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from switchagg.torch import identity

# Bytes of the host buffer (4 per value) per chunk, rounded down to whole packets.
DEFAULT_CHUNK_BYTES = 4 << 20


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor travels in: int32 as itself, every floating dtype as float32."""
    return torch.int32 if dtype == torch.int32 else torch.float32


def chunk_elements(per_packet: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Values per chunk: ``chunk_bytes`` of the host buffer rounded down to whole packets of
    ``per_packet`` values (the session's values_per_packet(bits)), at least one packet."""
    return max(per_packet, (chunk_bytes // 4) // per_packet * per_packet)


class _Device:
    """Copies on one device: a side stream and events on CUDA, synchronous (no-ops) on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(device) if self.cuda else None

    @contextlib.contextmanager
    def on_side_stream(self) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def after_current_work(self) -> None:
        """The side stream waits for what the caller's stream has queued (the tensor's producer)."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def event(self) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def flatten(self, tensors: list[torch.Tensor], single: bool) -> torch.Tensor:
        """One flat tensor of ``tensors``' values: a view of a ``single`` contiguous one, else a copy,
        made on the side stream once the caller's stream has produced them."""
        self.after_current_work()
        with self.on_side_stream():
            flat = tensors[0].view(-1) if single else torch.cat([t.reshape(-1) for t in tensors])
            if self.cuda:
                flat.record_stream(self.stream)
        return flat

    @staticmethod
    def wait(event: Any) -> None:
        if event is not None:
            event.synchronize()  # releases the GIL while it waits


class Stager:
    """``run`` sums ``tensors`` (one device, one dtype) over the group through ``submit``, a
    session's (or Lanes') ``allreduce_async``; the future completes once every result is back in
    ``tensors``. ``values_per_packet(bits)``: the session's, which the chunks are whole packets of."""

    def __init__(
        self,
        submit: Callable[..., concurrent.futures.Future[None]],
        values_per_packet: Callable[[int], int],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        pin_memory: bool | None = None,
    ) -> None:
        self.submit = submit
        self.values_per_packet = values_per_packet
        self.chunk_bytes = chunk_bytes
        self.pin_memory = pin_memory

    def chunk(self, bits: int = 32) -> int:
        """Values per chunk (one wire call) in lanes of ``bits``."""
        return chunk_elements(self.values_per_packet(bits), self.chunk_bytes)

    def run(
        self,
        tensors: list[torch.Tensor],
        divide_by: int = 1,
        description: str = "",
        bits: int = 32,
        residual: torch.Tensor | None = None,
    ) -> concurrent.futures.Future[None]:
        """``divide_by``: each result is divided by it in the wire dtype before it is copied back (AVG).
        ``description``: the user's call (identity.describe); every chunk's wire call carries it and the
        chunk's index (identity.tag), so ranks whose calls differ fail instead of summing chunks.
        ``bits``: the lanes (float only); ``residual``: error feedback for narrow lanes, a float32 CPU
        tensor of the tensors' total size, each chunk's call given its slice (Session.allreduce)."""
        total = sum(t.numel() for t in tensors)
        _check_residual(residual, total)
        device = _Device(tensors[0].device)
        dtype = tensors[0].dtype
        single = len(tensors) == 1 and tensors[0].is_contiguous()
        flat = device.flatten(tensors, single)
        pin = device.cuda if self.pin_memory is None else self.pin_memory
        host = torch.empty(total, dtype=wire_dtype(dtype), pin_memory=pin)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        chunk = self.chunk(bits)
        bounds = [(a, min(a + chunk, total)) for a in range(0, total, chunk)]
        state = _Progress(len(bounds), done)

        def finish() -> None:
            with device.on_side_stream():
                if not single:
                    offset = 0
                    for t in tensors:
                        t.copy_(flat[offset : offset + t.numel()].view_as(t), non_blocking=True)
                        offset += t.numel()
                end = device.event()
            device.wait(end)

        def chunk_back(a: int, b: int) -> Callable[[concurrent.futures.Future[None]], None]:
            def back(pending: concurrent.futures.Future[None]) -> None:
                error = pending.exception()
                if error is None:
                    try:  # the result of chunk [a, b) into the tensor while later chunks are on the wire
                        if divide_by != 1:
                            host[a:b].div_(divide_by)
                        with device.on_side_stream():
                            if device.cuda and dtype != host.dtype:  # convert on the device
                                staged = torch.empty(b - a, dtype=host.dtype, device=device.device)
                                staged.copy_(host[a:b], non_blocking=True)
                                flat[a:b].copy_(staged)
                            else:
                                flat[a:b].copy_(host[a:b], non_blocking=True)
                    except BaseException as e:  # noqa: BLE001 (reported through the future)
                        error = e
                state.chunk_done(error, finish)

            return back

        for index, (a, b) in enumerate(bounds):
            with device.on_side_stream():
                # float32 (on the device, for CUDA) before the copy: bfloat16/float16 are exact in it
                host[a:b].copy_(flat[a:b].to(host.dtype), non_blocking=True)
                ready = device.event()
            try:
                chunk_tag = identity.tag(description, index, len(bounds)) if description else 0
                pending = self.submit(
                    host[a:b], ready=lambda ev=ready: device.wait(ev), tag=chunk_tag, bits=bits,
                    residual=None if residual is None else residual[a:b],
                )  # fmt: skip
            except BaseException as e:  # noqa: BLE001 (a closed session: the chunks queued already end)
                for _ in range(len(bounds) - index):
                    state.chunk_done(e, finish)
                break
            pending.add_done_callback(chunk_back(a, b))
        if not bounds:
            done.set_result(None)
        return done


def _check_residual(residual: torch.Tensor | None, total: int) -> None:
    # Checked before any chunk is sent: a chunk that the session refused would leave the peers waiting.
    if residual is None:
        return
    if residual.dtype != torch.float32 or residual.numel() != total or residual.device.type != "cpu":
        raise ValueError(
            f"the residual must be float32 of {total} values on the CPU, not {residual.dtype} of "
            f"{residual.numel()} on {residual.device}"
        )


class _Progress:
    """Counts chunks back; completes the future after the last, with the first error if any."""

    def __init__(self, chunks: int, done: concurrent.futures.Future[None]) -> None:
        self.left, self.done = chunks, done
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def chunk_done(self, error: BaseException | None, finish: Callable[[], None]) -> None:
        with self.lock:
            self.left -= 1
            if error is not None and self.error is None:
                self.error = error
            last, error = self.left == 0, self.error
        if not last:
            return
        if error is None:
            try:
                finish()
            except BaseException as e:  # noqa: BLE001
                error = e
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result(None)
