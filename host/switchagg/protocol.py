"""The switchagg wire protocol: the one place its constants are defined in Python.

docs/PROTOCOL.md explains every field. host/csrc/protocol.h, p4/switchagg.p4 and the
scapy layer repeat these numbers because their languages need them at compile time;
tests/test_protocol_consistency.py checks that all four agree.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

VERSION = 2  # 2: call identity (call, total) and the result key in the header
UDP_PORT = 48879  # 0xBEEF

MSG_DATA = 1  # worker -> aggregator: a contribution
MSG_RESULT = 2  # aggregator -> worker: the finished sum of a slot
# software aggregator -> worker (or leaf): a round waits for a contribution that a rank sent past
# (docs/PROTOCOL.md, Loss notices); one word of payload, the ranks the round has
MSG_STATUS = 3
MSG_NAMES = {MSG_DATA: "DATA", MSG_RESULT: "RESULT", MSG_STATUS: "STATUS"}
STATUS_LAG = 3  # rounds of its steering class a rank contributes to after one it skipped: then it is missing

FLAG_PRIME = 0x01  # payload is zero; the packet only carries an exponent ahead
FLAG_FLOAT = 0x02  # the payload is quantized float32 (clear: int32); part of the call's identity
FLAG_ABORT = 0x04  # DATA: the sender abandons this call; RESULT: a contribution to the round did
FLAG_MISMATCH = 0x08  # RESULT: the round's contributions differ in call identity (payload: who)
# Bits 4-5: the lane width of the payload's values (docs/PROTOCOL.md, Narrow lanes): 0 = 32-bit lanes,
# FLAG_LANE16 = 16-bit, FLAG_LANE8 = 8-bit; both bits set is no width (dropped as bad_type).
FLAG_LANE16 = 0x10
FLAG_LANE8 = 0x20
LANE_FLAGS = FLAG_LANE16 | FLAG_LANE8
# A round of a session's hello (docs/PROTOCOL.md, Sessions): int32, call 0, one word per rank.
FLAG_HELLO = 0x40
HELLO_ROUNDS = 16  # a hello that has not agreed after this many rounds fails
FLAG_NAMES = {
    FLAG_PRIME: "PRIME",
    FLAG_FLOAT: "FLOAT",
    FLAG_ABORT: "ABORT",
    FLAG_MISMATCH: "MISMATCH",
    FLAG_LANE16: "LANE16",
    FLAG_LANE8: "LANE8",
    FLAG_HELLO: "HELLO",
}
LANE_BITS = {0: 32, FLAG_LANE16: 16, FLAG_LANE8: 8}  # lane flags -> width
LANE_FLAG = {bits: flag for flag, bits in LANE_BITS.items()}  # width -> lane flags
WIRE_BITS = (32, 16, 8)
# A contribution's identity, compared within a slot round: (call, total, offset, flags & IDENTITY_FLAGS).
IDENTITY_FLAGS = FLAG_PRIME | FLAG_FLOAT | LANE_FLAGS | FLAG_HELLO
# A round that got a contribution with one of these, or contributions of different identity, is
# poisoned: its RESULT carries them and no sum (docs/PROTOCOL.md, Call identity).
POISON_FLAGS = FLAG_ABORT | FLAG_MISMATCH
# The payload of a poisoned round: [rank, call, total, flags] of the contribution that differed.
MISMATCH_INFO_LEN = 4

POOL_SET_BIT = 0x8000  # top bit of the pool field: shadow set (0 or 1)
POOL_SLOT_MASK = 0x7FFF  # low 15 bits: absolute slot index

EXP_NONE = -128  # "no exponent": the block is all zero or no block follows
EXP_TOP = 126  # the largest finite exponent field: it stands for E = 128 (blocks above 2^125)
EXP_NONFINITE = 127  # the block holds NaN or +-Inf on some rank; the max over ranks keeps it
# Narrow lanes: values share one scale byte per block of SCALE_BLOCK values; the byte is the block's
# exponent + SCALE_BIAS (0: an all-zero block, 255: non-finite), so the max over ranks is an unsigned max.
SCALE_BLOCK = 32
SCALE_BIAS = 128

HEADER_FORMAT = "!BBBbHHHHIIII"
HEADER_FIELDS = (
    "version",
    "type",
    "flags",
    "exp",
    "job",
    "rank",
    "pool",
    "elems",
    "offset",
    "call",
    "total",
    "key",
)  # in order
HEADER_LEN = struct.calcsize(HEADER_FORMAT)  # 28

MAX_WORKERS = 32  # worker bitmaps are 32 bits wide
P4_K = 64  # elements per packet on the P4 switch (a compile-time constant there)
P4_NUM_SLOTS = 1024  # slots in the P4 switch's pool (each with two shadow sets)
MAX_UDP_PAYLOAD = 65507
MAX_K = (MAX_UDP_PAYLOAD - HEADER_LEN) // 4  # 16369: largest K in one datagram
DEFAULT_SW_K = 16368  # software aggregator default: ~64 KiB datagrams, one skb each on loopback
DEFAULT_SW_SLOTS = 16  # slots (= packets in flight per worker) per job, software: the least by default
# A GSO train (several packets in one send, steered whole by the kernel by its first packet) carries
# slots of one class, slot mod STEER_CLASSES, and an aggregator thread owns whole classes: so every
# packet of a slot reaches the same thread, in the order it was sent (docs/PROTOCOL.md, GSO).
STEER_CLASSES = 8
IPV4_UDP_HEADERS = 28  # an IPv4 header without options and a UDP header: what a datagram adds on the wire
# Bytes in flight per worker the default window aims at, whatever K: the bandwidth-delay product of a
# data-centre link with room to spare (192 KiB is 1.5 ms at 1 Gbit/s), and no more: what is in flight
# beyond it waits in the link's queue, and a lost packet's slot waits a round trip through that queue
# to be repaired (at 200 Mbit/s, n = 8, 1% frame loss: 92% of S/R with 192 KiB, 85% with 512 KiB).
WINDOW_BYTES = 192 << 10

# Drop reasons, in counter-index order (the P4 drop counter uses the same indices).
DROP_REASONS = (
    "bad_version",
    "bad_type",
    "unknown_job",
    "bad_rank",
    "spoofed",
    "bad_pool",
    "truncated",
)
DROP_INDEX = {name: i for i, name in enumerate(DROP_REASONS)}

# Per-job counters (P4: counter arrays indexed by the job's counter index).
JOB_COUNTERS = ("aggregated", "multicast", "resent", "retrans_ignored")
# A leaf's job counts these too (docs/PROTOCOL.md, Two levels), in C and in P4.
LEAF_COUNTERS = ("upstream", "upstream_resent", "stale_results")

INT32_MAX = 2**31 - 1


@dataclass
class Header:
    """One aggregation header; ``values`` is the K-element int32 payload."""

    job: int
    rank: int
    slot: int
    shadow: int = 0
    offset: int = 0
    exp: int = EXP_NONE
    type: int = MSG_DATA
    flags: int = 0
    version: int = VERSION
    elems: int = 0
    call: int = 0
    total: int = 0
    key: int = 0
    values: list[int] = field(default_factory=list)

    def pack(self) -> bytes:
        elems = self.elems or len(self.values)
        pool = (POOL_SET_BIT if self.shadow else 0) | (self.slot & POOL_SLOT_MASK)
        head = struct.pack(
            HEADER_FORMAT,
            self.version,
            self.type,
            self.flags,
            self.exp,
            self.job,
            self.rank,
            pool,
            elems,
            self.offset,
            self.call,
            self.total,
            self.key,
        )
        return head + struct.pack(f"!{len(self.values)}i", *self.values)

    @classmethod
    def unpack(cls, data: bytes) -> Header:
        if len(data) < HEADER_LEN:
            raise ValueError(f"packet of {len(data)} bytes is shorter than the {HEADER_LEN}-byte header")
        version, type_, flags, exp, job, rank, pool, elems, offset, call, total, key = struct.unpack_from(
            HEADER_FORMAT, data
        )
        body = data[HEADER_LEN:]
        n = len(body) // 4
        values = list(struct.unpack(f"!{n}i", body[: 4 * n]))
        return cls(
            job=job,
            rank=rank,
            slot=pool & POOL_SLOT_MASK,
            shadow=1 if pool & POOL_SET_BIT else 0,
            offset=offset,
            exp=exp,
            type=type_,
            flags=flags,
            version=version,
            elems=elems,
            call=call,
            total=total,
            key=key,
            values=values,
        )


def packet_len(k: int) -> int:
    """UDP payload length of a packet carrying K elements."""
    return HEADER_LEN + 4 * k


def k_for_mtu(mtu: int) -> int:
    """The largest K whose datagram fits one IP packet of ``mtu`` bytes (no fragment), at most
    DEFAULT_SW_K: 361 on a 1500-byte link, 2236 on a 9000-byte one, DEFAULT_SW_K on loopback."""
    k = (mtu - IPV4_UDP_HEADERS - HEADER_LEN) // 4
    if k < 1:
        raise ValueError(f"an MTU of {mtu} bytes holds no packet of even one value")
    return min(k, DEFAULT_SW_K)


def mtu_for_k(k: int) -> int:
    """The smallest MTU that carries a packet of K values unfragmented."""
    return packet_len(k) + IPV4_UDP_HEADERS


def window_slots(k: int) -> int:
    """Default slots (packets in flight) for packets of K values: WINDOW_BYTES' worth, at least
    DEFAULT_SW_SLOTS: 16 at the default K, 22 at K = 2236 (MTU 9000), 134 at K = 361 (MTU 1500)."""
    return max(DEFAULT_SW_SLOTS, -(-WINDOW_BYTES // packet_len(k)))


def lanes_per_packet(k: int, bits: int = 32) -> int:
    """Values in a packet of K 32-bit words with lanes of ``bits``: K for 32-bit lanes; for narrow lanes
    the most V whose lanes and scale bytes (one per SCALE_BLOCK values, whole words) fit K words:
    126 (16-bit) and 248 (8-bit) at the P4 switch's K = 64, 710 and 1400 at K = 361 (MTU 1500)."""
    if bits == 32:
        return k
    if bits not in WIRE_BITS:
        raise ValueError(f"lanes are 32, 16 or 8 bits wide, not {bits}")
    per_word = 32 // bits
    best = 0
    for scale_words in range(1, k):  # V(X) = min(lanes in K - X words, values that X words have scales for)
        best = max(best, min(per_word * (k - scale_words), 4 * SCALE_BLOCK * scale_words))
    return best


