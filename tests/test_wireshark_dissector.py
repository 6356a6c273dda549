"""The tshark dissector (tools/wireshark/switchagg.lua): its constants are generated from protocol.py,
it decodes crafted edge cases and malformed packets, and a real demo run captured with tcpdump in a
network namespace decodes to exactly what scapy reads from the same capture and what the workers
sent. Needs tshark (and root, ip and tcpdump for the capture); skipped, with the reason, elsewhere."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import rdpcap, wrpcap

from switchagg import demo, protocol
from switchagg.conformance import pack_lanes, unpack_lanes
from switchagg.scapy_layer import Agg
from switchagg_lab.testbed import netns, tools

ROOT = Path(__file__).resolve().parents[1]
LUA = ROOT / "tools/wireshark/switchagg.lua"
TSHARK = shutil.which("tshark")
needs_tshark = pytest.mark.skipif(
    TSHARK is None, reason="the dissector tests need tshark (apt install tshark)"
)

# tshark -T fields columns: (field, how to read it); the header's fields come from protocol.py.
FIELDS = [f"switchagg.{name}" for name in protocol.HEADER_FIELDS] + [
    "switchagg.flags.prime",
    "switchagg.flags.lane16",
    "switchagg.flags.lane8",
    "switchagg.flags.hello",
    "switchagg.lanes",
    "switchagg.pool.shadow",
    "switchagg.pool.slot",
    "switchagg.values",
]


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("wireshark_generate", ROOT / "tools/wireshark/generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_constants_block_is_current() -> None:
    gen = _generator()
    assert gen.main(["--check"]) == 0, "run python tools/wireshark/generate.py"
    text = LUA.read_text()
    for name, offset, size, _ in gen.header_fields():
        assert f'name = "{name}", offset = {offset}, size = {size}' in text
    assert gen.header_fields()[-1][1] + gen.header_fields()[-1][2] == protocol.HEADER_LEN


def _tshark(pcap: Path, *extra: str) -> str:
    assert TSHARK is not None
    p = subprocess.run(
        [TSHARK, "-n", "-r", str(pcap), "-X", f"lua_script:{LUA}", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "Lua: Error" not in p.stderr and "lua_script" not in p.stderr, p.stderr
    return p.stdout


def _decode(pcap: Path) -> dict[int, dict[str, Any]]:
    """frame number -> the dissector's fields (ints), its values list and its expert infos."""
    columns = ["frame.number", *FIELDS, "switchagg.value", "_ws.expert.message"]
    out = _tshark(
        pcap,
        "-T",
        "fields",
        "-E",
        "separator=/t",
        "-E",
        "occurrence=a",
        "-E",
        "aggregator=,",
        *[arg for c in columns for arg in ("-e", c)],
    )
    rows = {}
    for line in out.splitlines():
        cells = dict(zip(columns, line.split("\t"), strict=True))
        row: dict[str, Any] = {f: int(cells[f], 0) if cells[f] else None for f in FIELDS}  # hex or decimal
        row["values"] = [int(v) for v in cells["switchagg.value"].split(",") if v]
        row["expert"] = cells["_ws.expert.message"]
        rows[int(cells["frame.number"])] = row
    return rows


def _expected(h: protocol.Header) -> dict[str, Any]:
    """What the dissector must show for a packet that protocol.Header decodes to ``h``."""
    names = dict.fromkeys(protocol.HEADER_FIELDS)
    pool = (protocol.POOL_SET_BIT if h.shadow else 0) | h.slot
    fields = {**names, **{k: getattr(h, k) for k in names if k != "pool"}, "pool": pool}
    row: dict[str, Any] = {f"switchagg.{k}": v for k, v in fields.items()}
    row["switchagg.flags.prime"] = 1 if h.flags & protocol.FLAG_PRIME else 0
    row["switchagg.flags.lane16"] = 1 if h.flags & protocol.FLAG_LANE16 else 0
    row["switchagg.flags.lane8"] = 1 if h.flags & protocol.FLAG_LANE8 else 0
    row["switchagg.flags.hello"] = 1 if h.flags & protocol.FLAG_HELLO else 0
    row["switchagg.lanes"] = protocol.LANE_BITS.get(h.flags & protocol.LANE_FLAGS, 0)  # 0: LANES = 0x30
    row["switchagg.pool.shadow"] = h.shadow
    row["switchagg.pool.slot"] = h.slot
    row["switchagg.values"] = len(h.values)
    row["values"] = h.values
    return row


