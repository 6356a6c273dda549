"""Network namespaces, veth links, rate caps and loss rules: the pieces a testbed is made of."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from switchagg_lab.testbed.tools import tool_env

_CLONE_NEWNET = 0x40000000
_veths = itertools.count(1)
QUEUE_BYTES = 4 << 20  # the least a capped link queues before it drops
_libc = ctypes.CDLL(None, use_errno=True)


class TestbedError(RuntimeError):
    """The testbed could not be built or a part of it did not come up; the message says why."""


def sh(
    *argv: str, ns: str | None = None, check: bool = True, timeout: float = 60, stdin: str | None = None
) -> str:
    cmd = ["ip", "netns", "exec", ns, *argv] if ns else list(argv)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=tool_env(), input=stdin)
    if check and p.returncode != 0:
        raise TestbedError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Runs the block with this thread in namespace ``name`` (sockets made there stay there)."""
    with open("/proc/self/ns/net") as orig, open(f"/var/run/netns/{name}") as target:
        if _libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
        try:
            yield
        finally:
            if _libc.setns(orig.fileno(), _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original namespace failed")


def namespaces() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


ETC_NETNS = Path("/etc/netns")  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc


def hosts_text(names: Iterable[tuple[str, str]]) -> str:
    """An /etc/hosts for a namespace: localhost and each (IPv4 address, name), each address also in its
    IPv4-mapped IPv6 form. c10d's store accepts on an IPv6 socket and names every client by that
    form (getnameinfo); without an entry the lookup goes to a DNS server the namespace cannot reach,
    and every rank prints "The hostname of the client socket cannot be retrieved" (EAI_AGAIN)."""
    pairs = [("127.0.0.1", "localhost"), *names]
    return "".join(f"{ip} {name}\n" for ip, name in pairs) + "".join(
        f"::ffff:{ip} {name}\n" for ip, name in pairs
    )


def add_netns(name: str, hosts: str | None = None) -> None:
    """A namespace with loopback up, IPv6 off and, if given, its own /etc/hosts."""
    if hosts is not None:
        (ETC_NETNS / name).mkdir(parents=True, exist_ok=True)
        (ETC_NETNS / name / "hosts").write_text(hosts)
    sh("ip", "netns", "add", name)
    sh("ip", "link", "set", "lo", "up", ns=name)
    sh("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", ns=name)
    sh("sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1", ns=name)


def del_netns(name: str) -> None:
    """Kills every process in the namespace, then deletes it (its veth ends and qdiscs go with it)."""
    for p in sh("ip", "netns", "pids", name, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(p), 9)
    sh("ip", "netns", "del", name, check=False)
    shutil.rmtree(ETC_NETNS / name, ignore_errors=True)


def _root_links() -> list[str]:
    names = []
    for line in sh("ip", "-o", "link", "show").splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names


def remove_matching(pattern: re.Pattern[str]) -> list[str]:
    """Deletes the namespaces and root-namespace links whose names match (a crashed build's leftovers)."""
    gone = [n for n in namespaces() if pattern.match(n)]
    for name in gone:
        del_netns(name)
    for link in _root_links():
        if pattern.match(link):
            sh("ip", "link", "del", link, check=False)
            gone.append(link)
    if ETC_NETNS.is_dir():
        for d in ETC_NETNS.iterdir():
            if pattern.match(d.name):
                shutil.rmtree(d, ignore_errors=True)
    return gone


def pid_alive(pid: int | None) -> bool:
    """Whether the process runs; a zombie (no reaper in some containers) counts as gone."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


_TEMP_LINK = re.compile(r"^tv(\d+)[ab]\d+$")


def sweep_dead_owners(pattern: re.Pattern[str]) -> None:
    """Deletes namespaces (and half-built veths) whose name's first group is the pid of a process
    that is gone: what a killed test run left behind."""
    for name in namespaces():
        m = pattern.match(name)
        if m and not pid_alive(int(m.group(1))):
            del_netns(name)
    for link in _root_links():
        m = _TEMP_LINK.match(link)
        if m and not pid_alive(int(m.group(1))):
            sh("ip", "link", "del", link, check=False)


def veth(a: str, ns_a: str, b: str, ns_b: str, mtu: int) -> None:
    """A veth pair with end ``a`` in ``ns_a`` and end ``b`` in ``ns_b``, both up."""
    k = next(_veths)
    tmp_a, tmp_b = f"tv{os.getpid()}a{k}", f"tv{os.getpid()}b{k}"  # unique in the root ns
    sh("ip", "link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
    for tmp, ns, name in ((tmp_a, ns_a, a), (tmp_b, ns_b, b)):
        sh("ip", "link", "set", tmp, "netns", ns)
        sh("ip", "link", "set", tmp, "name", name, ns=ns)
    for ns, ifname in ((ns_a, a), (ns_b, b)):
        sh("ip", "link", "set", ifname, "mtu", str(mtu), "up", ns=ns)


def cap_rate(ns: str, ifname: str, mbit: float) -> None:
    """Caps what leaves ``ifname`` at ``mbit`` Mbit/s with a token bucket (netem and fq are not
    available everywhere; tbf is). The bucket holds ~4 ms of traffic (at least 64 kB) so that a
    GSO burst passes; the queue behind it holds 100 ms of traffic but at least 4 MB, a switch
    port's share of a deep buffer, so that a job's window of packets is queued, not dropped."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes * 0.004))
    limit = max(QUEUE_BYTES, int(rate_bytes * 0.1))
    sh(
        "tc", "qdisc", "replace", "dev", ifname, "root", "tbf",
        "rate", f"{max(1, round(mbit * 1e6))}bit", "burst", str(burst), "limit", str(limit), ns=ns,
    )  # fmt: skip


def link_stats(ns: str, ifname: str) -> dict[str, int]:
    """The qdisc's sent bytes/packets and drops on ``ifname`` (``tc -s``)."""
    out = sh("tc", "-s", "qdisc", "show", "dev", ifname, ns=ns)
    m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", out)
    if not m:
        return {"bytes": 0, "packets": 0, "dropped": 0, "overlimits": 0}
    return dict(zip(("bytes", "packets", "dropped", "overlimits"), map(int, m.groups()), strict=True))


LOSS_SCALE = 100_000  # numgen's range: loss in steps of 0.001%
_GSO_MAX_SEGS = 65535  # a device's default gso_max_segs


def _loss_table(ifname: str) -> str:
    """The nftables table of the loss rules on ``ifname`` (one per interface: a switch namespace
    holds every worker's peer end)."""
    return "saloss" if ifname == "eth0" else f"saloss_{ifname}"


def loss_rule(percent: float) -> str:
    """An nftables netdev rule that drops ``percent``% of the IPv4 frames it sees, counted."""
    below = round(percent * LOSS_SCALE / 100)
    return f"meta protocol ip numgen random mod {LOSS_SCALE} < {below} counter drop"


@dataclass(frozen=True)
class Endpoint:
    """A worker host: its own namespace with ``eth0`` cabled to switch port ``port``."""

    index: int
    ns: str
    mac: str
    ip: str
    port: int  # switch port
    ifname: str = "eth0"
    # The other end of the cable (namespace, interface), where a Linux bridge takes it: loss toward
    # the switch is then dropped there, on arrival, where frames are frames (see set_loss).
    peer: tuple[str, str] | None = None

    def host(self) -> Any:
        from switchagg_controller.model import HostPort  # the controller's type; only bmv2 needs it

        return HostPort(f"h{self.index}", self.port, self.mac, self.ip)

    def raw_socket(self) -> socket.socket:
        """An AF_PACKET socket on this endpoint's eth0: send and capture whole frames."""
        with in_netns(self.ns):
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
            s.bind((self.ifname, 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        return s

    def udp_socket(self, port: int = 0) -> socket.socket:
        with in_netns(self.ns):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((self.ip, port))
        return s

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], text=True, **kw)

    def set_loss(self, percent: float) -> None:
        """Drops ``percent``% of the IPv4 frames leaving and arriving here (nftables numgen random),
        whatever they carry: any fragment of a datagram, a result, gloo's TCP, as congestion and bad
        optics drop frames, not datagrams. Resolution 0.001%; 0 removes the rules.

        A frame is dropped where it arrives: on this end's ingress hook (toward the worker) and on
        the peer's (toward the switch). Over veth a GSO or TSO train (up to 64 kB of UDP GSO
        datagrams or TCP segments) travels as one skb and would meet the dice as one frame; so
        while loss is on, both ends cut trains into frames as they leave (``gso_max_segs 1``),
        before the far end's hook. That costs CPU a NIC's segmentation offload would not, for
        gloo's TCP and switchagg alike. An endpoint without a peer (bmv2 owns the switch's ports,
        and taps a frame before any ingress hook) drops its outbound frames on egress."""
        if not 0 <= percent <= 100:
            raise ValueError(f"loss must be 0..100 percent, not {percent}")
        ends = [(self.ns, self.ifname)] + ([self.peer] if self.peer else [])
        for ns, ifname in ends:
            sh("nft", f"delete table netdev {_loss_table(ifname)}", ns=ns, check=False)
            sh("ip", "link", "set", ifname, "gso_max_segs", "1" if percent else str(_GSO_MAX_SEGS), ns=ns)
        if percent == 0:
            return
        rule = loss_rule(percent)
        chains = [(self.ns, self.ifname, "inbound", "ingress")]
        chains.append(
            (*self.peer, "outbound", "ingress") if self.peer else (self.ns, self.ifname, "outbound", "egress")
        )
        for ns, ifname, chain, hook in chains:
            # netdev hooks: a drop there is silent to the sender, like a loss on the wire (an inet
            # output-hook drop would fail the worker's sendmsg with EPERM). Every IPv4 frame, not
            # `udp dport`: that matches a datagram's first fragment only.
            rules = (
                f"table netdev {_loss_table(ifname)} {{\n"
                f"  chain {chain} {{\n    type filter hook {hook} device {ifname} priority 0;\n"
                f"    policy accept;\n    {rule}\n  }}\n"
                "}\n"
            )
            sh("nft", "-f", "-", ns=ns, stdin=rules, timeout=30)

    def lost(self) -> int:
        """Frames the loss rules dropped so far (both directions)."""
        return sum(self.lost_each_way())

    def lost_each_way(self) -> tuple[int, int]:
        """Frames the loss rules dropped so far: (leaving, arriving)."""
        ends = [(self.ns, self.ifname)] + ([self.peer] if self.peer else [])
        counts: dict[str, int] = {}
        for ns, ifname in ends:
            out = sh("nft", f"list table netdev {_loss_table(ifname)}", ns=ns, check=False)
            for chain, n in re.findall(r"chain (outbound|inbound) \{.*?counter packets (\d+)", out, re.S):
                counts[chain] = counts.get(chain, 0) + int(n)
        return counts.get("outbound", 0), counts.get("inbound", 0)


_Bed = TypeVar("_Bed", bound="Bed")


class Bed:
    """A testbed built by ``start()`` and torn down by ``close()``; as a context manager, a
    start that fails half-way is torn down too."""

    __test__ = False  # not a pytest test class, whatever module imports it

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Bed) -> _Bed:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
