"""A P4Runtime client for one switch: mastership, pipeline, idempotent state, counters.

``apply`` reads back what the switch has (table entries and multicast groups) and writes only
the difference, so applying the same SwitchState twice writes nothing the second time. Values
are compared as integers, so a server that answers with padded or canonical bytestrings alike
is handled. Registers are never read or written (bmv2's P4Runtime server lacks them).
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import grpc
from google.rpc import status_pb2

from switchagg_controller import p4info as p4i
from switchagg_controller._p4rt.p4.config.v1 import p4info_pb2
from switchagg_controller._p4rt.p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc
from switchagg_controller.model import MatchValue, MulticastGroup, SwitchState, TableEntry

Update = p4runtime_pb2.Update
MatchType = p4info_pb2.MatchField

# Entries as compared: key (table id, ((field id, values...), ...), priority) and action
# (action id, ((param id, value), ...)).
_Key = tuple[int, tuple[tuple[int, ...], ...], int]
_Action = tuple[int, tuple[tuple[int, int], ...]]


class P4RuntimeError(Exception):
    """A P4Runtime call failed; the message carries the server's per-update errors."""


def _describe(e: grpc.RpcError, what: str) -> P4RuntimeError:
    if not isinstance(e, grpc.Call):
        return P4RuntimeError(f"{what}: {e}")
    details = [f"{e.code().name}: {e.details()}"]
    for key, value in e.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for i, any_ in enumerate(status.details):
                err = p4runtime_pb2.Error()
                if any_.Unpack(err) and err.canonical_code != 0:
                    details.append(
                        f"update {i}: {grpc.StatusCode(_code(err.canonical_code)).name} {err.message}"
                    )
    return P4RuntimeError(f"{what}: " + "; ".join(details))


def _code(value: int) -> tuple[int, str]:
    return next(c.value for c in grpc.StatusCode if c.value[0] == value)


def pipeline_cookie(bmv2_json: bytes, p4info: bytes) -> int:
    """A 64-bit fingerprint of a pipeline, stored on the switch to recognise it later."""
    return int.from_bytes(hashlib.sha256(bmv2_json + b"\0" + p4info).digest()[:8], "big")