def _udp(payload: bytes, sport: int = 40000, dport: int = protocol.UDP_PORT) -> Ether:
    return Ether() / IP(src="127.0.0.1", dst="127.0.0.1") / UDP(sport=sport, dport=dport) / Raw(payload)


@needs_tshark
def test_every_field_is_registered() -> None:
    assert TSHARK is not None
    p = subprocess.run(
        [TSHARK, "-G", "fields", "-X", f"lua_script:{LUA}"], capture_output=True, text=True, timeout=60
    )
    registered = {line.split("\t")[2] for line in p.stdout.splitlines() if line.startswith("F\t")}
    extra = ["switchagg.value", "switchagg.scale", "switchagg.lane16", "switchagg.lane8"]
    for field in [*FIELDS, *extra, "switchagg.bad_version", "switchagg.truncated"]:
        assert field in registered, field


@needs_tshark
def test_crafted_edge_cases_decode_field_by_field(tmp_path: Path) -> None:
    headers = [
        protocol.Header(
            job=0xFFFF,
            rank=31,
            slot=protocol.POOL_SLOT_MASK,
            shadow=1,
            offset=2**32 - 1,
            exp=127,
            type=protocol.MSG_RESULT,
            values=[-(2**31), 2**31 - 1, 0, -1],
        ),
        protocol.Header(job=1, rank=0, slot=0, shadow=0, offset=0, exp=protocol.EXP_NONE, values=[5]),
        protocol.Header(
            job=7,
            rank=3,
            slot=1023,
            shadow=1,
            offset=64,
            exp=-126,
            flags=protocol.FLAG_PRIME,
            values=[0] * protocol.P4_K,
        ),
    ]
    packets = [_udp(h.pack()) for h in headers]
    packets.append(_udp(headers[0].pack(), sport=protocol.UDP_PORT, dport=40000))  # aggregator to worker
    wrpcap(str(tmp_path / "crafted.pcap"), packets)
    rows = _decode(tmp_path / "crafted.pcap")
    assert len(rows) == len(packets)
    for frame, h in enumerate([*headers, headers[0]], start=1):
        got = rows[frame]
        assert got.pop("expert") == "", f"frame {frame}"
        assert got == _expected(protocol.Header.unpack(h.pack())), f"frame {frame}"
    info = _tshark(tmp_path / "crafted.pcap")
    assert "RESULT job=65535 rank=31 slot=32767/1 off=4294967295 K=4 exp=127 call=0/0" in info
    assert f"DATA job=7 rank=3 slot=1023/1 off=64 K={protocol.P4_K} exp=-126 call=0/0 [PRIME]" in info
    assert "exp=none" in info


@needs_tshark
def test_malformed_packets_get_the_aggregators_drop_reason(tmp_path: Path) -> None:
    good = protocol.Header(job=1, rank=0, slot=2, values=[1, 2, 3, 4])
    cases = {
        f"version 9, expected {protocol.VERSION}": protocol.Header(**{**good.__dict__, "version": 9}).pack(),
        "type 7 is neither DATA, RESULT nor STATUS": protocol.Header(**{**good.__dict__, "type": 7}).pack(),
        "LANES 0x30 names no lane width": protocol.Header(**{**good.__dict__, "flags": 0x32}).pack(),
        "elems says 4 values, the payload has 12 bytes": good.pack()[:-4],
        "elems says 4 values, the payload has 18 bytes": good.pack() + b"\x00\x01",
        f"10 bytes, shorter than the {protocol.HEADER_LEN}-byte header": good.pack()[:10],
    }
    wrpcap(str(tmp_path / "bad.pcap"), [_udp(raw) for raw in cases.values()])
    rows = _decode(tmp_path / "bad.pcap")
    for frame, message in enumerate(cases, start=1):
        assert rows[frame]["expert"] == message, f"frame {frame}"
    assert rows[5]["values"] == [1, 2, 3, 4]  # two trailing bytes are not a value


