"""The controller's P4Runtime vocabulary on finsy: model entries as finsy entities, the idempotent
diff-based apply of a SwitchState, and counter reads.

finsy encodes and decodes every message with the P4Info schema (names and aliases, bit widths,
canonical bytestrings) and owns the P4Runtime protos (finsy.proto.p4r). What is left here is what
finsy does not do: ``apply`` reads back what the switch holds (table entries and multicast groups)
and writes only the difference, so applying the same SwitchState twice writes nothing the second
time. Read-back values are compared as integers, so a server answering with padded or canonical
bytestrings alike is handled. Registers are never read or written (bmv2's P4Runtime server lacks them).

Everything here takes a ``Target``: a connected finsy.Switch, or a ``Reader`` (reads only, no
stream and so no mastership: for tools that look at a switch a running controller owns).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import finsy as fy
from finsy.p4schema import P4Schema
from finsy.proto import p4r

from switchagg_controller.model import MatchValue, MulticastGroup, SwitchState, TableEntry

# Entries as compared: key (table id, ((field id, values...), ...), priority) and action
# (action id, ((param id, value), ...)).
_Key = tuple[int, tuple[tuple[int, ...], ...], int]
_Action = tuple[int, tuple[tuple[int, int], ...]]
Update = p4r.Update


class P4RuntimeError(Exception):
    """A P4Runtime call failed; the message carries the server's per-update errors."""


def election_id(pair: tuple[int, int]) -> int:
    """finsy's election id (one 128-bit integer) from the topology's (high, low)."""
    high, low = pair
    return (high << 64) | low


def pipeline_cookie(bmv2_json: bytes, p4info: bytes) -> int:
    """A 64-bit fingerprint of a pipeline (finsy stores its own cookie on the switch; this one
    names a pipeline in logs and tests)."""
    return int.from_bytes(hashlib.sha256(bmv2_json + b"\0" + p4info).digest()[:8], "big")


def load_schema(p4info: Path, bmv2_json: Path | None = None) -> P4Schema:
    return P4Schema(Path(p4info), Path(bmv2_json) if bmv2_json is not None else None)


# -- model -> finsy entities ------------------------------------------------------------------


def _value(v: int | bytes) -> int:
    return int.from_bytes(v, "big") if isinstance(v, bytes) else v


def _match_value(v: MatchValue) -> int | tuple[int, int]:
    return (_value(v[0]), v[1]) if isinstance(v, tuple) else _value(v)


def table_entry(entry: TableEntry) -> fy.P4TableEntry:
    """The finsy entity of a model entry; no match at all is the table's default entry."""
    action = fy.P4TableAction(entry.action, **{name: _value(v) for name, v in entry.params})
    if not entry.match:
        return fy.P4TableEntry(entry.table, action=action, is_default_action=True)
    match = fy.P4TableMatch({name: _match_value(v) for name, v in entry.match})
    return fy.P4TableEntry(entry.table, match=match, action=action, priority=entry.priority)


def build_entry(entry: TableEntry, schema: P4Schema) -> p4r.TableEntry:
    """The P4Runtime message of a model entry, or ValueError naming the entry and what is wrong."""
    try:
        return table_entry(entry).encode(schema).table_entry
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{entry.table} -> {entry.action}: {_reason(e)}") from None


def _reason(e: BaseException) -> str:
    while e.__cause__ is not None and str(e.__cause__) not in str(e):  # finsy chains the detail
        e = e.__cause__
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def group_entry(group: MulticastGroup) -> fy.P4MulticastGroupEntry:
    return fy.P4MulticastGroupEntry(group.group_id, replicas=[(port, i) for port, i in group.replicas])


# -- reading ---------------------------------------------------------------------------------


async def _read(target: Target, entities: Any, what: str) -> list[Any]:
    found: Any = target.read(entities)  # finsy's overloads of Switch.read type it as a coroutine
    try:
        return [e async for e in found]
    except fy.P4ClientError as e:
        raise P4RuntimeError(f"read {what}: {e}") from None


async def read_table_entries(target: Target) -> list[p4r.TableEntry]:
    """Every entry of every table (default entries included), as P4Runtime messages."""
    found = await _read(target, fy.P4TableEntry(), "table entries")
    return [e.encode(target.p4info).table_entry for e in found]


async def read_multicast_groups(target: Target) -> list[p4r.MulticastGroupEntry]:
    found = await _read(target, fy.P4MulticastGroupEntry(), "multicast groups")
    return [g.encode(target.p4info).packet_replication_engine_entry.multicast_group_entry for g in found]


async def read_counter(target: Target, name: str, index: int | None = None) -> dict[int, tuple[int, int]]:
    """index -> (bytes, packets) of a counter array (all indices when ``index`` is None)."""
    if target.p4info.counters.get(name) is None:
        known = ", ".join(sorted(c.name for c in target.p4info.counters)) or "none"
        raise KeyError(f"the P4Info has no counter {name!r} (it has: {known})")
    found = await _read(target, fy.P4CounterEntry(name, index=index), f"counter {name}")
    return {e.index: (e.byte_count, e.packet_count) for e in found if e.index is not None}


# -- comparing -------------------------------------------------------------------------------


