/* switchagg wire protocol constants for C. The source of truth is host/switchagg/protocol.py
 * (see docs/PROTOCOL.md); tests/test_protocol_consistency.py checks these against it. */
#ifndef SWITCHAGG_PROTOCOL_H
#define SWITCHAGG_PROTOCOL_H

#include <stdint.h>

#define SA_VERSION 2
#define SA_UDP_PORT 48879
#define SA_MSG_DATA 1
#define SA_MSG_RESULT 2
#define SA_MSG_STATUS 3 /* software aggregator -> worker: a round waits for the ranks not in its bitmap */
#define SA_STATUS_LAG 3 /* rounds of a class a rank contributes to after one it skipped: then it is missing */
#define SA_FLAG_PRIME 0x01
#define SA_FLAG_FLOAT 0x02
#define SA_FLAG_ABORT 0x04
#define SA_FLAG_MISMATCH 0x08
#define SA_FLAG_LANE16 0x10 /* bits 4-5: the payload's lane width (docs/PROTOCOL.md, Narrow lanes) */
#define SA_FLAG_LANE8 0x20
#define SA_LANE_FLAGS (SA_FLAG_LANE16 | SA_FLAG_LANE8)
#define SA_FLAG_HELLO 0x40 /* a round of a session's hello (docs/PROTOCOL.md, Sessions) */
#define SA_IDENTITY_FLAGS (SA_FLAG_PRIME | SA_FLAG_FLOAT | SA_LANE_FLAGS | SA_FLAG_HELLO)
#define SA_HELLO_PHASES 16 /* a hello that has not agreed after this many rounds fails */
#define SA_POISON_FLAGS (SA_FLAG_ABORT | SA_FLAG_MISMATCH)
#define SA_MISMATCH_INFO_LEN 4
#define SA_POOL_SET_BIT 0x8000
#define SA_POOL_SLOT_MASK 0x7FFF
#define SA_EXP_NONE (-128)
#define SA_EXP_TOP 126
#define SA_EXP_NONFINITE 127
#define SA_SCALE_BLOCK 32 /* narrow lanes: values per scale byte */
#define SA_SCALE_BIAS 128 /* scale byte = exponent + 128: 0 an all-zero block, 255 non-finite */
#define SA_HEADER_LEN 28
#define SA_MAX_WORKERS 32
#define SA_P4_K 64
#define SA_P4_NUM_SLOTS 1024
#define SA_MAX_UDP_PAYLOAD 65507
#define SA_MAX_K ((SA_MAX_UDP_PAYLOAD - SA_HEADER_LEN) / 4)
/* A GSO train carries slots of one steering class (slot mod SA_STEER_CLASSES) only, and a multi-threaded
 * aggregator gives each thread whole classes ((slot mod SA_STEER_CLASSES) mod threads): the kernel steers a
 * train whole by its first packet, so every packet of a slot always reaches the same thread, in order. */
#define SA_STEER_CLASSES 8
#define SA_IPV4_UDP_HEADERS 28 /* IPv4 (no options) + UDP: a datagram of L bytes is an IP packet of L + 28 */

/* The lane width (32, 16, 8) of a packet's flags; 0 for the invalid LANES value 3. */
static inline int sa_lane_bits(uint8_t flags) {
    static const int bits[4] = {32, 16, 8, 0};
    return bits[(flags & SA_LANE_FLAGS) >> 4];
}

/* Values in a packet of k words with lanes of `bits` (protocol.lanes_per_packet): k for 32-bit lanes,
 * else the most V whose lanes and scale words (one scale byte per SA_SCALE_BLOCK values) fit k words. */
static inline uint32_t sa_lanes_per_packet(uint32_t k, int bits) {
    if (bits == 32) return k;
    uint32_t per_word = 32u / (uint32_t)bits, best = 0;
    for (uint32_t x = 1; x < k; x++) {
        uint32_t lanes = per_word * (k - x), scaled = 4u * SA_SCALE_BLOCK * x;
        uint32_t v = lanes < scaled ? lanes : scaled;
        if (v > best) best = v;
    }
    return best;
}

/* Words of scale bytes that lead a narrow payload of k words (protocol.scale_words); 0 for 32 bits. */
static inline uint32_t sa_scale_words(uint32_t k, int bits) {
    if (bits == 32) return 0;
    uint32_t blocks = (sa_lanes_per_packet(k, bits) + SA_SCALE_BLOCK - 1) / SA_SCALE_BLOCK;
    return (blocks + 3) / 4;
}

/* Drop reasons, in the order of protocol.DROP_REASONS. */
enum sa_drop {
    SA_DROP_BAD_VERSION = 0,
    SA_DROP_BAD_TYPE,
    SA_DROP_UNKNOWN_JOB,
    SA_DROP_BAD_RANK,
    SA_DROP_SPOOFED,
    SA_DROP_BAD_POOL,
    SA_DROP_TRUNCATED,
    SA_DROP_NREASONS
};

/* On-wire header; all multi-byte fields big-endian. */
struct sa_header {
    uint8_t version;
    uint8_t type;
    uint8_t flags;
    int8_t exp;
    uint16_t job;
    uint16_t rank;
    uint16_t pool;
    uint16_t elems;
    uint32_t offset;
    uint32_t call;  /* the job's call sequence number */
    uint32_t total; /* elements in the call's tensor */
    uint32_t key;   /* RESULT: the job's result key; DATA: 0 */
} __attribute__((packed));

_Static_assert(sizeof(struct sa_header) == SA_HEADER_LEN, "header must be 28 bytes");

#endif
