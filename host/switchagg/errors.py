"""The exceptions switchagg raises (defined in C so the packet path can raise them): one class per cause,
all SwitchaggError.

- SwitchaggTimeout: no progress within the call's timeout, with no peer known to be gone (a peer stalled
  past it, made a call fewer, or the aggregator is unreachable). Also a TimeoutError.
- SwitchaggPeerGone: a peer rank's process is gone (its connection reset) or it closed its group.
- SwitchaggMismatch: the ranks' calls differed (length, dtype, op, structure, order); the message says how.
- SwitchaggAborted: a rank gave up its call after a local error (a bad argument); see that rank's log.
- SwitchaggTeardown: the control plane (job service) ended the job.

After any of them a session's slots are out of step with its peers', and every later call raises the same
class with the first failure's reason.
"""

from switchagg._core import (
    SwitchaggAborted,
    SwitchaggError,
    SwitchaggMismatch,
    SwitchaggPeerGone,
    SwitchaggTeardown,
    SwitchaggTimeout,
)


def cause_of(error: BaseException) -> type[SwitchaggError]:
    """The class a call cancelled because ``error`` ended another (a lane's, a shard's) raises: the
    error's own, if a switchagg error, so a mismatch on one is a mismatch on all."""
    return type(error) if isinstance(error, SwitchaggError) else SwitchaggError


__all__ = [
    "SwitchaggAborted",
    "SwitchaggError",
    "SwitchaggMismatch",
    "SwitchaggPeerGone",
    "SwitchaggTeardown",
    "SwitchaggTimeout",
]
