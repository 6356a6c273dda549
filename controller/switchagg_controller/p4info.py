"""Names -> ids and bit widths through a P4Info, and the P4Runtime bytestring encoding."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format

from switchagg_controller._p4rt.p4.config.v1 import p4info_pb2


class P4InfoError(KeyError):
    """A name that the P4Info does not have; str() lists what it does have."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Field:
    id: int
    name: str
    bitwidth: int
    match_type: int = 0  # p4info_pb2.MatchField.MatchType for match fields


def load(path: str | Path) -> p4info_pb2.P4Info:
    """A P4Info from a text (.txt, .txtpb, .pb.txt) or binary file."""
    data = Path(path).read_bytes()
    info = p4info_pb2.P4Info()
    try:
        text_format.Merge(data.decode(), info)
    except (UnicodeDecodeError, text_format.ParseError):
        info = p4info_pb2.P4Info.FromString(data)
    return info


def encode(value: int | bytes, bitwidth: int, what: str) -> bytes:
    """The canonical P4Runtime bytestring (shortest, at least one byte) of a value of ``bitwidth``."""
    v = int.from_bytes(value, "big") if isinstance(value, bytes) else value
    if v < 0 or v.bit_length() > bitwidth:
        raise ValueError(f"{what}: {value!r} does not fit in {bitwidth} bits")
    return v.to_bytes(max(1, (v.bit_length() + 7) // 8), "big")


def decode(data: bytes) -> int:
    return int.from_bytes(data, "big")


def _lookup(kind: str, by_name: dict[str, int], name: str) -> int:
    if name in by_name:
        return by_name[name]
    known = ", ".join(sorted(by_name)) or "none"
    raise P4InfoError(f"the P4Info has no {kind} {name!r} (it has: {known})")


class P4InfoHelper:
    def __init__(self, info: p4info_pb2.P4Info) -> None:
        self.info = info
        self.tables: dict[str, int] = {}
        self.actions: dict[str, int] = {}
        self.counters: dict[str, int] = {}
        self.match: dict[int, dict[str, Field]] = {}
        self.params: dict[int, dict[str, Field]] = {}
        self.names: dict[int, str] = {}
        for t in info.tables:
            self._name(self.tables, t.preamble)
            fields = {m.name: Field(m.id, m.name, m.bitwidth, m.match_type) for m in t.match_fields}
            # Short names too ("dst_mac" for "hdr.ethernet.dst_mac"), where they are unambiguous.
            short: dict[str, list[Field]] = {}
            for f in list(fields.values()):
                short.setdefault(f.name.rsplit(".", 1)[-1], []).append(f)
            for s, fs in short.items():
                if len(fs) == 1 and s not in fields:
                    fields[s] = fs[0]
            self.match[t.preamble.id] = fields
        for a in info.actions:
            self._name(self.actions, a.preamble)
            self.params[a.preamble.id] = {p.name: Field(p.id, p.name, p.bitwidth) for p in a.params}
        for c in info.counters:
            self._name(self.counters, c.preamble)

    def _name(self, table: dict[str, int], preamble: p4info_pb2.Preamble) -> None:
        table[preamble.name] = preamble.id
        if preamble.alias and preamble.alias not in table:
            table[preamble.alias] = preamble.id
        self.names[preamble.id] = preamble.name

    def table_id(self, name: str) -> int:
        return _lookup("table", self.tables, name)

    def action_id(self, name: str) -> int:
        return _lookup("action", self.actions, name)

    def counter_id(self, name: str) -> int:
        return _lookup("counter", self.counters, name)

    def match_field(self, table_id: int, name: str) -> Field:
        fields = self.match[table_id]
        if name not in fields:
            known = ", ".join(sorted(fields))
            raise P4InfoError(f"table {self.names[table_id]!r} has no match field {name!r} (it has: {known})")
        return fields[name]

    def param(self, action_id: int, name: str) -> Field:
        params = self.params[action_id]
        if name not in params:
            known = ", ".join(sorted(params)) or "none"
            raise P4InfoError(f"action {self.names[action_id]!r} has no parameter {name!r} (it has: {known})")
        return params[name]
