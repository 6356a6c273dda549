"""What the console scripts share: --version, a quiet end on a closed pipe, tc's rate units and
hidden aliases of renamed flags (switchagg-aggregator, -demo, -testbed and switchagg-ctl)."""

from __future__ import annotations

import argparse
import functools
import os
import re
import select
import sys
from collections.abc import Callable
from typing import Any, ParamSpec

from switchagg import __version__

P = ParamSpec("P")


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: the installed distribution's version (importlib.metadata)."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def stdout_closed() -> bool:
    """Whether the reader of stdout went away (a pipe whose read end is closed polls POLLERR)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no real file behind sys.stdout
        return False


def silence_stdout() -> None:
    """Points stdout at /dev/null, so that no later write or the flush at exit fails again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def quiet_broken_pipe(main: Callable[P, int]) -> Callable[P, int]:
    """A console script's main that ends with exit status 0 and no traceback when its stdout's
    reader goes away (``switchagg-ctl counters --watch 1 | head -5``), as ``head`` expects. A
    broken pipe that is not stdout's (a socket) is an error as before."""

    @functools.wraps(main)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            try:
                return main(*args, **kwargs)
            finally:  # also after --help's SystemExit; here, not at exit, where the error is printed
                sys.stdout.flush()
        except BrokenPipeError:
            if not stdout_closed():
                raise
            silence_stdout()
            return 0

    return wrapper


# tc's units (tc(8), "RATES"): bit/s and byte/s ("bps"), SI and IEC prefixes; the value in Mbit/s.
_PREFIX = {
    "": 1.0,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_RATE = re.compile(
    r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*(?:(|k|m|g|t|ki|mi|gi|ti)(bit|bps))?\s*$", re.I
)


def parse_rate(text: str) -> float:
    """A link rate in Mbit/s from ``200`` (a bare number: Mbit/s, as before) or tc's units:
    ``1gbit``, ``200mbit``, ``500kbit``, ``100mibit``, ``12.5mbps`` (bytes per second, as tc)."""
    m = _RATE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a rate: a number of Mbit/s, or tc's units (1gbit, 200mbit, 500kbit, 10mbps)"
        )
    value = float(m.group(1)) * 10 ** int(m.group(2) or 0)
    prefix, unit = (m.group(3) or "").lower(), (m.group(4) or "").lower()
    mbit = value if not unit else value * _PREFIX[prefix] * (8 if unit == "bps" else 1) / 1e6
    if not mbit > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a rate must be positive")
    return mbit


class _RenamedFlag(argparse.Action):
    """A flag's former name, kept for one release: it stores what the new one does, says the new
    name on stderr and is hidden from --help."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        old = f"{parser.prog}: {option_string} is now {self.new}"
        print(f"{old} (the old name stays for one release)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_renamed(parser: argparse.ArgumentParser, old: str, action: argparse.Action) -> None:
    """Accepts ``old`` (hidden) for the flag ``action`` (one value, as add_argument returned it)."""
    new = max(action.option_strings, key=len)
    typed: dict[str, Any] = {"type": action.type} if action.type is not None else {}
    parser.add_argument(old, action=_RenamedFlag, dest=action.dest, new=new, **typed)