def scale_words(k: int, bits: int) -> int:
    """Words of scale bytes that lead a narrow-lane payload of K words (0 for 32-bit lanes)."""
    if bits == 32:
        return 0
    blocks = -(-lanes_per_packet(k, bits) // SCALE_BLOCK)
    return -(-blocks // 4)


def lane_limit(n: int, bits: int) -> int:
    """M: the largest magnitude one of n contributions may have in a lane of ``bits``, so their sum fits."""
    return (2 ** (bits - 1) - 1) // n


def lane_error_bound(n: int, e_max: int, bits: int) -> float:
    """Documented bound on |result - exact sum| for one element summed in lanes of ``bits`` (docs/PROTOCOL.md,
    Narrow lanes): n steps of 2^E / M (stochastic rounding moves each value by less than a step), plus the
    float32 arithmetic's n * 2^(E-22); for 32-bit lanes, error_bound."""
    if bits == 32:
        return error_bound(n, e_max)
    e = exponent_value(e_max)
    return n * 2.0**e / lane_limit(n, bits) + n * 2.0 ** (e - 22)


def exponent_value(e_field: int) -> int:
    """The E an exponent stands for: itself up to 125; EXP_TOP and above (a frexp exponent of a block
    above 2^125) mean 128."""
    return 128 if e_field >= EXP_TOP else e_field


def error_bound(n: int, e_max: int) -> float:
    """Documented float32 bound on |result - exact sum| for one element (docs/PROTOCOL.md); e_max is
    the block's exponent field (EXP_TOP stands for E = 128)."""
    return float(n) * 2.0 ** (exponent_value(e_max) - 22)
