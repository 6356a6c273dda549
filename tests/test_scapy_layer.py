"""The scapy layer encodes and decodes exactly what protocol.Header does."""

from __future__ import annotations

import random

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from switchagg import protocol
from switchagg.conformance import pack_lanes
from switchagg.scapy_layer import Agg, from_header


def _random_header(rng: random.Random) -> protocol.Header:
    k = rng.choice([1, 3, protocol.P4_K])
    return protocol.Header(
        job=rng.randrange(0x10000),
        rank=rng.randrange(0x10000),
        slot=rng.randrange(protocol.POOL_SLOT_MASK + 1),
        shadow=rng.randrange(2),
        offset=rng.randrange(2**32),
        exp=rng.randrange(-128, 128),
        type=rng.choice([protocol.MSG_DATA, protocol.MSG_RESULT]),
        flags=rng.randrange(256),
        values=[rng.randrange(-(2**31), 2**31) for _ in range(k)],
    )


def test_header_length_matches_protocol() -> None:
    assert len(bytes(Agg(elems=0))) == protocol.HEADER_LEN


@pytest.mark.parametrize("seed", range(20))
def test_build_and_dissect_agree_with_protocol(seed: int) -> None:
    h = _random_header(random.Random(seed))
    layer = Agg(
        version=h.version,
        type=h.type,
        flags=h.flags,
        exp=h.exp,
        job=h.job,
        rank=h.rank,
        shadow=h.shadow,
        slot=h.slot,
        offset=h.offset,
        values=h.values,
    )
    assert bytes(layer) == h.pack()
    back = Agg(h.pack())
    assert back.to_header() == protocol.Header.unpack(h.pack())
    assert back.values == h.values and back.elems == len(h.values)
    assert bytes(from_header(h)) == h.pack()


def test_udp_port_binds_both_directions() -> None:
    payload = protocol.Header(job=1, rank=2, slot=3, values=[7] * 4).pack()
    for sport, dport in ((5000, protocol.UDP_PORT), (protocol.UDP_PORT, 5000)):
        frame = Ether(bytes(Ether() / IP() / UDP(sport=sport, dport=dport) / payload))
        assert frame.haslayer(Agg), f"sport={sport} dport={dport} not dissected as Agg"
        assert frame[Agg].values == [7] * 4
    other = Ether(bytes(Ether() / IP() / UDP(sport=5000, dport=5001) / payload))
    assert not other.haslayer(Agg)


def test_truncated_payload_keeps_whole_words_and_pads_the_rest() -> None:
    payload = protocol.Header(job=1, rank=0, slot=0, values=list(range(8))).pack()
    layer = Agg(payload[:-2])
    assert layer.values == list(range(7))
    assert bytes(layer.payload) == payload[-4:-2]
    short = Ether(bytes(Ether() / IP() / UDP(dport=protocol.UDP_PORT) / payload[:10]))
    assert not short.haslayer(Agg) and bytes(short[UDP].payload) == payload[:10]


def test_explicit_elems_is_kept_for_malformed_packets() -> None:
    raw = bytes(Agg(elems=63, values=[1] * 64))
    assert protocol.Header.unpack(raw).elems == 63


def test_a_full_software_datagram_dissects() -> None:
    values = list(range(-5, protocol.MAX_K - 5))
    back = Agg(protocol.Header(job=1, rank=0, slot=0, values=values).pack())
    assert back.values == values and back.elems == protocol.MAX_K


@pytest.mark.parametrize(("bits", "lanes"), [(16, [0x7FFF, -1, -0x8000, 5]), (8, [0x7F, -1, -0x80, 5])])
def test_narrow_lanes_show_their_width_scales_and_lanes(bits: int, lanes: list[int]) -> None:
    scales = [0x80, 0x7F, 0xFF]
    words = pack_lanes(lanes, scales, protocol.P4_K, bits)
    flags = protocol.FLAG_FLOAT | protocol.LANE_FLAG[bits]
    pkt = Agg(protocol.Header(job=1, rank=0, slot=0, flags=flags, values=words).pack())
    assert pkt.lane_bits() == bits and f"LANE{bits}" in str(pkt.flags)
    assert pkt.mysummary().endswith(f"lanes={bits}")
    got_scales, got_lanes = pkt.narrow()
    assert got_scales == scales + [0] * (4 * protocol.scale_words(protocol.P4_K, bits) - 3)
    assert got_lanes == lanes + [0] * (protocol.lanes_per_packet(protocol.P4_K, bits) - 4)


def test_lanes_0x30_name_no_width() -> None:
    pkt = Agg(protocol.Header(job=1, rank=0, slot=0, flags=protocol.LANE_FLAGS, values=[0] * 4).pack())
    assert pkt.lane_bits() is None and pkt.mysummary().endswith("lanes=none")
    with pytest.raises(ValueError, match="no narrow lanes"):
        pkt.narrow()
    assert Agg(values=[1]).lane_bits() == 32 and "lanes" not in Agg(values=[1]).mysummary()
