"""Progress of long runs (benchmarks, testbed sweeps): one line per step, on stderr, so that the
tables and JSON a run prints on stdout stay clean and a log shows where a slow run is."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Steps:
    """``step(what, weight)`` prints ``[3/18 17%, 2m10s in, ~10m left] what`` as each step starts.

    ``weight`` is the step's expected cost relative to the others (e.g. megabytes moved); the time
    left is the time so far scaled by the weight still to go. ``total`` is the sum of all weights.
    """

    def __init__(
        self,
        steps: int,
        total: float | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.steps, self.total = steps, float(total if total is not None else steps)
        self._stream, self._clock = stream, clock
        self._started = clock()
        self._done = 0.0  # weight of the steps finished (every step before the current one)
        self._current = 0.0
        self.count = 0

    def step(self, what: str, weight: float = 1.0) -> None:
        self._done += self._current
        self._current = weight
        self.count += 1
        elapsed = self._clock() - self._started
        share = self._done / self.total if self.total else 0.0
        left = f", ~{_duration(elapsed / share * (1 - share))} left" if share > 0 else ""
        line = f"[{self.count}/{self.steps} {share:.0%}, {_duration(elapsed)} in{left}] {what}"
        stream = self._stream if self._stream is not None else sys.stderr
        print(line, file=stream, flush=True)

    def finish(self, what: str = "done") -> None:
        elapsed = self._clock() - self._started
        stream = self._stream if self._stream is not None else sys.stderr
        print(f"[{self.count}/{self.steps} 100%, {_duration(elapsed)}] {what}", file=stream, flush=True)