@needs_tshark
def test_narrow_lanes_decode_as_scale_bytes_and_lanes(tmp_path: Path) -> None:
    """docs/PROTOCOL.md, Narrow lanes: at K = 64, 4 scale bytes and 126 16-bit lanes, 8 and 248 8-bit
    ones; the int32 words stay listed as .value (what the data plane adds word by word)."""
    scales = [0x80, 0x7F, 0xFF]
    cases = {16: [32767, -1, -32768, 5], 8: [127, -1, -128, 5]}
    headers = [
        protocol.Header.unpack(
            protocol.Header(
                job=3, rank=1, slot=7, flags=protocol.FLAG_FLOAT | protocol.LANE_FLAG[bits], values=words
            ).pack()
        )
        for bits, lanes in cases.items()
        for words in [pack_lanes(lanes, scales, protocol.P4_K, bits)]
    ]
    wrpcap(str(tmp_path / "narrow.pcap"), [_udp(h.pack()) for h in headers])
    rows = _decode(tmp_path / "narrow.pcap")
    columns = ["frame.number", "switchagg.scale", "switchagg.lane16", "switchagg.lane8"]
    out = _tshark(
        tmp_path / "narrow.pcap",
        *("-T", "fields", "-E", "separator=/t", "-E", "occurrence=a", "-E", "aggregator=,"),
        *[arg for c in columns for arg in ("-e", c)],
    )
    for frame, (line, h) in enumerate(zip(out.splitlines(), headers, strict=True), start=1):
        got = rows[frame]
        assert got.pop("expert") == "" and got == _expected(h), f"frame {frame}"
        bits = protocol.LANE_BITS[h.flags & protocol.LANE_FLAGS]
        cells = dict(zip(columns, line.split("\t"), strict=True))
        want_scales, want_lanes = unpack_lanes(h.values, bits)
        assert [int(s) for s in cells["switchagg.scale"].split(",")] == want_scales
        assert [int(v) for v in cells[f"switchagg.lane{bits}"].split(",")] == want_lanes
        assert want_lanes[:4] == cases[bits] and len(want_lanes) == protocol.lanes_per_packet(64, bits)
    info = _tshark(tmp_path / "narrow.pcap")
    assert "[FLOAT,LANE16] lanes=16" in info and "[FLOAT,LANE8] lanes=8" in info


# --- a real capture -----------------------------------------------------------------------------

CAPTURE_REASON = (
    "the capture test needs tshark (apt install tshark)"
    if TSHARK is None
    else tools.missing_for(["ip"], "the capture test")
    or (None if shutil.which("tcpdump") else "the capture test needs tcpdump (apt install tcpdump)")
)
WORKERS, SIZE, K, SLOTS, ITERS = 2, 1000, 250, 2, 2  # 4 chunks on 2 slots: both shadow sets in use


def _capture_demo(pcap: Path) -> str:
    """Runs switchagg-demo in a fresh namespace on port 48879 while tcpdump captures its loopback."""
    ns = f"sa-ws-{os.getpid()}"
    netns.add_netns(ns)
    try:
        # --immediate-mode: each packet is written as it arrives, not when a ring block fills. Its
        # ring has one slot per snaplen: the default 256 KiB snaplen in the default 2 MiB buffer left
        # 8 slots, which overflowed while a busy machine did not schedule tcpdump (frames lost).
        # 9000 bytes hold any datagram of the demo; 32 MiB give thousands of slots.
        dump = subprocess.Popen(
            ["ip", "netns", "exec", ns, "tcpdump", "--immediate-mode", "-s", "9000", "-B", "32768"]
            + ["-i", "lo", "-U", "-w", str(pcap)]
            + ["udp", "port", str(protocol.UDP_PORT)],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert dump.stderr is not None
        started = dump.stderr.readline()  # "listening on lo ..." once it captures
        assert "listening on" in started, started + dump.stderr.read()
        run = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "switchagg.demo", "--workers", str(WORKERS)]
            + ["--size", str(SIZE), "--k", str(K), "--slots", str(SLOTS), "--iters", str(ITERS)]
            + ["--port", str(protocol.UDP_PORT)],
            capture_output=True,
            text=True,
            timeout=180,
            # One frame per datagram: a UDP GSO train crosses loopback as one super-frame, which
            # tcpdump captures whole (on a real link it leaves as one frame per datagram).
            env={**os.environ, "SWITCHAGG_GSO": "0"},
        )
        assert run.returncode == 0, run.stdout + run.stderr
        counted = re.search(r"aggregator: rx=(\d+) tx=(\d+)", run.stdout)
        assert counted is not None, run.stdout
        expected = int(counted[1]) + int(counted[2])
        # Stop once tcpdump has written as many packets as the aggregator counted (or after a
        # grace period, and the test's count check says what was missing).
        for _ in range(100):
            if _frames(pcap) >= expected:
                break
            time.sleep(0.1)
        dump.send_signal(signal.SIGINT)
        dump.wait(30)
        return run.stdout
    finally:
        netns.del_netns(ns)


