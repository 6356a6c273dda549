"""A scapy layer for the aggregation header and its int32 payload (docs/PROTOCOL.md).

``Ether()/IP()/UDP(dport=48879)/Agg(job=1, rank=0, values=[...])`` builds a DATA packet; UDP
traffic from or to port 48879 dissects as ``Agg``. The number of values is not a header field
the layer trusts: ``values`` takes whatever whole int32s follow (the header's ``elems`` is only
filled from it when left unset), so truncated and padded packets can be built and inspected.

Narrow lanes (docs/PROTOCOL.md, Narrow lanes): ``flags`` shows LANE16/LANE8, the summary the width,
and ``narrow()`` reads the words as scale bytes and lanes (``conformance.pack_lanes`` builds them).
"""

from __future__ import annotations

from typing import Any

from scapy.fields import (
    BitField,
    ByteEnumField,
    ByteField,
    FieldListField,
    FlagsField,
    IntField,
    ShortField,
    SignedByteField,
    SignedIntField,
    XIntField,
)
from scapy.layers.inet import UDP
from scapy.layers.vxlan import VXLAN
from scapy.packet import Packet, bind_layers, split_layers

from . import protocol
from .conformance import unpack_lanes


class Agg(Packet):
    name = "switchagg"
    fields_desc = [
        ByteField("version", protocol.VERSION),
        ByteEnumField("type", protocol.MSG_DATA, protocol.MSG_NAMES),
        FlagsField("flags", 0, 8, [protocol.FLAG_NAMES[1 << i] for i in range(len(protocol.FLAG_NAMES))]),
        SignedByteField("exp", protocol.EXP_NONE),
        ShortField("job", 0),
        ShortField("rank", 0),
        BitField("shadow", 0, 1),
        BitField("slot", 0, 15),
        ShortField("elems", None),
        IntField("offset", 0),
        IntField("call", 0),
        IntField("total", 0),
        XIntField("key", 0),
        # max_count: scapy stops a list at conf.max_list_count (100) values otherwise.
        FieldListField(
            "values",
            [],
            SignedIntField("", 0),
            length_from=lambda pkt: _whole_words(pkt),
            max_count=protocol.MAX_K,
        ),
    ]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.elems is None:
            n = len(self.values)
            pkt = pkt[:10] + n.to_bytes(2, "big") + pkt[12:]
        return pkt + pay

    def pre_dissect(self, s: bytes) -> bytes:
        # FieldListField needs the byte count before it takes the values: remember what follows
        # the fixed header.
        self._remaining = max(0, len(s) - protocol.HEADER_LEN)
        return s

    def extract_padding(self, s: bytes) -> tuple[bytes, bytes | None]:
        return b"", s

    def to_header(self) -> protocol.Header:
        """The same packet as protocol.Header (the reference encoding)."""
        return protocol.Header.unpack(bytes(self))

    def lane_bits(self) -> int | None:
        """The payload's lane width from the LANES flags: 32, 16 or 8; None for LANES = 0x30 (no width:
        the data plane drops the packet as bad_type)."""
        return protocol.LANE_BITS.get(int(self.flags) & protocol.LANE_FLAGS)

    def narrow(self) -> tuple[list[int], list[int]]:
        """(scale bytes, lanes) of a narrow-lane payload: the same words as ``values``."""
        bits = self.lane_bits()
        if bits is None or bits == 32:
            raise ValueError(f"flags {int(self.flags):#04x} name no narrow lanes")
        return unpack_lanes(list(self.values), bits)

    def mysummary(self) -> Any:
        text = self.sprintf(
            "switchagg %type% job=%job% rank=%rank% slot=%slot%/%shadow% off=%offset% call=%call%"
        )
        bits = self.lane_bits()
        return text if bits == 32 else f"{text} lanes={bits or 'none'}"


def _whole_words(pkt: Packet) -> int:
    """Bytes of int32 values left in the packet being dissected (a trailing partial word is padding)."""
    remaining = getattr(pkt, "_remaining", None)
    return 0 if remaining is None else remaining - remaining % 4


def from_header(h: protocol.Header) -> Agg:
    return Agg(h.pack())


# scapy's VXLAN layer also claims 48879 (0xBEEF); it would otherwise win the dissection.
split_layers(UDP, VXLAN, dport=protocol.UDP_PORT)
bind_layers(UDP, Agg, dport=protocol.UDP_PORT)
bind_layers(UDP, Agg, sport=protocol.UDP_PORT)
