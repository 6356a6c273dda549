"""Model entries as P4Runtime messages through finsy's P4Info schema (no switch needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from finsy.p4schema import P4Schema

from switchagg_controller import p4_program, p4rt
from switchagg_controller.model import MulticastGroup, TableEntry

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
def schema(tmp_path: Path) -> P4Schema:
    path = tmp_path / "p4info.txtpb"
    path.write_text(P4INFO)
    return p4rt.load_schema(path)


def test_names_aliases_and_short_field_names(schema: P4Schema) -> None:
    assert schema.tables["MyIngress.t"].id == schema.tables["t"].id == 100
    assert schema.tables["t"].match_fields["dst_mac"].id == 1  # short for hdr.ethernet.dst_mac
    assert schema.counters["drops"].id == 300


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (TableEntry("nope", (("dst_mac", 1),), "fwd", (("port", 1),)), "no P4Table named 'nope'"),
        (TableEntry("t", (("src", 1),), "fwd", (("port", 1),)), "no match field named 'src'"),
        (TableEntry("t", (("dst_mac", 1),), "fwd", (("mac", 1),)), "no action parameter named 'mac'"),
        (TableEntry("t", (("dst_mac", 1),), "fwd", (("port", 999),)), "invalid value for bitwidth 9: 999"),
        (TableEntry("t", (("dst_mac", (1, 2)),), "fwd", (("port", 1),)), "'dst_mac': invalid value"),
    ],
)
def test_bad_entries_say_what_is_wrong(schema: P4Schema, entry: TableEntry, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        p4rt.build_entry(entry, schema)
    assert str(e.value).startswith(f"{entry.table} -> {entry.action}: ")


def test_build_entry(schema: P4Schema) -> None:
    e = p4rt.build_entry(
        TableEntry("t", (("dst_mac", 0x020000000001), ("hdr.ipv4.dst", (0x0A000000, 0xFF000000)),
                         ("meta.prefix", (0x0A000000, 8))), "fwd", (("port", 3),), priority=10),
        schema,
    )  # fmt: skip
    assert e.table_id == 100 and e.priority == 10 and not e.is_default_action
    exact, ternary, lpm = e.match
    assert exact.exact.value == bytes.fromhex("020000000001")
    assert (ternary.ternary.value, ternary.ternary.mask) == (b"\x0a\x00\x00\x00", b"\xff\x00\x00\x00")
    assert (lpm.lpm.value, lpm.lpm.prefix_len) == (b"\x0a\x00\x00\x00", 8)
    assert e.action.action.action_id == 200 and e.action.action.params[0].value == b"\x03"
    # Bytes values are taken as big-endian numbers and written canonically (shortest form).
    e = p4rt.build_entry(TableEntry("t", (("dst_mac", b"\x00\x00\x05"),), "fwd", (("port", 1),)), schema)
    assert e.match[0].exact.value == b"\x05"
    # Don't-care ternary and /0 LPM fields are left out, as P4Runtime requires.
    e = p4rt.build_entry(
        TableEntry(
            "t", (("dst_mac", 1), ("hdr.ipv4.dst", (0, 0)), ("meta.prefix", (0, 0))), "fwd", (("port", 1),)
        ),
        schema,
    )
    assert [m.field_id for m in e.match] == [1]
    # No match at all is the table's default entry.
    assert p4rt.build_entry(TableEntry("t", (), "fwd", (("port", 2),)), schema).is_default_action


def test_padded_and_canonical_values_compare_equal(schema: P4Schema) -> None:
    """What a switch answers may be padded; the diff compares numbers, not bytestrings."""
    built = p4rt.build_entry(TableEntry("t", (("dst_mac", 5),), "fwd", (("port", 3),)), schema)
    padded = type(built)()
    padded.CopyFrom(built)
    padded.match[0].exact.value = b"\x00\x00\x00\x00\x00\x05"
    padded.action.action.params[0].value = b"\x00\x03"
    assert p4rt._key(padded) == p4rt._key(built) and p4rt._action(padded) == p4rt._action(built)


def test_multicast_group_and_the_real_program(schema: P4Schema) -> None:
    g = p4rt.group_entry(MulticastGroup(0x101, ((2, 1), (1, 0)))).encode(schema)
    entry = g.packet_replication_engine_entry.multicast_group_entry
    assert entry.multicast_group_id == 0x101 and p4rt._replicas(entry) == ((1, 0), (2, 1))
    if not p4_program.P4INFO.is_file():
        pytest.skip("p4/build/switchagg.p4info.txtpb is not built")
    real = p4rt.load_schema(p4_program.P4INFO)
    for name in (p4_program.DROP_COUNTER, *p4_program.JOB_COUNTER_NAMES.values()):
        assert real.counters[name].id
    for table in (
        p4_program.L2_TABLE,
        p4_program.JOB_TABLE,
        p4_program.WORKER_TABLE,
        p4_program.RESULT_TABLE,
    ):
        assert real.tables[table].id


def test_election_ids() -> None:
    assert p4rt.election_id((0, 1)) == 1 and p4rt.election_id((1, 7)) == (1 << 64) + 7
