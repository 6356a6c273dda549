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
    ) -> None:
        super().__init__()
        self._torch_future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        self._pending = pending
        self._finish = finish
        pending.add_done_callback(self._complete)

    def _complete(self, pending: concurrent.futures.Future[None]) -> None:
        try:
            pending.result()
            value = self._finish()
        except BaseException as e:  # the torch future carries the error to whoever waits
            self._torch_future.set_exception(e)  # type: ignore[arg-type]  # torch's stub is wrong
        else:
            self._torch_future.set_result(value)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        # Blocks without the GIL; the session's own timeout bounds it when a peer dies.
        self._torch_future.wait()
        return True

    def is_completed(self) -> bool:
        return self._torch_future.done()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._torch_future


def completed_work(value: list[torch.Tensor]) -> FutureWork:
    """A Work that is already done (nothing to send, e.g. an empty tensor list)."""
    done: concurrent.futures.Future[None] = concurrent.futures.Future()
    done.set_result(None)
    return FutureWork(done, lambda: value)
