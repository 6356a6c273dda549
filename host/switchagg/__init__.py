"""switchagg: in-network aggregation of gradients, on a P4 switch or a software aggregator."""

from switchagg import protocol
from switchagg.errors import SwitchaggError, SwitchaggTimeout
from switchagg.session import Session

__all__ = ["Session", "SwitchaggError", "SwitchaggTimeout", "protocol"]
