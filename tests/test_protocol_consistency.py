"""One source of truth: protocol.py; the C header, the P4 program and the scapy layer agree with it."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from switchagg import _core, protocol

ROOT = Path(__file__).resolve().parents[1]
# The P4 program: p4/switchagg.p4 composes the controls in p4/include/; the constants and the
# header types are each in one file there.
P4_CONSTANTS = ROOT / "p4/include/constants.p4"
P4_HEADERS = ROOT / "p4/include/headers.p4"


def _p4_sources() -> str:
    files = [ROOT / "p4/switchagg.p4", *sorted((ROOT / "p4/include").glob("*.p4"))]
    return "\n".join(f.read_text() for f in files)


def test_c_constants_match_protocol_py() -> None:
    c = _core.constants()
    for name in (
        "VERSION",
        "UDP_PORT",
        "MSG_DATA",
        "MSG_RESULT",
        "MSG_STATUS",
        "STATUS_LAG",
        "FLAG_PRIME",
        "FLAG_FLOAT",
        "FLAG_ABORT",
        "FLAG_MISMATCH",
        "EXP_TOP",
        "EXP_NONFINITE",
        "POOL_SET_BIT",
        "POOL_SLOT_MASK",
        "EXP_NONE",
        "HEADER_LEN",
        "MAX_WORKERS",
        "P4_K",
        "P4_NUM_SLOTS",
        "MAX_UDP_PAYLOAD",
        "MAX_K",
        "IPV4_UDP_HEADERS",
        "STEER_CLASSES",
        "FLAG_LANE16",
        "FLAG_LANE8",
        "SCALE_BLOCK",
        "SCALE_BIAS",
        "FLAG_HELLO",
        "IDENTITY_FLAGS",
        "HELLO_ROUNDS",
    ):
        assert c[name] == getattr(protocol, name), name
    assert c["DROP_NREASONS"] == len(protocol.DROP_REASONS)


def test_c_drop_enum_order_matches_protocol_py() -> None:
    text = (ROOT / "host/csrc/protocol.h").read_text()
    enum = re.search(r"enum sa_drop \{(.*?)\}", text, re.S)
    assert enum is not None
    names = [m.lower() for m in re.findall(r"SA_DROP_(\w+)", enum.group(1)) if m != "NREASONS"]
    assert tuple(names) == protocol.DROP_REASONS


def test_header_layout_is_28_bytes_big_endian() -> None:
    h = protocol.Header(
        job=0x0102, rank=3, slot=5, shadow=1, offset=0x0A0B0C0D, exp=-2, flags=1, values=[1, -1],
        call=0x11121314, total=0x21222324, key=0x31323334,
    )  # fmt: skip
    raw = h.pack()
    assert raw[:16] == bytes([2, 1, 1, 0xFE, 1, 2, 0, 3, 0x80, 5, 0, 2, 0x0A, 0x0B, 0x0C, 0x0D])
    assert raw[16:28] == bytes.fromhex("111213142122232431323334")
    assert raw[28:] == struct.pack("!ii", 1, -1)
    assert protocol.Header.unpack(raw) == h.__class__(**{**h.__dict__, "elems": 2})


def _p4_consts() -> dict[str, int]:
    text = P4_CONSTANTS.read_text()
    consts = {}
    for name, expr in re.findall(r"const bit<\d+>\s+(\w+)\s*=\s*([^;]+);", text):
        if re.fullmatch(r"[0-9A-Fa-fx+*\s()-]+", expr):  # plain arithmetic on literals only
            consts[name] = int(eval(expr))  # noqa: S307 - the pattern admits literals and + - * only
    return consts


def test_p4_constants_match_protocol_py() -> None:
    p4 = _p4_consts()
    for name in ("VERSION", "UDP_PORT", "MSG_DATA", "MSG_RESULT", "P4_K", "P4_NUM_SLOTS", "POOL_SLOT_MASK"):
        assert p4[name] == getattr(protocol, name), name
    assert p4["AGG_UDP_LEN"] == 8 + protocol.packet_len(protocol.P4_K)
    for name in (
        *("FLAG_PRIME", "FLAG_FLOAT", "FLAG_ABORT", "FLAG_MISMATCH", "FLAG_LANE16", "FLAG_LANE8"),
        *("FLAG_HELLO", "LANE_FLAGS", "IDENTITY_FLAGS", "POISON_FLAGS"),
    ):
        assert p4[name] == getattr(protocol, name), name
    for reason, index in protocol.DROP_INDEX.items():
        assert p4[f"DROP_{reason.upper()}"] == index, reason
    assert p4["NUM_DROP_REASONS"] == len(protocol.DROP_REASONS)


def test_p4_lane_arithmetic_matches_protocol_py() -> None:
    """aggregate.p4 fixes the narrow lanes' layout for P4_K: the unsigned byte max in word 0 for 16- and
    8-bit lanes and in word 1 too for 8-bit ones (scale_words), the lanes' sign bits H elsewhere."""
    assert protocol.scale_words(protocol.P4_K, 16) == 1 and protocol.scale_words(protocol.P4_K, 8) == 2
    text = (ROOT / "p4/include/aggregate.p4").read_text()
    assert "VALUE_UPDATE_INFO(0, info_rank, scale0)" in text and "bool scale0 = lanes != 0;" in text
    assert "VALUE_UPDATE_INFO(1, info_call, scale1)" in text and "bool scale1 = lanes == FLAG_LANE8;" in text
    assert "VALUE_UPDATE_INFO(2, info_total, false)" in text
    for bits, h in ((16, 0x80008000), (8, 0x80808080)):
        assert f"FLAG_LANE{bits} ? 32w{h:#010X}".replace("0X", "0x") in text, bits


