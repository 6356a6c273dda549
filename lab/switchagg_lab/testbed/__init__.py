"""An emulated cluster on one Linux host: network namespaces for the workers and the switch, veth
links with optional rate caps and loss, and the switch itself (bmv2, or the software aggregator
behind a Linux bridge). Used by the bmv2 test suite, the benchmarks and ``switchagg-testbed``.

Needs root and iproute2 (plus nftables for loss, ethtool and bmv2 for the bmv2 data plane);
:func:`tools.missing_for` says what is absent.
"""

from switchagg_lab.testbed.netns import Endpoint, TestbedError, in_netns
from switchagg_lab.testbed.rack import AGG_IP, AGG_MAC, Testbed

__all__ = ["AGG_IP", "AGG_MAC", "Endpoint", "Testbed", "TestbedError", "in_netns"]
