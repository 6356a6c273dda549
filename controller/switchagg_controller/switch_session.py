"""One switch, synchronously, for the CLI's one-shot commands (push, counters), benchmarks and
tests: finsy on an event loop of the session's own, run in the caller's thread for each call
(no thread, no loop shared with anything). The controller itself uses supervisor.py, on its loop.
A session cannot be used from inside a running event loop: there, use p4rt (``Reader``,
``finsy.Switch``) directly.

``with SwitchSession(address, device_id, p4info, bmv2_json) as s: s.apply(state)`` connects,
arbitrates and (given the bmv2 JSON) pushes the pipeline unless the switch already runs it
(finsy's cookie check). ``primary=False`` opens no stream: reads only, and a running
controller's mastership is left alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import finsy as fy
from finsy.p4schema import P4Schema
from finsy.proto import p4r

from switchagg_controller import p4rt
from switchagg_controller.model import SwitchState

T = TypeVar("T")


class SwitchSession:
    def __init__(
        self,
        address: str,
        device_id: int,
        p4info: Path,
        bmv2_json: Path | None = None,
        election_id: tuple[int, int] = (0, 1),
        *,
        primary: bool = True,
        force_pipeline: bool = False,
        timeout: float = 60.0,
    ) -> None:
        if election_id == (0, 0):
            raise ValueError("the election id must be non-zero (P4Runtime reserves 0)")
        self.address, self.device_id, self.timeout = address, device_id, timeout
        self.held_state = False  # the switch held table entries when we connected
        self._target: fy.Switch | p4rt.Reader
        if primary:
            options = fy.SwitchOptions(
                p4info=Path(p4info),
                p4blob=Path(bmv2_json) if bmv2_json is not None else None,
                p4force=force_pipeline,
                device_id=device_id,
                initial_election_id=p4rt.election_id(election_id),
            )
            self._target = fy.Switch(f"switch@{address}", address, options)
        else:
            self._target = p4rt.Reader(address, device_id, Path(p4info))
        self._loop: asyncio.AbstractEventLoop | None = None

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs ``coro`` to its end; TimeoutError (and it is cancelled) after ``timeout`` s."""
        if self._loop is None:
            coro.close()
            raise p4rt.P4RuntimeError(f"not connected to {self.address}")
        try:
            return self._loop.run_until_complete(asyncio.wait_for(coro, timeout or self.timeout))
        except asyncio.TimeoutError:
            raise TimeoutError(f"{self.address}: no answer within {timeout or self.timeout:g} s") from None

    def open(self) -> SwitchSession:
        self._loop = asyncio.new_event_loop()

        async def _open() -> bool:
            await self._target.__aenter__()
            if isinstance(self._target, fy.Switch) and not self._target.is_primary:
                return False
            return bool(await p4rt.read_table_entries(self._target))

        try:
            self.held_state = self._call(_open())
        except fy.P4ClientError as e:
            self.close()
            raise p4rt.P4RuntimeError(f"{self.address}: {e}") from None
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._loop is None:
            return
        try:
            self._call(self._target.__aexit__(None, None, None), 15.0)
        except Exception:  # noqa: S110 - closing a session to a switch that is already gone
            pass
        loop, self._loop = self._loop, None

        async def _cancel_the_rest() -> None:  # finsy's stream tasks, should any be left
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await loop.shutdown_asyncgens()

        loop.run_until_complete(_cancel_the_rest())
        loop.close()

    def __enter__(self) -> SwitchSession:
        return self.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def is_primary(self) -> bool:
        return isinstance(self._target, fy.Switch) and self._target.is_primary

    @property
    def p4info(self) -> P4Schema:
        return self._target.p4info

    def apply(self, state: SwitchState, delete_others: bool = True) -> int:
        if not isinstance(self._target, fy.Switch):
            raise p4rt.P4RuntimeError("a read-only session cannot write")
        return self._call(p4rt.apply(self._target, state, delete_others))

    def read_table_entries(self) -> list[p4r.TableEntry]:
        return self._call(p4rt.read_table_entries(self._target))

    def read_multicast_groups(self) -> list[p4r.MulticastGroupEntry]:
        return self._call(p4rt.read_multicast_groups(self._target))

    def read_counter(self, name: str, index: int | None = None) -> dict[int, tuple[int, int]]:
        return self._call(p4rt.read_counter(self._target, name, index))
