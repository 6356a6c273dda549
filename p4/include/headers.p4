/* Header types, the parsed-header struct and the metadata every control shares. */
#ifndef SWITCHAGG_HEADERS_P4
#define SWITCHAGG_HEADERS_P4

#include "constants.p4"

/* The K = 64 payload values are separate header fields (so the parser, the checksum and the
 * aggregation action can name them); this X-macro repeats a statement for each index. */
#define FOR_EACH_VALUE(X) X(0) X(1) X(2) X(3) FOR_EACH_DATA_VALUE(X)
/* The values after the first MISMATCH_INFO_LEN = 4, which a poisoned round uses to say who differed. */
#define FOR_EACH_DATA_VALUE(X) \
                      X(4)  X(5)  X(6)  X(7)  X(8)  X(9)  X(10) X(11) X(12) X(13) X(14) X(15) \
    X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) X(28) X(29) X(30) X(31) \
    X(32) X(33) X(34) X(35) X(36) X(37) X(38) X(39) X(40) X(41) X(42) X(43) X(44) X(45) X(46) X(47) \
    X(48) X(49) X(50) X(51) X(52) X(53) X(54) X(55) X(56) X(57) X(58) X(59) X(60) X(61) X(62) X(63)

typedef bit<48> mac_t;
typedef bit<32> ip4_t;
typedef bit<9>  port_t;

header ethernet_t {
    mac_t   dstAddr;
    mac_t   srcAddr;
    bit<16> etherType;
}

header arp_t {
    bit<16> htype;
    bit<16> ptype;
    bit<8>  hlen;
    bit<8>  plen;
    bit<16> oper;
    mac_t   sha;
    ip4_t   spa;
    mac_t   tha;
    ip4_t   tpa;
}

header ipv4_t {
    bit<4>  version;
    bit<4>  ihl;
    bit<8>  diffserv;
    bit<16> totalLen;
    bit<16> identification;
    bit<3>  flags;
    bit<13> fragOffset;
    bit<8>  ttl;
    bit<8>  protocol;
    bit<16> hdrChecksum;
    ip4_t   srcAddr;
    ip4_t   dstAddr;
}

header udp_t {
    bit<16> srcPort;
    bit<16> dstPort;
    bit<16> length_;
    bit<16> checksum;
}

header agg_t {
    bit<8>  version;
    bit<8>  type;
    bit<8>  flags;
    bit<8>  exp;      /* int8 on the wire; compared with the sign bit flipped */
    bit<16> job;
    bit<16> rank;
    bit<16> pool;     /* bit 15: shadow set, bits 0-14: slot */
    bit<16> elems;
    bit<32> offset;
    bit<32> call;     /* the job's call sequence number */
    bit<32> total;    /* elements in the call's tensor */
    bit<32> key;      /* RESULT: the job's result key ^ the session's incarnation; DATA: the incarnation */
}

#define VALUE_FIELD(i) bit<32> v##i;
header vals_t {
    FOR_EACH_VALUE(VALUE_FIELD)
}

struct headers_t {
    ethernet_t ethernet;
    arp_t      arp;
    ipv4_t     ipv4;
    udp_t      udp;
    agg_t      agg;
    vals_t     vals;
}

struct metadata_t {
    /* the aggregator-address table: looked up with the IPv4 or ARP target address */
    ip4_t   lookup_ip;
    bit<1>  to_aggregator;
    mac_t   agg_mac;
    /* the first failed check (ValidatePacket, Authenticate, ValidatePayload): MyIngress counts
     * and drops */
    bit<1>  rejected;
    bit<32> drop_reason;
    /* from the job table */
    bit<1>  job_found;
    bit<8>  n;
    bit<16> mgrp;
    bit<16> slot_base;
    bit<16> slot_count;
    bit<16> generation;
    bit<32> counter_index;
    bit<32> key;              /* written into every RESULT of the job */
    /* from the job table, a leaf's job only (set_job: leaf = 0, m = n) */
    bit<1>  leaf;
    bit<8>  m;                /* local ranks: a slot is complete when all m contributed */
    bit<16> first_local;      /* the lowest local rank: only its resends re-send the partial */
    bit<16> leaf_index;       /* this leaf's rank at the spine */
    port_t  up_port;          /* the port towards the spine */
    mac_t   spine_mac;
    ip4_t   spine_ip;
    bit<16> spine_udp_port;
    /* from the worker table */
    bit<1>  worker_found;
    port_t  worker_port;
    ip4_t   worker_ip;
    bit<16> worker_udp_port;
    /* the aggregation decision, carried into egress (copied into multicast replicas) */
    bit<3>  outcome;
    bit<1>  to_spine;
    bit<1>  is_result;
    bit<1>  multicast;
    bit<1>  l2_flood;
    bit<16> dst_rank;
}

/* A check failed: MyIngress drops the packet and counts it under reason (drop_for). A function,
 * not an action: an action would be a new P4Info name. */
void reject_for(inout metadata_t meta, in bit<32> reason) {
    meta.rejected = 1;
    meta.drop_reason = reason;
}

#endif
