"""Sending aggregation frames from endpoints and capturing what the switch sends back.

Capture uses a barrier instead of waiting for silence: after a packet, its sender also sends a
"sentinel" frame flooded to every other port and one addressed to itself. bmv2 handles one
ingress port's frames in order and keeps per-port egress queues in order, so when an endpoint
has seen the sentinel it has seen every result the packet caused. No assertion depends on time.
"""

from __future__ import annotations

import select
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from switchagg import protocol
from switchagg_controller import p4_program
from switchagg_lab.testbed import AGG_IP, AGG_MAC, Endpoint

SENTINEL_TYPE = 0x88B5  # IEEE local experimental ethertype
RESULT_PORT_BASE = 40000  # endpoint i receives results on UDP port RESULT_PORT_BASE + i
_PACKET_OUTGOING = 4


def result_port(e: Endpoint) -> int:
    return RESULT_PORT_BASE + e.index


def data_frame(e: Endpoint, payload: bytes, src_ip: str | None = None, sport: int | None = None) -> bytes:
    """A frame from endpoint ``e`` to the aggregator carrying ``payload`` as UDP payload."""
    frame = (
        Ether(src=e.mac, dst=AGG_MAC)
        / IP(src=src_ip or e.ip, dst=AGG_IP)
        / UDP(sport=sport or result_port(e), dport=protocol.UDP_PORT)
        / Raw(payload)
    )
    return bytes(frame)


@dataclass
class Capture:
    """The frames each endpoint received up to the barrier, keyed by endpoint index."""

    frames: dict[int, list[bytes]] = field(default_factory=dict)

    def results(self, index: int) -> list[bytes]:
        """UDP payloads of the aggregation results endpoint ``index`` received, in order."""
        out = []
        for f in self.frames.get(index, []):
            pkt = Ether(f)
            if pkt.haslayer(UDP) and pkt[UDP].sport == protocol.UDP_PORT:
                out.append(bytes(pkt[UDP].payload))
        return out


class Wire:
    """Raw sockets on every endpoint of a testbed."""

    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        self.endpoints = list(endpoints)
        self.socks = {e.index: e.raw_socket() for e in self.endpoints}
        self._seq = 0

    def close(self) -> None:
        for s in self.socks.values():
            s.close()

    def drain(self) -> None:
        """Discards whatever is queued (e.g. from an earlier test)."""
        for s in self.socks.values():
            s.setblocking(False)
            try:
                while True:
                    s.recv(65535)
            except BlockingIOError:
                pass
            finally:
                s.setblocking(True)

    def send(self, index: int, frame: bytes) -> None:
        self.socks[index].send(frame)

    def _sentinels(self, sender: Endpoint, seq: int) -> list[bytes]:
        body = seq.to_bytes(4, "big") * 12  # padded beyond the 60-byte minimum frame
        flood = Ether(src=sender.mac, dst=p4_program.BROADCAST_MAC, type=SENTINEL_TYPE) / Raw(body)
        to_self = Ether(src=sender.mac, dst=sender.mac, type=SENTINEL_TYPE) / Raw(body)
        return [bytes(flood), bytes(to_self)]

    def exchange(
        self, index: int, frames: Sequence[bytes], timeout: float = 30.0, kinds: tuple[str, ...] = ("result",)
    ) -> Capture:
        """Sends frames from endpoint ``index``, then collects every endpoint's frames up to the barrier.

        ``kinds`` says what is kept: "result" (UDP from port 48879) and/or "arp".
        """
        sender = next(e for e in self.endpoints if e.index == index)
        for f in frames:
            self.send(index, f)
        self._seq += 1
        seq = self._seq
        for f in self._sentinels(sender, seq):
            self.send(index, f)
        return self._collect(seq, timeout, kinds)

    def _collect(self, seq: int, timeout: float, kinds: tuple[str, ...]) -> Capture:
        cap = Capture({e.index: [] for e in self.endpoints})
        waiting = {e.index for e in self.endpoints}
        by_fd = {s.fileno(): i for i, s in self.socks.items()}
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no barrier {seq} from the switch at endpoints {sorted(waiting)} in {timeout}s"
                )
            ready, _, _ = select.select([self.socks[i] for i in waiting], [], [], left)
            for s in ready:
                i = by_fd[s.fileno()]
                data, addr = s.recvfrom(65535)
                if addr[2] == _PACKET_OUTGOING:
                    continue
                if _sentinel_seq(data) is not None:
                    if _sentinel_seq(data) == seq:
                        waiting.discard(i)
                    continue
                if ("result" in kinds and _is_result(data)) or ("arp" in kinds and _is_arp(data)):
                    cap.frames[i].append(data)
        return cap


