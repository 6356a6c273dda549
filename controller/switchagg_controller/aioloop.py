"""One asyncio event loop in a thread of its own, for the controller's P4Runtime side (finsy).

The job service and the job manager are threaded; they hand coroutines to this loop with
``call`` (asyncio.run_coroutine_threadsafe) and wait for the result, bounded. Everything that
touches a finsy.Switch runs on this loop, so the P4Runtime side needs no locks of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "p4runtime-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Runs ``coro`` on the loop and returns its result; TimeoutError (and the coroutine is
        cancelled) after ``timeout`` seconds."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.call from its own loop would wait for itself")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout:g} s") from None

    def close(self, timeout: float = 10.0) -> None:
        """Cancels what still runs on the loop, then stops it."""

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            try:
                self.submit(_cancel_all()).result(timeout)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
