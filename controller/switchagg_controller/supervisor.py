"""Keeps one switch programmed: connects, pushes the pipeline and all desired state, and does it
again whenever the switch went away or came back without our pipeline (a restart).

After a restart the switch's registers are zero and its slot state is gone, so ``on_restart``
runs before the state is pushed again: the job manager gives every job a new generation, so no
slot mixes contributions from before and after. Workers then continue (their retransmissions
refill the slots) or fail with their session timeout; never with a wrong sum.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from switchagg_controller.model import SwitchState
from switchagg_controller.p4runtime_client import P4RuntimeError, SwitchConnection, pipeline_cookie

log = logging.getLogger("switchagg.supervisor")


class SwitchUnavailable(P4RuntimeError):
    """The switch is not connected right now; the supervisor keeps trying."""


class SwitchSupervisor:
    def __init__(
        self,
        address: str,
        device_id: int,
        bmv2_json: Path,
        p4info: Path,
        desired: Callable[[], SwitchState],
        on_restart: Callable[[], None] = lambda: None,
        election_id: tuple[int, int] = (0, 1),
        interval: float = 0.5,
        timeout: float = 5.0,
    ) -> None:
        self.address, self.device_id, self.election_id = address, device_id, election_id
        self.bmv2_json, self.p4info = Path(bmv2_json), Path(p4info)
        self.cookie = pipeline_cookie(self.bmv2_json.read_bytes(), self.p4info.read_bytes())
        self.desired, self.on_restart = desired, on_restart
        self.interval, self.timeout = interval, timeout
        self.pushes = 0  # times the pipeline was (re)pushed; tests and logs read it
        self.last_error: BaseException | None = None
        self._conn: SwitchConnection | None = None
        self._lock = threading.RLock()  # one writer at a time: pushes from jobs vs. recovery
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="switch-supervisor", daemon=True)

    def start(self) -> SwitchSupervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 10.0)
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._ready.clear()

    def wait_ready(self, timeout: float) -> bool:
        """True once the switch is connected and holds the desired state."""
        return self._ready.wait(timeout)

    def connection(self) -> SwitchConnection:
        with self._lock:
            if self._conn is None or not self._ready.is_set():
                raise SwitchUnavailable(f"the switch at {self.address} is not connected ({self.last_error})")
            return self._conn

    def push(self, state: SwitchState) -> None:
        """Applies ``state`` now; raises SwitchUnavailable while the switch is away."""
        if not self._ready.is_set():  # fail fast rather than wait for a reconnect attempt
            raise SwitchUnavailable(f"the switch at {self.address} is not connected ({self.last_error})")
        with self._lock:
            self.connection().apply(state)

    # Lock order: the job manager's lock -> this lock -> the P4 data plane's lock. So on_restart
    # (which takes the job manager's lock) runs without this lock held, and so does everything
    # slow that does not change the switch (connecting, health checks).

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self._conn
                if conn is None:
                    self._connect()
                elif not self._healthy(conn):
                    log.warning("switch %s went away; reconnecting", self.address)
                    self._drop()
                    continue
            except Exception as e:  # keep supervising whatever failed; report it once per change
                if repr(e) != repr(self.last_error):
                    log.warning("switch %s: %s", self.address, e)
                self.last_error = e
                self._drop()
            self._stop.wait(self.interval)

    def _healthy(self, conn: SwitchConnection) -> bool:
        return conn.is_alive() and conn.get_pipeline_cookie() == self.cookie

    def _drop(self) -> None:
        with self._lock:
            self._ready.clear()
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _connect(self) -> None:
        conn = SwitchConnection(self.address, self.device_id, self.election_id, self.timeout).connect()
        try:
            # Our pipeline still there means the controller restarted, not the switch.
            if conn.ensure_pipeline(self.bmv2_json, self.p4info):
                self.pushes += 1
                self.on_restart()
            with self._lock:
                conn.apply(self.desired())
                self._conn = conn
                self._ready.set()
        except Exception:
            conn.close()
            raise
        self.last_error = None
        log.info("switch %s programmed (pipeline pushes: %d)", self.address, self.pushes)