def test_p4_job_counters_match_protocol_py() -> None:
    """One P4 counter array per protocol.JOB_COUNTERS and LEAF_COUNTERS name (a leaf's job counts
    both), each indexed by the job's counter index."""
    text = _p4_sources()
    arrays = set(re.findall(r"counter\(MAX_JOBS, CounterType\.packets_and_bytes\)\s+(\w+);", text))
    assert arrays == set(protocol.JOB_COUNTERS + protocol.LEAF_COUNTERS)


def test_p4_header_fields_match_protocol_layout() -> None:
    text = P4_HEADERS.read_text()
    m = re.search(r"header\s+agg_t\s*\{(.*?)\}", text, re.S)
    assert m is not None, f"{P4_HEADERS} has no agg_t header"
    widths = [int(w) for w in re.findall(r"bit<(\d+)>", m.group(1))]
    names = re.findall(r"bit<\d+>\s+(\w+);", m.group(1))
    assert names == list(protocol.HEADER_FIELDS)
    assert widths == [8 * struct.calcsize("!" + c) for c in protocol.HEADER_FORMAT.lstrip("!")]
    assert sum(widths) // 8 == protocol.HEADER_LEN


def test_p4_info_matches_protocol() -> None:
    p4info = ROOT / "p4/build/switchagg.p4info.txtpb"
    if not p4info.exists():
        pytest.skip("p4/build/switchagg.p4info.txtpb is not built yet")
    text = p4info.read_text()
    drops = re.search(r'name: "MyIngress\.drops".*?size: (\d+)', text, re.S)
    assert drops is not None and int(drops.group(1)) == len(protocol.DROP_REASONS)


def test_scapy_layer_matches_protocol_py() -> None:
    pytest.importorskip("scapy", reason="scapy is not installed")
    from switchagg.scapy_layer import Agg

    h = protocol.Header(
        job=7, rank=2, slot=9, shadow=1, offset=640, exp=5, values=list(range(protocol.P4_K)),
        call=9, total=77, key=0xFEEDBEEF, flags=protocol.FLAG_FLOAT | protocol.FLAG_MISMATCH,
    )  # fmt: skip
    assert bytes(Agg(h.pack())) == h.pack()
    assert len(bytes(Agg(elems=0))) == protocol.HEADER_LEN
