"""P4Info lookups and the P4Runtime encoding of entries (no switch needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from switchagg_controller import p4info as p4i
from switchagg_controller._p4rt.p4.config.v1 import p4info_pb2
from switchagg_controller.model import TableEntry
from switchagg_controller.p4runtime_client import SwitchConnection

P4INFO = """
tables {
  preamble { id: 100 name: "MyIngress.t" alias: "t" }
  match_fields { id: 1 name: "hdr.ethernet.dst_mac" bitwidth: 48 match_type: EXACT }
  match_fields { id: 2 name: "hdr.ipv4.dst" bitwidth: 32 match_type: TERNARY }
  match_fields { id: 3 name: "meta.prefix" bitwidth: 32 match_type: LPM }
  action_refs { id: 200 }
}
actions {
  preamble { id: 200 name: "MyIngress.fwd" alias: "fwd" }
  params { id: 1 name: "port" bitwidth: 9 }
}
counters { preamble { id: 300 name: "MyIngress.drops" alias: "drops" } spec { unit: BOTH } size: 7 }
"""


@pytest.fixture
def conn(tmp_path: Path) -> SwitchConnection:
    path = tmp_path / "p4info.txtpb"
    path.write_text(P4INFO)
    c = SwitchConnection("127.0.0.1:1", 0)  # never connected: building entries needs only the P4Info
    c.load_p4info(path)
    return c


def test_canonical_encoding() -> None:
    assert p4i.encode(0, 9, "x") == b"\x00"
    assert p4i.encode(511, 9, "x") == b"\x01\xff"
    assert p4i.encode(b"\x00\x00\x05", 16, "x") == b"\x05"
    with pytest.raises(ValueError, match="port: 512 does not fit in 9 bits"):
        p4i.encode(512, 9, "port")
    with pytest.raises(ValueError, match="does not fit"):
        p4i.encode(-1, 9, "port")


def test_binary_and_text_p4info_load_alike(tmp_path: Path) -> None:
    info = text_format.Parse(P4INFO, p4info_pb2.P4Info())
    (tmp_path / "a.txt").write_text(P4INFO)
    (tmp_path / "b.bin").write_bytes(info.SerializeToString())
    assert p4i.load(tmp_path / "a.txt") == p4i.load(tmp_path / "b.bin") == info


def test_names_aliases_and_clear_errors(conn: SwitchConnection) -> None:
    p4 = conn.p4
    assert p4.table_id("MyIngress.t") == p4.table_id("t") == 100
    assert p4.match_field(100, "dst_mac").id == 1 and p4.match_field(100, "hdr.ipv4.dst").id == 2
    assert p4.counter_id("drops") == 300
    with pytest.raises(KeyError, match="no table 'MyIngress.nope' \\(it has: MyIngress.t, t\\)"):
        p4.table_id("MyIngress.nope")
    with pytest.raises(KeyError, match="has no match field 'src'"):
        p4.match_field(100, "src")
    with pytest.raises(KeyError, match="action 'MyIngress.fwd' has no parameter 'mac' \\(it has: port\\)"):
        p4.param(200, "mac")


def test_build_entry(conn: SwitchConnection) -> None:
    e = conn.build_entry(
        TableEntry("t", (("dst_mac", 0x020000000001), ("hdr.ipv4.dst", (0x0A000000, 0xFF000000)),
                         ("meta.prefix", (0x0A000000, 8))), "fwd", (("port", 3),), priority=10)
    )  # fmt: skip
    assert e.table_id == 100 and e.priority == 10 and not e.is_default_action
    exact, ternary, lpm = e.match
    assert exact.exact.value == bytes.fromhex("020000000001")
    assert (ternary.ternary.value, ternary.ternary.mask) == (b"\x0a\x00\x00\x00", b"\xff\x00\x00\x00")
    assert (lpm.lpm.value, lpm.lpm.prefix_len) == (b"\x0a\x00\x00\x00", 8)
    assert e.action.action.action_id == 200 and e.action.action.params[0].value == b"\x03"
    # Don't-care ternary and /0 LPM fields are left out, as P4Runtime requires.
    e = conn.build_entry(
        TableEntry(
            "t", (("dst_mac", 1), ("hdr.ipv4.dst", (0, 0)), ("meta.prefix", (0, 0))), "fwd", (("port", 1),)
        )
    )
    assert [m.field_id for m in e.match] == [1]
    # No match at all is the table's default entry.
    assert conn.build_entry(TableEntry("t", (), "fwd", (("port", 2),))).is_default_action
    with pytest.raises(ValueError, match="exact match takes a single value"):
        conn.build_entry(TableEntry("t", (("dst_mac", (1, 2)),), "fwd", (("port", 1),)))
    with pytest.raises(ValueError, match="fwd port: 999 does not fit in 9 bits"):
        conn.build_entry(TableEntry("t", (("dst_mac", 1),), "fwd", (("port", 999),)))