class SwitchConnection:
    def __init__(
        self, address: str, device_id: int, election_id: tuple[int, int] = (0, 1), timeout: float = 10.0
    ) -> None:
        if election_id == (0, 0):
            raise ValueError("the election id must be non-zero (P4Runtime reserves 0)")
        self.address, self.device_id, self.timeout = address, device_id, timeout
        self.election_id = p4runtime_pb2.Uint128(high=election_id[0], low=election_id[1])
        self.helper: p4i.P4InfoHelper | None = None
        self._channel: grpc.Channel | None = None
        self._stub: p4runtime_pb2_grpc.P4RuntimeStub | None = None
        self._requests: queue.Queue[p4runtime_pb2.StreamMessageRequest | None] = queue.Queue()
        self._arbitration: queue.Queue[p4runtime_pb2.StreamMessageResponse] = queue.Queue()
        self._reader: threading.Thread | None = None
        self._stream: grpc.Future | None = None
        self.stream_error: BaseException | None = None

    # -- connection ---------------------------------------------------------------------------

    def connect(self, primary: bool = True) -> SwitchConnection:
        """Opens the stream and becomes primary controller, or fails saying why.

        ``primary=False`` only opens the channel: enough for reads (counters, entries), and it
        leaves the running controller's mastership alone.
        """
        self._channel = grpc.insecure_channel(self.address)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.timeout)
        except grpc.FutureTimeoutError:
            self.close()
            raise P4RuntimeError(f"no P4Runtime server answers at {self.address}") from None
        self._stub = p4runtime_pb2_grpc.P4RuntimeStub(self._channel)
        if not primary:
            return self
        self._stream = self._stub.StreamChannel(self._request_iter())
        self._reader = threading.Thread(target=self._read_stream, name="p4rt-stream", daemon=True)
        self._reader.start()
        self._requests.put(
            p4runtime_pb2.StreamMessageRequest(
                arbitration=p4runtime_pb2.MasterArbitrationUpdate(
                    device_id=self.device_id, election_id=self.election_id
                )
            )
        )
        reply = self._await_arbitration()
        code = reply.arbitration.status.code
        if code != 0:
            self.close()
            raise P4RuntimeError(
                f"{self.address} device {self.device_id}: not primary with election id "
                f"({self.election_id.high}, {self.election_id.low}): {reply.arbitration.status.message} "
                "(another controller holds a higher election id)"
            )
        return self

    def _await_arbitration(self) -> p4runtime_pb2.StreamMessageResponse:
        """The switch's answer to our arbitration update; a refusal ends the stream instead."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                return self._arbitration.get(timeout=0.05)
            except queue.Empty:
                if self._reader is not None and not self._reader.is_alive():
                    break  # the stream ended: the switch refused us (or went away)
        error = self.stream_error
        self.close()
        if isinstance(error, grpc.Call):
            raise P4RuntimeError(
                f"{self.address} device {self.device_id}: arbitration with election id "
                f"({self.election_id.high}, {self.election_id.low}) refused: "
                f"{error.code().name}: {error.details()}"
            )
        raise P4RuntimeError(f"{self.address}: no arbitration answer within {self.timeout:g} s ({error})")

    def _request_iter(self) -> Iterator[p4runtime_pb2.StreamMessageRequest]:
        while True:
            item = self._requests.get()
            if item is None:
                return
            yield item

    def _read_stream(self) -> None:
        try:
            assert self._stream is not None
            for msg in self._stream:
                if msg.HasField("arbitration"):
                    self._arbitration.put(msg)
        except BaseException as e:  # the stream broke: the switch went away or closed it
            self.stream_error = e
        else:
            self.stream_error = P4RuntimeError("the switch closed the stream")

    def is_alive(self) -> bool:
        """The stream is up and the switch answers."""
        if self._stub is None or self._reader is None or not self._reader.is_alive():
            return False
        try:
            self._stub.Capabilities(p4runtime_pb2.CapabilitiesRequest(), timeout=self.timeout)
        except grpc.RpcError:
            return False
        return True

    def close(self) -> None:
        self._requests.put(None)
        if self._stream is not None:
            self._stream.cancel()
        if self._channel is not None:
            self._channel.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(self.timeout)
        self._channel = self._stub = self._stream = self._reader = None

    def __enter__(self) -> SwitchConnection:
        return self.connect()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def stub(self) -> p4runtime_pb2_grpc.P4RuntimeStub:
        if self._stub is None:
            raise P4RuntimeError(f"not connected to {self.address}")
        return self._stub

    @property
    def p4(self) -> p4i.P4InfoHelper:
        if self.helper is None:
            raise P4RuntimeError("no P4Info: call set_pipeline() or load_p4info() first")
        return self.helper

    # -- pipeline -----------------------------------------------------------------------------

    def set_pipeline(self, bmv2_json: Path, p4info: Path) -> None:
        json_bytes, info_bytes = Path(bmv2_json).read_bytes(), Path(p4info).read_bytes()
        info = p4i.load(p4info)
        config = p4runtime_pb2.ForwardingPipelineConfig(
            p4info=info,
            p4_device_config=json_bytes,
            cookie=p4runtime_pb2.ForwardingPipelineConfig.Cookie(
                cookie=pipeline_cookie(json_bytes, info_bytes)
            ),
        )
        request = p4runtime_pb2.SetForwardingPipelineConfigRequest(
            device_id=self.device_id,
            election_id=self.election_id,
            action=p4runtime_pb2.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT,
            config=config,
        )
        try:
            self.stub.SetForwardingPipelineConfig(request, timeout=max(self.timeout, 60.0))
        except grpc.RpcError as e:
            raise _describe(e, f"set pipeline {Path(bmv2_json).name} on {self.address}") from None
        self.helper = p4i.P4InfoHelper(info)

    def ensure_pipeline(self, bmv2_json: Path, p4info: Path) -> bool:
        """Pushes the pipeline unless the switch already runs it (same cookie); True if pushed.

        Pushing replaces the pipeline and so wipes every entry: skipping it keeps a second push idempotent.
        """
        cookie = pipeline_cookie(Path(bmv2_json).read_bytes(), Path(p4info).read_bytes())
        if self.get_pipeline_cookie() == cookie:
            self.load_p4info(p4info)
            return False
        self.set_pipeline(bmv2_json, p4info)
        return True

    def get_pipeline_cookie(self) -> int | None:
        """The cookie of the switch's pipeline; None when it has none (e.g. it just restarted)."""
        request = p4runtime_pb2.GetForwardingPipelineConfigRequest(
            device_id=self.device_id,
            response_type=p4runtime_pb2.GetForwardingPipelineConfigRequest.COOKIE_ONLY,
        )
        try:
            reply = self.stub.GetForwardingPipelineConfig(request, timeout=self.timeout)
        except grpc.RpcError as e:
            if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return None  # "no forwarding pipeline config set"
            raise _describe(e, f"get pipeline of {self.address}") from None
        return reply.config.cookie.cookie if reply.config.HasField("cookie") else None

    def load_p4info(self, path: Path | None = None) -> None:
        """Uses a P4Info file, or (None) the switch's own, without pushing a pipeline."""
        if path is not None:
            self.helper = p4i.P4InfoHelper(p4i.load(path))
            return
        request = p4runtime_pb2.GetForwardingPipelineConfigRequest(
            device_id=self.device_id,
            response_type=p4runtime_pb2.GetForwardingPipelineConfigRequest.P4INFO_AND_COOKIE,
        )
        try:
            reply = self.stub.GetForwardingPipelineConfig(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _describe(e, f"get P4Info of {self.address}") from None
        self.helper = p4i.P4InfoHelper(reply.config.p4info)

    # -- reads and writes ---------------------------------------------------------------------

    def _read(self, entities: list[p4runtime_pb2.Entity], what: str) -> list[p4runtime_pb2.Entity]:
        request = p4runtime_pb2.ReadRequest(device_id=self.device_id, entities=entities)
        try:
            return [e for reply in self.stub.Read(request, timeout=self.timeout) for e in reply.entities]
        except grpc.RpcError as e:
            raise _describe(e, f"read {what} from {self.address}") from None

    def write(self, updates: list[p4runtime_pb2.Update], what: str = "write") -> None:
        if not updates:
            return
        request = p4runtime_pb2.WriteRequest(
            device_id=self.device_id, election_id=self.election_id, updates=updates
        )
        try:
            self.stub.Write(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _describe(e, f"{what} on {self.address}") from None

    def read_table_entries(self) -> list[p4runtime_pb2.TableEntry]:
        entity = p4runtime_pb2.Entity(table_entry=p4runtime_pb2.TableEntry())  # table_id 0: all tables
        return [e.table_entry for e in self._read([entity], "table entries")]

    def read_multicast_groups(self) -> list[p4runtime_pb2.MulticastGroupEntry]:
        entity = p4runtime_pb2.Entity(
            packet_replication_engine_entry=p4runtime_pb2.PacketReplicationEngineEntry(
                multicast_group_entry=p4runtime_pb2.MulticastGroupEntry()  # id 0: all groups
            )
        )
        return [
            e.packet_replication_engine_entry.multicast_group_entry
            for e in self._read([entity], "multicast groups")
        ]

    def read_counter(self, name: str, index: int | None = None) -> dict[int, tuple[int, int]]:
        """index -> (bytes, packets) of a counter array (all indices when ``index`` is None)."""
        entry = p4runtime_pb2.CounterEntry(counter_id=self.p4.counter_id(name))
        if index is not None:
            entry.index.index = index
        entities = self._read([p4runtime_pb2.Entity(counter_entry=entry)], f"counter {name}")
        return {
            e.counter_entry.index.index: (e.counter_entry.data.byte_count, e.counter_entry.data.packet_count)
            for e in entities
        }

    # -- desired state ------------------------------------------------------------------------

    def build_entry(self, entry: TableEntry) -> p4runtime_pb2.TableEntry:
        p4 = self.p4
        table_id = p4.table_id(entry.table)
        out = p4runtime_pb2.TableEntry(table_id=table_id, priority=entry.priority)
        for name, value in entry.match:
            f = p4.match_field(table_id, name)
            self._set_match(out, f, value, f"{entry.table} {name}")
        action_id = p4.action_id(entry.action)
        out.action.action.action_id = action_id
        for name, value in entry.params:
            p = p4.param(action_id, name)
            out.action.action.params.add(
                param_id=p.id, value=p4i.encode(value, p.bitwidth, f"{entry.action} {name}")
            )
        if not entry.match:
            out.is_default_action = True
        return out

    @staticmethod
    def _set_match(out: p4runtime_pb2.TableEntry, f: p4i.Field, value: MatchValue, what: str) -> None:
        if f.match_type == MatchType.EXACT:
            if isinstance(value, tuple):
                raise ValueError(f"{what}: an exact match takes a single value, not {value!r}")
            out.match.add(field_id=f.id).exact.value = p4i.encode(value, f.bitwidth, what)
            return
        v: int | bytes
        if isinstance(value, tuple):
            v, extra = value
        else:  # a bare value: all bits matter
            v, extra = value, ((1 << f.bitwidth) - 1 if f.match_type == MatchType.TERNARY else f.bitwidth)
        if f.match_type == MatchType.TERNARY:
            if extra == 0:
                return  # a zero mask is "don't care": P4Runtime wants the field left out
            m = out.match.add(field_id=f.id)
            m.ternary.value = p4i.encode(v, f.bitwidth, what)
            m.ternary.mask = p4i.encode(extra, f.bitwidth, what)
        elif f.match_type == MatchType.LPM:
            if extra == 0:
                return
            m = out.match.add(field_id=f.id)
            m.lpm.value = p4i.encode(v, f.bitwidth, what)
            m.lpm.prefix_len = extra
        elif f.match_type == MatchType.RANGE:
            m = out.match.add(field_id=f.id)
            m.range.low = p4i.encode(v, f.bitwidth, what)
            m.range.high = p4i.encode(extra, f.bitwidth, what)
        elif f.match_type == MatchType.OPTIONAL:
            out.match.add(field_id=f.id).optional.value = p4i.encode(v, f.bitwidth, what)
        else:
            raise ValueError(f"{what}: match type {f.match_type} is not supported")

    @staticmethod
    def _key(e: p4runtime_pb2.TableEntry) -> _Key:
        fields: list[tuple[int, ...]] = []
        for m in e.match:
            kind = m.WhichOneof("field_match_type")
            if kind == "exact":
                fields.append((m.field_id, p4i.decode(m.exact.value)))
            elif kind == "ternary":
                fields.append((m.field_id, p4i.decode(m.ternary.value), p4i.decode(m.ternary.mask)))
            elif kind == "lpm":
                fields.append((m.field_id, p4i.decode(m.lpm.value), m.lpm.prefix_len))
            elif kind == "range":
                fields.append((m.field_id, p4i.decode(m.range.low), p4i.decode(m.range.high)))
            elif kind == "optional":
                fields.append((m.field_id, p4i.decode(m.optional.value)))
        return (e.table_id, tuple(sorted(fields)), e.priority)

    @staticmethod
    def _action(e: p4runtime_pb2.TableEntry) -> _Action:
        a = e.action.action
        return (a.action_id, tuple(sorted((p.param_id, p4i.decode(p.value)) for p in a.params)))

    @staticmethod
    def _replicas(g: p4runtime_pb2.MulticastGroupEntry) -> tuple[tuple[int, int], ...]:
        out = []
        for r in g.replicas:
            port = r.egress_port if r.WhichOneof("port_kind") == "egress_port" else p4i.decode(r.port)
            out.append((port, r.instance))
        return tuple(sorted(out))

    def _default_entries(self, table_ids: set[int]) -> dict[int, p4runtime_pb2.TableEntry]:
        entities = [
            p4runtime_pb2.Entity(table_entry=p4runtime_pb2.TableEntry(table_id=t, is_default_action=True))
            for t in sorted(table_ids)
        ]
        return (
            {e.table_entry.table_id: e.table_entry for e in self._read(entities, "default entries")}
            if entities
            else {}
        )

    def apply(self, state: SwitchState, delete_others: bool = True) -> int:
        """Makes the switch hold exactly ``state`` (tables and multicast groups); returns the number of
        updates written. With ``delete_others=False`` entries and groups not in ``state`` are kept."""
        wanted: dict[_Key, p4runtime_pb2.TableEntry] = {}
        defaults: dict[int, p4runtime_pb2.TableEntry] = {}
        for entry in state.entries:
            built = self.build_entry(entry)
            if built.is_default_action:
                defaults[built.table_id] = built
                continue
            key = self._key(built)
            if key in wanted:
                raise ValueError(f"the state has two entries with the key of {entry}")
            wanted[key] = built
        have = {self._key(e): e for e in self.read_table_entries() if not e.is_default_action}
        deletes, modifies, inserts = [], [], []
        for key, e in have.items():
            if key not in wanted and delete_others:
                deletes.append(Update(type=Update.DELETE, entity=p4runtime_pb2.Entity(table_entry=e)))
        for key, e in wanted.items():
            if key not in have:
                inserts.append(Update(type=Update.INSERT, entity=p4runtime_pb2.Entity(table_entry=e)))
            elif self._action(have[key]) != self._action(e):
                modifies.append(Update(type=Update.MODIFY, entity=p4runtime_pb2.Entity(table_entry=e)))
        for table_id, e in self._default_entries(set(defaults)).items():
            if self._action(e) != self._action(defaults[table_id]):
                modifies.append(
                    Update(type=Update.MODIFY, entity=p4runtime_pb2.Entity(table_entry=defaults[table_id]))
                )

        group_updates, group_deletes = self._group_updates(state.groups, delete_others)
        # Groups first (entries name them), removed groups last (after the entries naming them).
        self.write(group_updates, "write multicast groups")
        self.write(deletes, "delete table entries")
        self.write(modifies, "modify table entries")
        self.write(inserts, "insert table entries")
        self.write(group_deletes, "delete multicast groups")
        return len(group_updates) + len(deletes) + len(modifies) + len(inserts) + len(group_deletes)

    def _group_updates(
        self, groups: list[MulticastGroup], delete_others: bool
    ) -> tuple[list[p4runtime_pb2.Update], list[p4runtime_pb2.Update]]:
        have = {g.multicast_group_id: g for g in self.read_multicast_groups()}
        updates, deletes = [], []
        wanted_ids = set()
        for g in groups:
            if g.group_id in wanted_ids:
                raise ValueError(f"multicast group {g.group_id} is in the state twice")
            wanted_ids.add(g.group_id)
            entry = p4runtime_pb2.MulticastGroupEntry(multicast_group_id=g.group_id)
            for port, instance in g.replicas:
                entry.replicas.add(egress_port=port, instance=instance)
            current = have.get(g.group_id)
            if current is not None and self._replicas(current) == tuple(sorted(g.replicas)):
                continue
            kind = Update.INSERT if current is None else Update.MODIFY
            updates.append(Update(type=kind, entity=_pre(entry)))
        if delete_others:
            for group_id, current in have.items():
                if group_id not in wanted_ids:
                    deletes.append(Update(type=Update.DELETE, entity=_pre(current)))
        return updates, deletes


def _pre(entry: p4runtime_pb2.MulticastGroupEntry) -> p4runtime_pb2.Entity:
    return p4runtime_pb2.Entity(
        packet_replication_engine_entry=p4runtime_pb2.PacketReplicationEngineEntry(
            multicast_group_entry=entry
        )
    )
