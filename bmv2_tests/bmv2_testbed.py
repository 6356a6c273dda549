"""A bmv2 switch wired to one network namespace per endpoint, for tests and the benchmark.

Layout: simple_switch_grpc runs in its own namespace ``<prefix>sw`` (its Thrift server listens on
every address, so it must not sit in the host's namespace); its P4Runtime server listens on a Unix
socket, which the test process reaches from the host namespace. Endpoint i lives in namespace
``<prefix>h<i>`` with ``eth0`` (MAC 02:5a:00:00:00:<i+1>, IPv4 10.201.0.<i+1>/24) cabled by a
veth pair to switch port i+1. Nothing is routed outside the namespaces. ``close()`` removes
everything; a testbed of a process that died is swept by the next one.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bmv2_tools import find_tool, tool_env

from switchagg_controller.model import HostPort, Topology

AGG_IP = "10.201.0.254"
AGG_MAC = "02:5a:00:00:00:fe"
_SUBNET = "10.201.0."
_PREFIX = "sab"  # namespaces and interfaces of these testbeds: sab<pid>x<n>...
_STALE = re.compile(rf"^{_PREFIX}(\d+)x\d+(sw|h\d+)$")
_counter = itertools.count(1)

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class TestbedError(RuntimeError):
    """The testbed could not be built or the switch did not come up; the message says why."""


def sh(*argv: str, ns: str | None = None, check: bool = True, timeout: float = 60) -> str:
    cmd = ["ip", "netns", "exec", ns, *argv] if ns else list(argv)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=tool_env())
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


def sweep_stale() -> None:
    """Deletes namespaces left by testbeds whose process is gone (a killed test run)."""
    for line in sh("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _STALE.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue  # still running: not ours to touch
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        for p in sh("ip", "netns", "pids", name, check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(p), 9)
        sh("ip", "netns", "del", name, check=False)


@dataclass(frozen=True)
class Endpoint:
    index: int
    ns: str
    mac: str
    ip: str
    port: int  # switch port
    ifname: str = "eth0"

    def host(self) -> HostPort:
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

    def popen(self, argv: Sequence[str], **kw: object) -> subprocess.Popen[str]:
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], text=True, **kw)  # type: ignore[call-overload]

    def set_loss(self, percent: int) -> None:
        """Drops ``percent``% of aggregation packets leaving and arriving here (nftables numgen random)."""
        if not 0 <= percent <= 100:
            raise ValueError(f"loss must be 0..100 percent, not {percent}")
        sh("nft", "delete table netdev saloss", ns=self.ns, check=False)
        if percent == 0:
            return
        # netdev egress/ingress hooks on eth0: a drop there is silent to the sender, like a loss
        # on the wire (an inet output-hook drop would fail the worker's sendmsg with EPERM).
        rules = (
            "table netdev saloss {\n"
            f"  chain outbound {{\n    type filter hook egress device {self.ifname} priority 0;\n"
            "    policy accept;\n"
            f"    udp dport 48879 numgen random mod 100 < {percent} counter drop\n  }}\n"
            f"  chain inbound {{\n    type filter hook ingress device {self.ifname} priority 0;\n"
            "    policy accept;\n"
            f"    udp sport 48879 numgen random mod 100 < {percent} counter drop\n  }}\n"
            "}\n"
        )
        p = subprocess.run(
            ["ip", "netns", "exec", self.ns, "nft", "-f", "-"],
            input=rules,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if p.returncode != 0:
            raise TestbedError(f"nft in {self.ns}: {p.stderr.strip()}")

    def lost(self) -> int:
        """Packets the loss rules dropped so far (both directions)."""
        out = sh("nft", "list table netdev saloss", ns=self.ns, check=False)
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", out))


class Testbed:
    """``n`` endpoints around one simple_switch_grpc; use as a context manager."""

    def __init__(self, n: int, workdir: Path, device_id: int = 0, static_arp: bool = False) -> None:
        if not 1 <= n <= 32:
            raise ValueError(f"a testbed has 1..32 endpoints, not {n}")
        self.prefix = f"{_PREFIX}{os.getpid()}x{next(_counter)}"
        self.switch_ns = f"{self.prefix}sw"
        self.workdir = workdir
        self.device_id = device_id
        self.static_arp = static_arp
        self.grpc_socket = workdir / "p4runtime.sock"
        self.endpoints = [
            Endpoint(i, f"{self.prefix}h{i}", f"02:5a:00:00:00:{i + 1:02x}", f"{_SUBNET}{i + 1}", i + 1)
            for i in range(n)
        ]
        self._switch: subprocess.Popen[bytes] | None = None
        self._made: list[str] = []

    @property
    def grpc_address(self) -> str:
        return f"unix:{self.grpc_socket}"

    def topology(self) -> Topology:
        return Topology(
            switch_address=self.grpc_address,
            device_id=self.device_id,
            hosts=tuple(e.host() for e in self.endpoints),
            aggregator_ip=AGG_IP,
            aggregator_mac=AGG_MAC,
        )

    def __enter__(self) -> Testbed:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self._made.append(name)
        sh("ip", "link", "set", "lo", "up", ns=name)
        sh("sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", ns=name)
        sh("sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1", ns=name)

    def start(self) -> None:
        sweep_stale()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._add_ns(self.switch_ns)
        for e in self.endpoints:
            self._add_ns(e.ns)
            sw_if = f"{self.prefix}p{e.index}"
            sh("ip", "link", "add", sw_if, "type", "veth", "peer", "name", f"{self.prefix}e{e.index}")
            sh("ip", "link", "set", sw_if, "netns", self.switch_ns)
            sh("ip", "link", "set", f"{self.prefix}e{e.index}", "netns", e.ns)
            sh("ip", "link", "set", f"{self.prefix}e{e.index}", "name", e.ifname, ns=e.ns)
            sh("ip", "link", "set", e.ifname, "address", e.mac, ns=e.ns)
            sh("ip", "addr", "add", f"{e.ip}/24", "dev", e.ifname, ns=e.ns)
            # Kernel checksum offload would hand bmv2 frames with unfinished checksums.
            for ns, ifname in ((e.ns, e.ifname), (self.switch_ns, sw_if)):
                sh("ethtool", "-K", ifname, "tx", "off", "rx", "off", "sg", "off", ns=ns, check=False)
                sh("ip", "link", "set", ifname, "mtu", "1500", "up", ns=ns)
            if self.static_arp:  # otherwise the switch itself answers ARP for the aggregator
                neigh = ["ip", "neigh", "replace", AGG_IP, "lladdr", AGG_MAC, "nud", "permanent"]
                sh(*neigh, "dev", e.ifname, ns=e.ns)
        self._start_switch()

    def _start_switch(self) -> None:
        binary = find_tool("simple_switch_grpc")
        if binary is None:
            raise TestbedError("simple_switch_grpc not found")
        argv = ["ip", "netns", "exec", self.switch_ns, binary, "--no-p4", "--device-id", str(self.device_id)]
        for e in self.endpoints:
            argv += ["-i", f"{e.port}@{self.prefix}p{e.index}"]
        argv += ["--thrift-port", "9090", "--notifications-addr", f"ipc://{self.workdir}/notifications.ipc"]
        if os.environ.get("SWITCHAGG_BMV2_LOG"):
            argv += ["--log-file", str(self.workdir / "bmv2"), "--log-level", "debug", "--log-flush"]
        argv += ["--", "--grpc-server-addr", self.grpc_address]
        with open(self.workdir / "switch.out", "wb") as out:
            self._switch = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=tool_env())
        deadline = time.monotonic() + 60
        while not self.grpc_socket.exists():
            if self._switch.poll() is not None:
                raise TestbedError(
                    f"simple_switch_grpc exited ({self._switch.returncode}): {self.switch_log()}"
                )
            if time.monotonic() > deadline:
                raise TestbedError(f"simple_switch_grpc did not open {self.grpc_socket}: {self.switch_log()}")
            time.sleep(0.05)

    def switch_log(self) -> str:
        try:
            return (self.workdir / "switch.out").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def switch_alive(self) -> bool:
        return self._switch is not None and self._switch.poll() is None

    def cli(self, commands: str) -> str:
        """Runs simple_switch_CLI commands (Thrift, inside the switch's namespace)."""
        binary = find_tool("simple_switch_CLI")
        if binary is None:
            raise TestbedError("simple_switch_CLI not found")
        p = subprocess.run(
            ["ip", "netns", "exec", self.switch_ns, binary, "--thrift-port", "9090"],
            input=commands,
            capture_output=True,
            text=True,
            timeout=120,
            env=tool_env(),
        )
        if p.returncode != 0:
            raise TestbedError(f"simple_switch_CLI failed: {p.stderr.strip()}")
        return p.stdout

    def register(self, name: str, index: int) -> int:
        out = self.cli(f"register_read {name} {index}\n")
        m = re.search(rf"{re.escape(name)}\[{index}\]\s*=\s*(-?\d+)", out)
        if not m:
            raise TestbedError(f"cannot read {name}[{index}]: {out.strip()}")
        return int(m.group(1))

    def registers(self, name: str, indices: Sequence[int]) -> list[int]:
        """Several cells of one register array in one CLI run."""
        out = self.cli("".join(f"register_read {name} {i}\n" for i in indices))
        found = {int(i): int(v) for i, v in re.findall(rf"{re.escape(name)}\[(\d+)\]\s*=\s*(-?\d+)", out)}
        missing = [i for i in indices if i not in found]
        if missing:
            raise TestbedError(f"cannot read {name}{missing}: {out.strip()[-500:]}")
        return [found[i] for i in indices]

    def close(self) -> None:
        if self._switch is not None and self._switch.poll() is None:
            self._switch.terminate()
            try:
                self._switch.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._switch.kill()
                self._switch.wait(timeout=10)
        for name in reversed(self._made):
            for p in sh("ip", "netns", "pids", name, check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(p), 9)
            sh("ip", "netns", "del", name, check=False)
        self._made.clear()
        with contextlib.suppress(FileNotFoundError):
            self.grpc_socket.unlink()
