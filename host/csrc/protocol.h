/* switchagg wire protocol constants for C. The source of truth is host/switchagg/protocol.py
 * (see docs/PROTOCOL.md); tests/test_protocol_consistency.py checks these against it. */
#ifndef SWITCHAGG_PROTOCOL_H
#define SWITCHAGG_PROTOCOL_H

#include <stdint.h>

#define SA_VERSION 1
#define SA_UDP_PORT 48879
#define SA_MSG_DATA 1
#define SA_MSG_RESULT 2
#define SA_FLAG_PRIME 0x01
#define SA_POOL_SET_BIT 0x8000
#define SA_POOL_SLOT_MASK 0x7FFF
#define SA_EXP_NONE (-128)
#define SA_HEADER_LEN 16
#define SA_MAX_WORKERS 32
#define SA_P4_K 64
#define SA_P4_NUM_SLOTS 1024
#define SA_MAX_UDP_PAYLOAD 65507
#define SA_MAX_K ((SA_MAX_UDP_PAYLOAD - SA_HEADER_LEN) / 4)

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
} __attribute__((packed));

_Static_assert(sizeof(struct sa_header) == SA_HEADER_LEN, "header must be 16 bytes");

#endif
