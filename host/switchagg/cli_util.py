"""What the console scripts share: --version, a quiet end on a closed pipe, tc's rate units and
hidden aliases of renamed flags (switchagg-aggregator, -demo, -testbed and switchagg-ctl)."""

from __future__ import annotations

import argparse

from switchagg import __version__


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: the installed distribution's version (importlib.metadata)."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
