"""A c10d Work completed from switchagg's background thread."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


class FutureWork(dist.Work):
    """Wraps a Session future; DDP needs get_future(), user code calls wait().

    ``finish`` runs on the session's thread after the network sum (copy-back of coalesced
    buffers) and returns the value the torch future resolves to.
    """

    def __init__(
        self,
        pending: concurrent.futures.Future[None],
        finish: Callable[[], list[torch.Tensor]],
        devices: list[int | str | torch.device] | None = None,
    ) -> None:
        super().__init__()
        self._pending = pending
        self._finish = finish
        self._value: list[torch.Tensor] = []
        self._error: BaseException | None = None
        # C++ readers (DDP's reducer) must see a failure as the future's error. A Python
        # set_exception() stores the exception object as the *value*, which the reducer then
        # takes for tensors and crashes on; an exception raised in a then() callback is a real one.
        # ``devices``: the CUDA devices of the tensors it resolves to (a torch future refuses others).
        self._done: torch.futures.Future[None] = torch.futures.Future(devices=devices)
        self._torch_future: torch.futures.Future[list[torch.Tensor]] = self._done.then(self._unwrap)
        pending.add_done_callback(self._complete)

    def _complete(self, pending: concurrent.futures.Future[None]) -> None:
        try:
            pending.result()
            self._value = self._finish()
        except BaseException as e:  # the torch future carries the error to whoever waits
            self._error = e
        self._done.set_result(None)

    def _unwrap(self, _: torch.futures.Future[None]) -> list[torch.Tensor]:
        if self._error is not None:
            raise self._error
        return self._value

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        # Blocks without the GIL; the session's own timeout bounds it when a peer dies.
        try:
            self._torch_future.wait()
        except Exception:
            if self._error is not None:
                raise self._error from None  # as it was raised (e.g. SwitchaggTimeout), not torch's wrapper
            raise
        return True

    def is_completed(self) -> bool:
        return self._torch_future.done()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._torch_future


def completed_work(
    value: list[torch.Tensor], devices: list[int | str | torch.device] | None = None
) -> FutureWork:
    """A Work that is already done (nothing to send, e.g. an empty tensor list)."""
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    done.set_result(None)
    return FutureWork(done, lambda: value, devices)
