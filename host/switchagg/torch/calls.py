"""Where each collective ran: counters per op and path (network or delegated to gloo) and the log.

``SWITCHAGG_DEBUG=INFO`` (or the logging module: logger ``switchagg.torch``) logs the first call of
each (op, dtype, device, path, SUM or AVG, lane width) of a group, with the reason when it was
delegated and, in the network, how it was reduced (an AVG: SUM in the network, then divided on each
rank) and in which lanes, and the bytes sent per lane width when the group closes;
``DEBUG`` logs every call; ``WARN`` (the default) only what needs attention, such as DDP gradients
that fall back.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import Counter
from typing import Any

import torch

log = logging.getLogger("switchagg.torch")

NETWORK = "network"
DELEGATED = "delegated"
PATHS = (NETWORK, DELEGATED)
_LEVELS = {"WARN": logging.WARNING, "WARNING": logging.WARNING, "INFO": logging.INFO, "DEBUG": logging.DEBUG}


def configure_from_env() -> None:
    """SWITCHAGG_DEBUG=WARN|INFO|DEBUG: the logger's level, and a stderr handler if it has none."""
    raw = os.environ.get("SWITCHAGG_DEBUG", "").strip().upper()
    if not raw:
        return
    level = _LEVELS.get(raw)
    if level is None:
        raise ValueError(f"SWITCHAGG_DEBUG={raw!r} is not one of WARN, INFO, DEBUG")
    log.setLevel(level)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        rank = os.environ.get("RANK", "?")
        handler.setFormatter(logging.Formatter(f"[switchagg rank {rank}] %(levelname)s %(message)s"))
        log.addHandler(handler)


def first_tensor(args: Any) -> torch.Tensor | None:
    """The first tensor among a collective's arguments (lists of tensors, one level or two, included)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, list | tuple):
            found = first_tensor(a)
            if found is not None:
                return found
    return None


def describe(t: torch.Tensor | None) -> tuple[str, str]:
    if t is None:
        return "-", "-"
    return str(t.dtype).removeprefix("torch."), t.device.type


class CallLog:
    """One group's counters of calls per op and path; the first call of each kind logged at INFO."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.counts: dict[str, Counter[str]] = {p: Counter() for p in PATHS}
        self._seen: set[tuple[str, str, str, str]] = set()
        self._lock = threading.Lock()

    def record(self, op: str, path: str, tensor: torch.Tensor | None, why: str = "", how: str = "") -> bool:
        """Counts the call; True the first time this (op, dtype, device, path, how) is seen. ``why``:
        why it ran on gloo; ``how``: the reduction and where each step of it ran (an AVG is a SUM in
        the network, then a division on every rank), logged in its place."""
        dtype, device = describe(tensor)
        key = (op, dtype, device, path + how)
        with self._lock:
            self.counts[path][op] += 1
            first = key not in self._seen
            self._seen.add(key)
        if first and log.isEnabledFor(logging.INFO):
            because = f" ({why or how})" if why or how else ""
            log.info("%s: %s %s on %s runs %s%s", self.group, op, dtype, device, _where(path), because)
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s %s on %s: %s", self.group, op, dtype, device, path)
        return first

    def closed(self, lane_bytes: dict[str, int]) -> None:
        """Logged at INFO as the group closes: the datagram bytes of its calls per lane width
        (widths.lane_bytes), e.g. ``... 0 in 32-bit lanes, 0 in 16-bit lanes, 2236416 in 8-bit lanes``."""
        if log.isEnabledFor(logging.INFO):
            sent = ", ".join(f"{n} in {w.removeprefix('lanes')}-bit lanes" for w, n in lane_bytes.items())
            log.info("%s: closed; datagram bytes of its network calls: %s", self.group, sent)

    def stats(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {p: dict(c) for p, c in self.counts.items()}

    def series(self) -> dict[tuple[str, str], int]:
        """(op, path) -> calls: the metrics' samples (switchagg_torch_calls_total)."""
        with self._lock:
            return {(op, p): n for p, c in self.counts.items() for op, n in c.items()}


def _where(path: str) -> str:
    return "in the network" if path == NETWORK else "on gloo"
