"""A clean exit after gloo collectives were run from Python.

A gloo worker thread (``pt_gloo_runloop``) frees each collective after it finishes, and a barrier
frees the collectives that were in flight when it began. The tensors it frees may be Python objects
(any tensor a Python caller handed to gloo: the backend's delegated collectives, the comm hook's
fallbacks, a script's own all_reduce), and freeing one takes the GIL. If the interpreter is
finalizing by then, Python ends that thread inside a C++ destructor and the process aborts with
"terminate called without an active exception", after its work is done (torch 2.13, Python 3.11).

So at exit, before finalization, ``settle`` waits with the GIL released until no gloo worker thread
has been running for a few consecutive looks: a thread that was waiting for the GIL to free a
tensor gets it now, and finishes while the interpreter is still whole.
"""

from __future__ import annotations

import atexit
import os
import time

GLOO_THREAD = "pt_gloo_runloop"
POLL_S = 0.01
QUIET_LOOKS = 3  # consecutive looks with every gloo worker thread asleep
BOUND_S = 2.0  # never hold an exit longer (a thread stuck on a dead peer does not free anything)
_TASKS = "/proc/self/task"


def gloo_threads() -> dict[int, str]:
    """The process's gloo worker threads and their scheduler states (R running, S sleeping, ...)."""
    states = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:  # not Linux: no way to look
        return {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        end = stat.rfind(")")  # the name may hold anything; the state follows its last ")"
        if stat[stat.find("(") + 1 : end] == GLOO_THREAD:
            states[int(tid)] = stat[end + 2 : end + 3]
    return states


def settle(bound: float = BOUND_S) -> bool:
    """Waits until every gloo worker thread sleeps (QUIET_LOOKS looks in a row, POLL_S apart), at
    most ``bound`` seconds; time.sleep releases the GIL meanwhile. True once they are quiet (or
    there are none)."""
    if not gloo_threads():
        return True
    deadline, quiet = time.monotonic() + bound, 0
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        busy = any(state not in "SI" for state in gloo_threads().values())
        quiet = 0 if busy else quiet + 1
        if quiet >= QUIET_LOOKS:
            return True
    return False


def install() -> None:
    """Run ``settle`` at exit. switchagg.torch calls it once, on import, before any group exists:
    atexit runs handlers last-registered first, so the groups close before it runs."""
    atexit.register(settle)
