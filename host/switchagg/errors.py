"""The exceptions switchagg raises (defined in C so the packet path can raise them)."""

from switchagg._core import SwitchaggError, SwitchaggTimeout

__all__ = ["SwitchaggError", "SwitchaggTimeout"]
