"""Ordinary traffic crosses the same switch: ARP (answered for the aggregator), host-to-host TCP."""

from __future__ import annotations

import socket
import threading
from typing import Any

from scapy.layers.l2 import ARP, Ether

from switchagg_controller import p4_program
from switchagg_lab.bmv2.frames import Wire
from switchagg_lab.testbed import AGG_IP, AGG_MAC, in_netns


def test_switch_answers_arp_for_the_aggregator(bed: Any, switch: Any, wire: Wire) -> None:
    switch.apply(p4_program.desired_state(bed.topology(), []))
    wire.drain()
    e = bed.endpoints[1]
    request = Ether(src=e.mac, dst="ff:ff:ff:ff:ff:ff") / ARP(op=1, hwsrc=e.mac, psrc=e.ip, pdst=AGG_IP)
    cap = wire.exchange(e.index, [bytes(request)], kinds=("arp",))
    replies = [Ether(f) for f in cap.frames[e.index]]
    assert len(replies) == 1, [r.summary() for r in replies]
    r = replies[0]
    assert (r.dst, r.src) == (e.mac, AGG_MAC)
    assert (r[ARP].op, r[ARP].hwsrc, r[ARP].psrc, r[ARP].hwdst, r[ARP].pdst) == (
        2,
        AGG_MAC,
        AGG_IP,
        e.mac,
        e.ip,
    )
    # A request for the aggregator is answered, never flooded to the other hosts.
    assert all(cap.frames[o.index] == [] for o in bed.endpoints if o.index != e.index)


def test_tcp_between_hosts_crosses_the_switch(bed: Any, switch: Any) -> None:
    switch.apply(p4_program.desired_state(bed.topology(), []))
    a, b = bed.endpoints[2], bed.endpoints[3]
    with in_netns(b.ns):
        server = socket.create_server((b.ip, 0))
    server.settimeout(30)
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            data = b""
            while len(data) < 100_000:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            got.append(data)
            conn.sendall(b"ok")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with in_netns(a.ns):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with client:
        client.settimeout(30)
        client.connect((b.ip, server.getsockname()[1]))  # ARP for b is flooded through the switch
        payload = bytes(range(256)) * 391
        client.sendall(payload[:100_000])
        assert client.recv(2) == b"ok"
    t.join(timeout=30)
    server.close()
    assert got == [payload[:100_000]]
