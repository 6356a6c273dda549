"""Keeps several switches programmed, each on its own: one finsy.Controller on one asyncio loop.

finsy connects each switch, arbitrates mastership, pushes the pipeline when the switch's cookie
is not ours (finsy's cookie of our P4Info and bmv2 JSON), and reconnects whenever the stream
breaks. Once a switch is ready, ``SwitchSupervisor._on_ready`` makes it hold the desired state.
A switch that went away and came back is handled alone; the other switches keep running.

A switch found holding none of our table entries lost its state (it restarted, or its pipeline
was pushed): its registers are zero and its slot state is gone, so ``on_restart`` runs before
the state is written again: the job manager gives every job of the switch a new generation, so
no slot mixes contributions from before and after. Workers then continue (their retransmissions
refill the slots) or fail with their session timeout; never with a wrong sum.

Readiness is only claimed for a connection that holds our state: ``wait_ready`` reads the switch
back before answering, because a restarted switch answers on the same address (a unix socket
path, or host:port) before finsy has seen the old stream break (see docs/CONTROLLER.md).

The counters (``pushes``, ``reconnects``, ``write_errors``, ``programmed``) are plain attributes,
read by tests, logs and metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import finsy as fy

from switchagg_controller import p4rt
from switchagg_controller.aioloop import LoopThread
from switchagg_controller.model import SwitchState, Topology
from switchagg_controller.p4rt import P4RuntimeError

log = logging.getLogger("switchagg.supervisor")

Counters = dict[str, dict[int, tuple[int, int]]]  # counter array name -> index -> (bytes, packets)


class SwitchUnavailable(P4RuntimeError):
    """The switch is not connected (or not programmed) right now; the supervisor keeps trying."""


class SwitchSupervisor:
    def __init__(
        self,
        topology: Topology,
        bmv2_json: Path,
        p4info: Path,
        desired: Callable[[], SwitchState],
        on_restart: Callable[[], None] = lambda: None,
        timeout: float = 30.0,
    ) -> None:
        self.topology = topology
        self.name, self.address = topology.name, topology.switch_address
        self.desired, self.on_restart, self.timeout = desired, on_restart, timeout
        options = fy.SwitchOptions(
            p4info=Path(p4info),
            p4blob=Path(bmv2_json),
            device_id=topology.device_id,
            initial_election_id=p4rt.election_id(topology.election_id),
            ready_handler=self._on_ready,
        )
        self.switch = fy.Switch(self.name, self.address, options)
        self.switch.ee.on(fy.SwitchEvent.CHANNEL_UP, self._on_up)
        self.switch.ee.on(fy.SwitchEvent.CHANNEL_DOWN, self._on_down)
        self.pushes = 0  # times the switch was found without our state and programmed afresh
        self.reconnects = 0  # P4Runtime streams opened
        self.write_errors = 0  # failed programming attempts (each one makes finsy reconnect)
        self.programmed = 0  # times the whole desired state was written after a (re)connection
        self.primary = False
        self.ready = False
        self.last_error: BaseException | None = None
        self.fleet: SwitchFleet | None = None
        self._lock: asyncio.Lock | None = None  # made on the loop: one writer at a time
        self._changed: asyncio.Condition | None = None

    # -- on the loop ----------------------------------------------------------------------------

    def _sync(self) -> tuple[asyncio.Lock, asyncio.Condition]:
        if self._lock is None or self._changed is None:
            self._lock, self._changed = asyncio.Lock(), asyncio.Condition()
        return self._lock, self._changed

    async def _set_ready(self, ready: bool) -> None:
        _, changed = self._sync()
        async with changed:
            self.ready = ready
            changed.notify_all()

    def _on_up(self, switch: fy.Switch) -> None:
        self.reconnects += 1

    def _on_down(self, switch: fy.Switch) -> None:
        if self.ready:
            log.warning("switch %s (%s) went away; reconnecting", self.name, self.address)
        self.ready = False  # at once (a sync emitter callback); waiters are woken below
        asyncio.get_running_loop().create_task(self._set_ready(False))

    async def _on_ready(self, switch: fy.Switch) -> None:
        """finsy's ready handler: the stream is up and the pipeline is ours (when primary)."""
        await self._set_ready(False)
        self.primary = switch.is_primary
        if not switch.is_primary:
            self.last_error = SwitchUnavailable(
                f"{self.name} ({self.address}) device {switch.device_id}: not primary with election id "
                f"{switch.election_id} (another controller holds {switch.primary_id})"
            )
            log.warning("%s", self.last_error)
            return  # finsy calls us again if we become primary
        lock, _ = self._sync()
        try:
            if not await p4rt.read_table_entries(switch):
                self.pushes += 1
                # Outside our lock: on_restart takes the job manager's lock, whose holder may be
                # waiting for a push (lock order: job manager -> supervisor).
                await asyncio.to_thread(self.on_restart)
            async with lock:
                changes = await p4rt.apply(switch, self.desired())
        except Exception as e:
            self.write_errors += 1
            self.last_error = e
            log.warning("programming switch %s failed (finsy reconnects): %s", self.name, e)
            raise  # the switch's tasks end; finsy opens a new stream and calls us again
        self.programmed += 1
        self.last_error = None
        await self._set_ready(True)
        log.info("switch %s programmed (%d change(s); pushes: %d)", self.name, changes, self.pushes)

    async def _push(self) -> int:
        lock, _ = self._sync()
        if not self.ready:
            raise self._unavailable()
        async with lock:
            try:
                return await p4rt.apply(self.switch, self.desired())
            except Exception as e:
                self.write_errors += 1
                if not await self._holds_state():  # it restarted under us: away, not refusing
                    raise self._unavailable() from e
                raise

    async def _holds_state(self) -> bool:
        try:
            return bool(await p4rt.read_table_entries(self.switch))
        except Exception:  # e.g. "no pipeline": a switch that restarted under us
            return False

    async def _wait_ready(self, timeout: float) -> bool:
        _, changed = self._sync()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with changed:
            while True:
                remaining = deadline - loop.time()
                try:
                    await asyncio.wait_for(changed.wait_for(lambda: self.ready), max(0.0, remaining))
                except asyncio.TimeoutError:
                    return False
                if await self._holds_state():
                    return True
                # Ready in name only: the switch answering is not the one we programmed. Wait
                # for finsy to see the stream break and for the next programming.
                seen = self.programmed

                def reprogrammed(seen: int = seen) -> bool:
                    return self.programmed > seen

                try:
                    await asyncio.wait_for(changed.wait_for(reprogrammed), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    return False

    async def _read_counter(self, name: str) -> dict[int, tuple[int, int]]:
        if not self.ready:
            raise self._unavailable()
        return await p4rt.read_counter(self.switch, name)

    async def _read_counters(self, names: list[str]) -> Counters:
        values = await asyncio.gather(*(self._read_counter(n) for n in names))
        return dict(zip(names, values, strict=True))

    def _unavailable(self) -> SwitchUnavailable:
        return SwitchUnavailable(f"the switch {self.name} at {self.address} is not ready ({self.last_error})")

    # -- from other threads ---------------------------------------------------------------------

    def _loop(self) -> LoopThread:
        if self.fleet is None:
            raise RuntimeError(f"switch {self.name} is not part of a running fleet")
        return self.fleet.loop

    def push(self) -> int:
        """Makes the switch hold the desired state now; SwitchUnavailable while it is away."""
        if not self.ready:  # fail fast rather than wait for a reconnect
            raise self._unavailable()
        return self._loop().call(self._push(), self.timeout)

    def read_counter(self, name: str) -> dict[int, tuple[int, int]]:
        return self._loop().call(self._read_counter(name), self.timeout)

    def wait_ready(self, timeout: float) -> bool:
        """True once the switch is connected and verifiably holds the desired state."""
        return self._loop().call(self._wait_ready(timeout), timeout + self.timeout)


class SwitchFleet:
    """The supervisors of all switches on one finsy.Controller, in one asyncio loop thread."""

    def __init__(self, supervisors: list[SwitchSupervisor]) -> None:
        self.supervisors = supervisors
        self.loop = LoopThread()
        for s in supervisors:
            s.fleet = self
        self._controller = fy.Controller([s.switch for s in supervisors])
        self._task: asyncio.Future[None] | None = None

    def start(self) -> SwitchFleet:
        async def _start() -> None:
            self._task = asyncio.ensure_future(self._controller.run())

        self.loop.call(_start(), 10.0)
        return self

    def wait_ready(self, timeout: float) -> bool:
        """All switches ready (each waited for in parallel, within ``timeout``)."""

        async def _all() -> bool:
            return all(await asyncio.gather(*(s._wait_ready(timeout) for s in self.supervisors)))

        return self.loop.call(_all(), timeout + 30.0)

    def read_counters(self, names: list[str], timeout: float) -> dict[str, Counters | Exception]:
        """Every switch's counter arrays ``names``, the switches read in parallel; a switch that is
        away, or slower than ``timeout``, gives its error instead (metrics must not hang on it)."""

        async def one(s: SwitchSupervisor) -> Counters | Exception:
            try:
                return await asyncio.wait_for(s._read_counters(names), timeout)
            except Exception as e:
                return e

        async def _all() -> dict[str, Counters | Exception]:
            results = await asyncio.gather(*(one(s) for s in self.supervisors))
            return {s.name: r for s, r in zip(self.supervisors, results, strict=True)}

        return self.loop.call(_all(), timeout + 5.0)

    def stop(self) -> None:
        async def _stop() -> None:
            self._controller.stop()
            if self._task is not None:
                await asyncio.gather(self._task, return_exceptions=True)

        try:
            self.loop.call(_stop(), 15.0)
        except asyncio.TimeoutError:
            log.warning("the switches did not stop within 15 s")
        for s in self.supervisors:
            s.ready = False
        self.loop.close()