def _frames(pcap: Path) -> int:
    try:
        return len(rdpcap(str(pcap)))
    except (OSError, EOFError):
        return 0


def _chunks(x: np.ndarray) -> np.ndarray:
    return np.pad(x, (0, -len(x) % K)).reshape(-1, K)


@pytest.mark.skipif(CAPTURE_REASON is not None, reason=CAPTURE_REASON or "")
def test_a_captured_demo_run_decodes_to_what_was_sent(tmp_path: Path) -> None:
    pcap = tmp_path / "demo.pcap"
    stdout = _capture_demo(pcap)
    counted = re.search(r"aggregator: rx=(\d+) tx=(\d+)", stdout)
    assert counted is not None, stdout

    rows = _decode(pcap)
    frames = rdpcap(str(pcap))
    # Every datagram the aggregator received or sent was captured once and decoded.
    assert len(frames) == len(rows) == int(counted[1]) + int(counted[2])
    sent: dict[tuple[int, int, int], list[protocol.Header]] = {}  # (type, rank, offset) -> headers
    for frame, pkt in enumerate(frames, start=1):
        assert pkt.haslayer(Agg), f"frame {frame} is not switchagg"
        h = pkt[Agg].to_header()
        got = rows[frame]
        assert got.pop("expert") == "", f"frame {frame}"
        assert got == _expected(h), f"frame {frame}: tshark and scapy disagree"
        assert (h.version, h.job, h.elems) == (protocol.VERSION, 1, K)
        sent.setdefault((h.type, h.rank, h.offset), []).append(h)

    # What the workers sent and got, from the demo's own inputs: each int32 chunk of each rank
    # went out as DATA and each rank got the exact int32 sum back as RESULT; each float32
    # allreduce opened every slot with a PRIME round carrying the rank's block exponent.
    ints = [_chunks(demo._inputs(r, SIZE)[0]) for r in range(WORKERS)]
    floats = [_chunks(demo._inputs(r, SIZE)[1]) for r in range(WORKERS)]
    total = _chunks(np.sum([demo._inputs(r, SIZE)[0].astype(np.int64) for r in range(WORKERS)], axis=0))
    for r in range(WORKERS):
        for c in range(len(ints[r])):
            data = sent[(protocol.MSG_DATA, r, c * K)]
            results = sent[(protocol.MSG_RESULT, r, c * K)]
            assert sum(h.values == ints[r][c].tolist() for h in data) >= ITERS, (r, c)
            assert sum(h.values == total[c].astype(np.int32).tolist() for h in results) >= ITERS, (r, c)
        for c in range(SLOTS):
            primes = [h for h in sent[(protocol.MSG_DATA, r, c * K)] if h.flags & protocol.FLAG_PRIME]
            exponent = int(np.frexp(np.max(np.abs(floats[r][c])))[1])
            assert len(primes) >= ITERS and {h.exp for h in primes} == {exponent}, (r, c)
            assert all(h.values == [0] * K and h.slot == c for h in primes)
    shadows = {(row["switchagg.pool.slot"], row["switchagg.pool.shadow"]) for row in rows.values()}
    assert shadows == {(s, b) for s in range(SLOTS) for b in (0, 1)}
