"""What the console scripts share: --version, a quiet end on a closed pipe, tc's rate units and
hidden aliases of renamed flags (switchagg-aggregator, -demo, -testbed and switchagg-ctl)."""

from __future__ import annotations

import argparse
import functools
import os
import select
import sys
from collections.abc import Callable
from typing import ParamSpec

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
