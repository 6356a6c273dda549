/* Protocol and program constants. Must equal host/switchagg/protocol.py
 * (tests/test_protocol_consistency.py reads them from this file). */
#ifndef SWITCHAGG_CONSTANTS_P4
#define SWITCHAGG_CONSTANTS_P4

const bit<8>  VERSION      = 2;
const bit<16> UDP_PORT     = 48879;
const bit<8>  MSG_DATA     = 1;
const bit<8>  MSG_RESULT   = 2;
const bit<16> P4_K         = 64;
const bit<32> P4_NUM_SLOTS = 1024;
const bit<16> POOL_SLOT_MASK = 0x7FFF;
const bit<8>  FLAG_PRIME    = 0x01;
const bit<8>  FLAG_FLOAT    = 0x02;
const bit<8>  FLAG_ABORT    = 0x04;
const bit<8>  FLAG_MISMATCH = 0x08;
/* Bits 4-5: the payload's lane width (docs/PROTOCOL.md, Narrow lanes); both set names none. */
const bit<8>  FLAG_LANE16   = 0x10;
const bit<8>  FLAG_LANE8    = 0x20;
const bit<8>  LANE_FLAGS    = 0x30;
const bit<8>  FLAG_HELLO    = 0x40;     /* a round of a session's hello (docs/PROTOCOL.md, Sessions) */
const bit<8>  IDENTITY_FLAGS = 0x73;    /* PRIME | FLOAT | LANES | HELLO: part of a contribution's call identity */
const bit<8>  POISON_FLAGS   = 0x0C;    /* ABORT | MISMATCH: the round carries no sum */

const bit<16> AGG_UDP_LEN = 8 + 28 + 4 * 64;    /* UDP header + agg header + K values */
const bit<16> AGG_IP_LEN  = 20 + AGG_UDP_LEN;
const bit<32> NUM_SETS    = 2 * P4_NUM_SLOTS;    /* (slot, shadow set) pairs */
const bit<32> MAX_JOBS    = 64;                  /* size of the per-job counter arrays */

/* Drop reasons: the index order of protocol.DROP_REASONS. */
const bit<32> DROP_BAD_VERSION = 0;
const bit<32> DROP_BAD_TYPE    = 1;
const bit<32> DROP_UNKNOWN_JOB = 2;
const bit<32> DROP_BAD_RANK    = 3;
const bit<32> DROP_SPOOFED     = 4;
const bit<32> DROP_BAD_POOL    = 5;
const bit<32> DROP_TRUNCATED   = 6;
const bit<32> NUM_DROP_REASONS = 7;

/* What Aggregate decided for an admitted packet; LeafUplink and Result act on it. */
const bit<3> OUT_AGGREGATED      = 0;
const bit<3> OUT_MULTICAST       = 1;
const bit<3> OUT_RESENT          = 2;
const bit<3> OUT_RETRANS_IGNORED = 3;
const bit<3> OUT_UPSTREAM        = 4;    /* leaf: the local slot completed, the partial goes up */
const bit<3> OUT_UPSTREAM_RESENT = 5;    /* leaf: the first local rank's resend to a waiting slot */
const bit<3> OUT_STORED          = 6;    /* leaf: the spine's RESULT answered the partial */
const bit<3> OUT_STALE_RESULT    = 7;    /* leaf: a spine RESULT that answers no waiting partial */

#endif
