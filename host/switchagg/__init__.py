"""switchagg: in-network aggregation of gradients, on a P4 switch or a software aggregator."""

from importlib import metadata as _metadata

from switchagg import protocol
from switchagg.errors import (
    SwitchaggAborted,
    SwitchaggError,
    SwitchaggMismatch,
    SwitchaggPeerGone,
    SwitchaggTeardown,
    SwitchaggTimeout,
)
from switchagg.session import Session

try:
    __version__ = _metadata.version("switchagg")  # the one version: pyproject.toml's, as installed
except _metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Session",
    "SwitchaggAborted",
    "SwitchaggError",
    "SwitchaggMismatch",
    "SwitchaggPeerGone",
    "SwitchaggTeardown",
    "SwitchaggTimeout",
    "__version__",
    "protocol",
]