def _key(e: p4r.TableEntry) -> _Key:
    fields: list[tuple[int, ...]] = []
    for m in e.match:
        kind = m.WhichOneof("field_match_type")
        if kind == "exact":
            fields.append((m.field_id, _value(m.exact.value)))
        elif kind == "ternary":
            fields.append((m.field_id, _value(m.ternary.value), _value(m.ternary.mask)))
        elif kind == "lpm":
            fields.append((m.field_id, _value(m.lpm.value), m.lpm.prefix_len))
        elif kind == "range":
            fields.append((m.field_id, _value(m.range.low), _value(m.range.high)))
        elif kind == "optional":
            fields.append((m.field_id, _value(m.optional.value)))
    return (e.table_id, tuple(sorted(fields)), e.priority)


def _action(e: p4r.TableEntry) -> _Action:
    a = e.action.action
    return (a.action_id, tuple(sorted((p.param_id, _value(p.value)) for p in a.params)))


def _replicas(g: p4r.MulticastGroupEntry) -> tuple[tuple[int, int], ...]:
    out = []
    for r in g.replicas:
        port = r.egress_port if r.WhichOneof("port_kind") == "egress_port" else _value(r.port)
        out.append((port, r.instance))
    return tuple(sorted(out))


def _table(e: p4r.TableEntry) -> p4r.Entity:
    return p4r.Entity(table_entry=e)


def _pre(g: p4r.MulticastGroupEntry) -> p4r.Entity:
    return p4r.Entity(
        packet_replication_engine_entry=p4r.PacketReplicationEngineEntry(multicast_group_entry=g)
    )


async def plan(target: Target, state: SwitchState, delete_others: bool = True) -> list[list[p4r.Update]]:
    """The writes that make the switch hold exactly ``state``, in the order they must go:
    groups first (entries name them), then entry deletes, modifies, inserts, and removed groups
    last (after the entries naming them). With ``delete_others=False`` nothing is deleted."""
    schema = target.p4info
    wanted: dict[_Key, p4r.TableEntry] = {}
    defaults: dict[int, p4r.TableEntry] = {}
    for entry in state.entries:
        built = build_entry(entry, schema)
        if built.is_default_action:
            defaults[built.table_id] = built
            continue
        key = _key(built)
        if key in wanted:
            raise ValueError(f"the state has two entries with the key of {entry}")
        wanted[key] = built
    have = {_key(e): e for e in await read_table_entries(target) if not e.is_default_action}
    deletes = [Update(type=Update.DELETE, entity=_table(e)) for k, e in have.items() if k not in wanted]
    modifies, inserts = [], []
    for key, e in wanted.items():
        if key not in have:
            inserts.append(Update(type=Update.INSERT, entity=_table(e)))
        elif _action(have[key]) != _action(e):
            modifies.append(Update(type=Update.MODIFY, entity=_table(e)))
    if defaults:
        asked = [fy.P4TableEntry(schema.tables[t].name, is_default_action=True) for t in sorted(defaults)]
        for found in await _read(target, asked, "default entries"):
            current = found.encode(schema).table_entry
            if _action(current) != _action(defaults[current.table_id]):
                modifies.append(Update(type=Update.MODIFY, entity=_table(defaults[current.table_id])))
    group_updates, group_deletes = await _group_plan(target, state.groups)
    if not delete_others:
        deletes, group_deletes = [], []
    return [u for u in (group_updates, deletes, modifies, inserts, group_deletes) if u]


async def _group_plan(
    target: Target, groups: Iterable[MulticastGroup]
) -> tuple[list[p4r.Update], list[p4r.Update]]:
    have = {g.multicast_group_id: g for g in await read_multicast_groups(target)}
    updates, wanted_ids = [], set()
    for g in groups:
        if g.group_id in wanted_ids:
            raise ValueError(f"multicast group {g.group_id} is in the state twice")
        wanted_ids.add(g.group_id)
        current = have.get(g.group_id)
        if current is not None and _replicas(current) == tuple(sorted(g.replicas)):
            continue
        entity = group_entry(g).encode(target.p4info)
        updates.append(Update(type=Update.INSERT if current is None else Update.MODIFY, entity=entity))
    deletes = [Update(type=Update.DELETE, entity=_pre(g)) for i, g in have.items() if i not in wanted_ids]
    return updates, deletes


async def apply(switch: fy.Switch, state: SwitchState, delete_others: bool = True) -> int:
    """Makes the switch hold exactly ``state`` (tables and multicast groups); returns the number of
    updates written. With ``delete_others=False`` entries and groups not in ``state`` are kept."""
    batches = await plan(switch, state, delete_others)
    for batch in batches:
        try:
            await switch.write(batch)
        except fy.P4ClientError as e:
            raise P4RuntimeError(f"write on {switch.name} ({switch.address}): {e}") from None
    return sum(len(b) for b in batches)


# -- reads without mastership ----------------------------------------------------------------


class Reader:
    """Reads a switch over a plain channel: no stream, so a running controller stays primary.

    ``async with Reader(address, device_id, p4info) as r: await read_counter(r, ...)``
    """

    def __init__(self, address: str, device_id: int, p4info: Path) -> None:
        self.address, self.device_id = address, device_id
        self._schema = load_schema(p4info)
        self._client = fy.P4Client(address, wait_for_ready=False)

    @property
    def p4info(self) -> P4Schema:
        return self._schema

    async def __aenter__(self) -> Reader:
        await self._client.open(schema=self._schema)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.close()

    async def read(self, entities: Any) -> AsyncIterator[Any]:
        from finsy import p4entity

        request = p4r.ReadRequest(
            device_id=self.device_id, entities=p4entity.encode_entities([entities], self._schema)
        )
        async for reply in self._client.request_iter(request):
            for ent in reply.entities:
                yield p4entity.decode_entity(ent, self._schema)


Target = fy.Switch | Reader  # what the read and apply functions take
