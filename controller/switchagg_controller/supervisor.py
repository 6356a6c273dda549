"""Keeps several switches programmed, each on its own, all on the controller's one asyncio loop.

Each ``SwitchSupervisor`` runs its switch's connections itself (``run``): one finsy.Switch
connection at a time (``async with switch``: connect, arbitrate mastership, push the pipeline
when the switch's cookie is not ours), held until the stream breaks, then the next one after a
bounded backoff (RETRY_MIN doubling to RETRY_MAX; back to RETRY_MIN after a connection that got
programmed). finsy's own ``Switch.run`` would wait 10 s after a connection that failed within 2 s,
which is what a switch that is still restarting does. Once a connection is ready,
``_on_ready`` makes the switch hold the desired state. A switch that went away and came back is
handled alone; the other switches keep running.

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
from switchagg_controller.model import SwitchState, Topology
from switchagg_controller.p4rt import P4RuntimeError

log = logging.getLogger("switchagg.supervisor")

Counters = dict[str, dict[int, tuple[int, int]]]  # counter array name -> index -> (bytes, packets)

RETRY_MIN, RETRY_MAX = 0.2, 2.0  # seconds between connection attempts (doubling)


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
        """``on_restart`` runs on the loop, before the state is written again; it must not block."""
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
        self.write_errors = 0  # failed programming attempts (each one ends the connection)
        self.programmed = 0  # times the whole desired state was written after a (re)connection
        self.primary = False
        self.ready = False
        self.last_error: BaseException | None = None
        self._lock = asyncio.Lock()  # one writer at a time (a write awaits the switch)
        self._changed = asyncio.Condition()  # ready or programmed changed
        self._lost = asyncio.Event()  # the current connection's stream broke
        self._wakers: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references

    # -- the connections ------------------------------------------------------------------------

    async def run(self) -> None:
        """Connects, and connects again whenever the connection fails or breaks; until cancelled."""
        delay = RETRY_MIN
        while True:
            self._lost.clear()
            programmed = self.programmed
            try:
                async with self.switch:  # returns once the channel is ready; _on_ready runs meanwhile
                    await self._lost.wait()
            except Exception as e:  # cannot connect (yet), or the stream failed: try again
                self.last_error = e
                log.debug("switch %s: connection failed: %s", self.name, e)
            delay = RETRY_MIN if self.programmed > programmed else min(2 * delay, RETRY_MAX)
            await asyncio.sleep(delay)

    async def _set_ready(self, ready: bool) -> None:
        async with self._changed:
            self.ready = ready
            self._changed.notify_all()

    def _on_up(self, switch: fy.Switch) -> None:
        self.reconnects += 1

    def _on_down(self, switch: fy.Switch) -> None:
        if self.ready:
            log.warning("switch %s (%s) went away; reconnecting", self.name, self.address)
        self.ready = False  # at once (a sync emitter callback); waiters are woken below
        self._lost.set()
        waker = asyncio.get_running_loop().create_task(self._set_ready(False))
        self._wakers.add(waker)
        waker.add_done_callback(self._wakers.discard)

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
        try:
            if not await p4rt.read_table_entries(switch):
                self.pushes += 1
                self.on_restart()
            async with self._lock:
                changes = await p4rt.apply(switch, self.desired())
        except Exception as e:
            self.write_errors += 1
            self.last_error = e
            log.warning("programming switch %s failed (reconnecting): %s", self.name, e)
            raise  # the switch's tasks end, and with them the connection; run() opens the next one
        self.programmed += 1
        self.last_error = None
        await self._set_ready(True)
        log.info("switch %s programmed (%d change(s); pushes: %d)", self.name, changes, self.pushes)

    # -- what the job manager and the metrics ask -------------------------------------------------

    async def push(self) -> int:
        """Makes the switch hold the desired state now; SwitchUnavailable while it is away
        (at once: no waiting for a reconnection), TimeoutError after ``timeout``."""
        if not self.ready:
            raise self._unavailable()
        return await asyncio.wait_for(self._push(), self.timeout)

    async def _push(self) -> int:
        async with self._lock:
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
        except asyncio.CancelledError:
            # A read on a connection finsy is tearing down is cancelled although we are not: that
            # switch holds nothing of ours any more. Our own cancellation still propagates.
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", None)  # Python 3.11+; 3.10 re-raises as before
            if cancelling is None or cancelling():
                raise
            return False

    async def wait_ready(self, timeout: float) -> bool:
        """True once the switch is connected and verifiably holds the desired state."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._changed:
            while True:
                remaining = deadline - loop.time()
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.ready), max(0.0, remaining))
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
                    await asyncio.wait_for(
                        self._changed.wait_for(reprogrammed), max(0.0, deadline - loop.time())
                    )
                except asyncio.TimeoutError:
                    return False

    async def read_counter(self, name: str) -> dict[int, tuple[int, int]]:
        if not self.ready:
            raise self._unavailable()
        return await asyncio.wait_for(p4rt.read_counter(self.switch, name), self.timeout)

    async def read_counters(self, names: list[str]) -> Counters:
        values = await asyncio.gather(*(self.read_counter(n) for n in names))
        return dict(zip(names, values, strict=True))

    def _unavailable(self) -> SwitchUnavailable:
        return SwitchUnavailable(f"the switch {self.name} at {self.address} is not ready ({self.last_error})")


async def read_counters(
    supervisors: list[SwitchSupervisor], names: list[str], timeout: float
) -> dict[str, Counters | Exception]:
    """The P4 counter reader: every switch's counter arrays ``names``, the switches read in
    parallel; a switch that is away, or slower than ``timeout``, gives its error instead (a reader
    must not hang on it). Keyed by switch name."""

    async def one(s: SwitchSupervisor) -> Counters | Exception:
        try:
            return await asyncio.wait_for(s.read_counters(names), timeout)
        except Exception as e:
            return e

    results = await asyncio.gather(*(one(s) for s in supervisors))
    return {s.name: r for s, r in zip(supervisors, results, strict=True)}


class SwitchFleet:
    """The supervisors of all switches, each connection loop a task on the running loop."""

    def __init__(self, supervisors: list[SwitchSupervisor]) -> None:
        self.supervisors = supervisors
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> SwitchFleet:
        """Starts every supervisor (call it on the loop)."""
        self._tasks = [asyncio.create_task(s.run(), name=f"supervise {s.name}") for s in self.supervisors]
        return self

    async def wait_ready(self, timeout: float) -> bool:
        """All switches ready (each waited for in parallel, within ``timeout``)."""
        return all(await asyncio.gather(*(s.wait_ready(timeout) for s in self.supervisors)))

    async def read_counters(self, names: list[str], timeout: float) -> dict[str, Counters | Exception]:
        return await read_counters(self.supervisors, names, timeout)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for s in self.supervisors:
            s.ready = False

    async def __aenter__(self) -> SwitchFleet:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