def _sentinel_seq(frame: bytes) -> int | None:
    if len(frame) >= 18 and int.from_bytes(frame[12:14], "big") == SENTINEL_TYPE:
        return int.from_bytes(frame[14:18], "big")
    return None


def _is_arp(frame: bytes) -> bool:
    return len(frame) >= 14 and int.from_bytes(frame[12:14], "big") == 0x0806


def _is_result(frame: bytes) -> bool:
    pkt = Ether(frame)
    return bool(pkt.haslayer(UDP) and pkt[UDP].sport == protocol.UDP_PORT)


def frame_problems(frame: bytes, e: Endpoint) -> list[str]:
    """What is wrong with a result frame delivered to endpoint ``e`` (addresses and checksums)."""
    pkt = Ether(frame)
    problems = []
    want = {
        "eth dst": (pkt.dst, e.mac),
        "eth src": (pkt.src, AGG_MAC),
        "ip dst": (pkt[IP].dst, e.ip),
        "ip src": (pkt[IP].src, AGG_IP),
        "udp dport": (pkt[UDP].dport, result_port(e)),
        "udp sport": (pkt[UDP].sport, protocol.UDP_PORT),
    }
    problems += [f"{k}: {got} != {exp}" for k, (got, exp) in want.items() if got != exp]
    ip_fixed = pkt[IP].copy()
    del ip_fixed.chksum
    if IP(bytes(ip_fixed))[IP].chksum != pkt[IP].chksum:
        problems.append(f"bad IPv4 checksum {pkt[IP].chksum:#06x}")
    udp = pkt[UDP]
    if udp.chksum != 0:
        fixed = pkt[IP].copy()
        del fixed[UDP].chksum
        if IP(bytes(fixed))[UDP].chksum != udp.chksum:
            problems.append(f"bad UDP checksum {udp.chksum:#06x}")
    else:
        problems.append("UDP checksum missing")
    return problems


def counters(
    switch: object, job_indices: Mapping[int, int], leaf_jobs: Collection[int] = ()
) -> tuple[dict[str, int], dict[int, dict[str, int]]]:
    """Drop counts by reason and per-job counts (keyed by job id) read through P4Runtime; the
    jobs in ``leaf_jobs`` (aggregated as a leaf of two levels) with the leaf counters too."""
    read = switch.read_counter  # type: ignore[attr-defined]
    drops_raw = read(p4_program.DROP_COUNTER)
    drops = {r: _packets(drops_raw.get(i, (0, 0))) for r, i in protocol.DROP_INDEX.items()}
    jobs: dict[int, dict[str, int]] = {}
    for job_id, index in job_indices.items():
        names = {
            **p4_program.JOB_COUNTER_NAMES,
            **(p4_program.LEAF_COUNTER_NAMES if job_id in leaf_jobs else {}),
        }
        jobs[job_id] = {name: _packets(read(counter, index)[index]) for name, counter in names.items()}
    return drops, jobs


def _packets(pair: tuple[int, int]) -> int:
    # A (packets, bytes) or (bytes, packets) pair: every frame is over 40 bytes, so the packet
    # count is the smaller one whichever order the client returns.
    return min(pair)


def delta(
    before: tuple[dict[str, int], dict[int, dict[str, int]]],
    after: tuple[dict[str, int], dict[int, dict[str, int]]],
) -> tuple[dict[str, int], dict[int, dict[str, int]]]:
    drops = {k: after[0][k] - before[0].get(k, 0) for k in after[0]}
    jobs = {j: {k: v - before[1].get(j, {}).get(k, 0) for k, v in c.items()} for j, c in after[1].items()}
    return drops, jobs
