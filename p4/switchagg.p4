/* switchagg: in-network integer aggregation (docs/PROTOCOL.md), P4_16 for v1model / bmv2.
 *
 * One program for both levels of docs/PROTOCOL.md "Two levels": a job installed with set_job is
 * aggregated here completely (one level, or the spine of a two-level job, whose ranks are the
 * leaves); a job installed with set_leaf_job is summed over its local ranks and the partial goes
 * up to the spine, whose RESULT this switch stores and multicasts to the local ranks.
 *
 * Aggregation packets (UDP to the aggregator address, port 48879) are summed in registers;
 * everything else is forwarded by an L2 table so the job's ordinary traffic (ARP, TCP
 * rendezvous) crosses the same switch. The names below are what
 * controller/switchagg_controller/p4_program.py fills; change both together.
 */
#include <core.p4>
#include <v1model.p4>

/* Must equal host/switchagg/protocol.py (tests/test_protocol_consistency.py checks). */
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
const bit<8>  IDENTITY_FLAGS = 0x03;    /* PRIME | FLOAT: part of a contribution's call identity */
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

/* What aggregate_slot decided for a DATA packet. */
const bit<3> OUT_AGGREGATED      = 0;
const bit<3> OUT_MULTICAST       = 1;
const bit<3> OUT_RESENT          = 2;
const bit<3> OUT_RETRANS_IGNORED = 3;
const bit<3> OUT_UPSTREAM        = 4;    /* leaf: the local slot completed, the partial goes up */
const bit<3> OUT_UPSTREAM_RESENT = 5;    /* leaf: the first local rank's resend to a waiting slot */

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
    bit<32> key;      /* RESULT: the job's result key; DATA: 0 */
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
    bit<1>  stored;           /* a spine RESULT was the answer to this leaf's partial */
    bit<1>  to_spine;
    bit<1>  is_result;
    bit<1>  multicast;
    bit<1>  l2_flood;
    bit<16> dst_rank;
}

parser MyParser(packet_in packet, out headers_t hdr, inout metadata_t meta,
                inout standard_metadata_t standard_metadata) {
    state start {
        packet.extract(hdr.ethernet);
        transition select(hdr.ethernet.etherType) {
            0x0800: parse_ipv4;
            0x0806: parse_arp;
            default: accept;
        }
    }

    state parse_arp {
        packet.extract(hdr.arp);
        transition accept;
    }

    state parse_ipv4 {
        packet.extract(hdr.ipv4);
        /* Only option-less, unfragmented UDP can be an aggregation packet. */
        transition select(hdr.ipv4.ihl, hdr.ipv4.fragOffset, hdr.ipv4.protocol) {
            (5, 0, 17): parse_udp;
            default: accept;
        }
    }

    state parse_udp {
        packet.extract(hdr.udp);
        transition select(hdr.udp.dstPort) {
            UDP_PORT: check_agg_len;
            default: accept;
        }
    }

    /* A UDP payload shorter than the 28-byte header leaves hdr.agg invalid (ingress counts it
     * as truncated); the values are parsed only when the length is exactly right, so a packet
     * of another length keeps hdr.vals invalid. A length field that lies about a short packet
     * makes extract fail (parser_error), which ingress also counts as truncated. */
    state check_agg_len {
        transition select(hdr.udp.length_) {
            0 &&& 0xFFE0: accept;     /* 0..31  */
            32 &&& 0xFFFC: accept;    /* 32..35 */
            default: parse_agg;
        }
    }

    state parse_agg {
        packet.extract(hdr.agg);
        transition select(hdr.udp.length_) {
            AGG_UDP_LEN: parse_vals;
            default: accept;
        }
    }

    state parse_vals {
        packet.extract(hdr.vals);
        transition accept;
    }
}

control MyVerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

control MyIngress(inout headers_t hdr, inout metadata_t meta,
                  inout standard_metadata_t standard_metadata) {

    /* Aggregation state (docs/PROTOCOL.md "Aggregation state per slot"). Index: slot for
     * slot_gen, 2 * slot + set for the rest, (2 * slot + set) * K + i for value i. */
    register<bit<16>>(P4_NUM_SLOTS) slot_gen;
    register<bit<32>>(NUM_SETS) bitmap;
    register<bit<8>>(NUM_SETS) count;
    register<bit<8>>(NUM_SETS) max_exp;
    register<bit<32>>(NUM_SETS * 64) values;
    /* The round's identity, from its first contribution, and the poison it got (docs/PROTOCOL.md,
     * Call identity); a leaf's partial carries them up. */
    register<bit<32>>(NUM_SETS) round_call;
    register<bit<32>>(NUM_SETS) round_total;
    register<bit<32>>(NUM_SETS) round_offset;
    register<bit<8>>(NUM_SETS) round_flags;
    register<bit<8>>(NUM_SETS) poison;
    /* Leaf jobs only: the set holds the spine's result. */
    register<bit<1>>(NUM_SETS) final;

    counter(NUM_DROP_REASONS, CounterType.packets_and_bytes) drops;
    counter(MAX_JOBS, CounterType.packets_and_bytes) aggregated;
    counter(MAX_JOBS, CounterType.packets_and_bytes) multicast;
    counter(MAX_JOBS, CounterType.packets_and_bytes) resent;
    counter(MAX_JOBS, CounterType.packets_and_bytes) retrans_ignored;
    counter(MAX_JOBS, CounterType.packets_and_bytes) upstream;
    counter(MAX_JOBS, CounterType.packets_and_bytes) upstream_resent;
    counter(MAX_JOBS, CounterType.packets_and_bytes) stale_results;

    action drop() {
        mark_to_drop(standard_metadata);
    }

    action drop_for(bit<32> reason) {
        drops.count(reason);
        mark_to_drop(standard_metadata);
    }

    /* ---- ordinary L2 traffic ---- */

    action l2_unicast(port_t port) {
        standard_metadata.egress_spec = port;
    }

    action l2_broadcast(bit<16> group) {
        standard_metadata.mcast_grp = group;
        meta.l2_flood = 1;
    }

    table l2_forward {
        key = { hdr.ethernet.dstAddr: exact @name("dst_mac"); }
        actions = { l2_unicast; l2_broadcast; drop; }
        default_action = drop();
        size = 1024;
    }

    /* ---- aggregation ---- */

    action to_aggregator(mac_t mac) {
        meta.to_aggregator = 1;
        meta.agg_mac = mac;
    }

    action not_aggregator() {
        meta.to_aggregator = 0;
    }

    table aggregator {
        key = { meta.lookup_ip: exact @name("dst_ip"); }
        actions = { to_aggregator; not_aggregator; }
        default_action = not_aggregator();
        size = 16;
    }

    action set_job(bit<8> n, bit<16> mgrp, bit<16> slot_base, bit<16> slot_count,
                   bit<16> generation, bit<32> counter_index, bit<32> key) {
        meta.job_found = 1;
        meta.key = key;
        meta.n = n;
        meta.mgrp = mgrp;
        meta.slot_base = slot_base;
        meta.slot_count = slot_count;
        meta.generation = generation;
        meta.counter_index = counter_index;
        meta.leaf = 0;
        meta.m = n;
    }

    /* A leaf of a two-level job: n is the job's total (ranks are job ranks), m of them are local. */
    action set_leaf_job(bit<8> n, bit<8> m, bit<16> first_local, bit<16> leaf_index, bit<16> mgrp,
                        bit<16> slot_base, bit<16> slot_count, bit<16> generation,
                        bit<32> counter_index, port_t up_port, mac_t spine_mac, ip4_t spine_ip,
                        bit<16> spine_udp_port, bit<32> key) {
        set_job(n, mgrp, slot_base, slot_count, generation, counter_index, key);
        meta.leaf = 1;
        meta.m = m;
        meta.first_local = first_local;
        meta.leaf_index = leaf_index;
        meta.up_port = up_port;
        meta.spine_mac = spine_mac;
        meta.spine_ip = spine_ip;
        meta.spine_udp_port = spine_udp_port;
    }

    action unknown_job() {
        meta.job_found = 0;
    }

    table job_table {
        key = { hdr.agg.job: exact @name("job"); }
        actions = { set_job; set_leaf_job; unknown_job; }
        default_action = unknown_job();
        size = MAX_JOBS;
    }

    action set_worker(port_t port, ip4_t ip, bit<16> udp_port) {
        meta.worker_found = 1;
        meta.worker_port = port;
        meta.worker_ip = ip;
        meta.worker_udp_port = udp_port;
    }

    action unknown_worker() {
        meta.worker_found = 0;
    }

    table worker_table {
        key = {
            hdr.agg.job: exact @name("job");
            hdr.agg.rank: exact @name("rank");
        }
        actions = { set_worker; unknown_worker; }
        default_action = unknown_worker();
        size = 2048;
    }

/* A poisoned round adds nothing more; the contribution that poisons it writes, into values 0..3,
 * who differed: from its payload if it carries that (an abort, a poisoned partial), else its
 * rank, call, total and flags. */
#define VALUE_UPDATE(i) \
        values.read(old, base + i); \
        sum = is_new ? (first ? hdr.vals.v##i : (adds ? old + hdr.vals.v##i : old)) : old; \
        values.write(base + i, sum); \
        hdr.vals.v##i = sum;
#define VALUE_UPDATE_INFO(i, info) \
        values.read(old, base + i); \
        sum = is_new ? (first ? hdr.vals.v##i \
                      : (adds ? old + hdr.vals.v##i : (poisons ? (carries ? hdr.vals.v##i : (info)) : old))) \
              : old; \
        values.write(base + i, sum); \
        hdr.vals.v##i = sum;

    /* The whole read-modify-write of one slot: bmv2 runs an action atomically with respect to
     * the registers it uses. Written with ?: (no branches) so every target compiles it. On
     * return hdr.agg and hdr.vals hold the slot's state (identity, poison, exponent, values), i.e.
     * the result if it is complete. */
    action aggregate_slot() {
        bit<32> slot = (bit<32>)(hdr.agg.pool & POOL_SLOT_MASK);
        bit<32> shadow = (bit<32>)(hdr.agg.pool >> 15);
        bit<32> si = 2 * slot + shadow;
        bit<32> so = 2 * slot + (1 - shadow);

        bit<16> gen;
        slot_gen.read(gen, slot);
        bool fresh = gen != meta.generation;
        slot_gen.write(slot, meta.generation);

        bit<32> bm_s;
        bit<32> bm_o;
        bit<8> cnt_s;
        bit<8> cnt_o;
        bit<8> e_s;
        bitmap.read(bm_s, si);
        bitmap.read(bm_o, so);
        count.read(cnt_s, si);
        count.read(cnt_o, so);
        max_exp.read(e_s, si);
        bm_s = fresh ? 32w0 : bm_s;
        bm_o = fresh ? 32w0 : bm_o;
        cnt_s = fresh ? 8w0 : cnt_s;
        cnt_o = fresh ? 8w0 : cnt_o;
        bit<32> rc;
        bit<32> rt;
        bit<32> po;
        bit<8> pf;
        bit<8> ps;
        round_call.read(rc, si);
        round_total.read(rt, si);
        round_offset.read(po, si);
        round_flags.read(pf, si);
        poison.read(ps, si);
        /* Leaf state (written for every job; only a leaf's job reads it). */
        bit<1> fin_s;
        bit<1> fin_o;
        final.read(fin_s, si);
        final.read(fin_o, so);
        fin_s = fresh ? 1w0 : fin_s;
        fin_o = fresh ? 1w0 : fin_o;

        bit<32> me = 32w1 << (bit<8>)hdr.agg.rank;
        bool is_new = (bm_s & me) == 0;
        bool first = bm_s == 0;
        bm_s = bm_s | me;
        bm_o = is_new ? (bm_o & ~me) : bm_o;
        cnt_s = is_new ? (first ? 8w1 : cnt_s + 1) : cnt_s;
        /* signed max: flipping the sign bit maps int8 order onto unsigned order */
        bool pkt_bigger = (hdr.agg.exp ^ 0x80) > (e_s ^ 0x80);
        e_s = is_new ? ((first || pkt_bigger) ? hdr.agg.exp : e_s) : e_s;
        /* Call identity: a contribution that differs from the round's first poisons the round. */
        bool differs = hdr.agg.call != rc || hdr.agg.total != rt || hdr.agg.offset != po
                       || (hdr.agg.flags & IDENTITY_FLAGS) != (pf & IDENTITY_FLAGS);
        bit<8> pkt_poison = hdr.agg.flags & POISON_FLAGS;
        bit<8> new_poison = pkt_poison | (differs ? FLAG_MISMATCH : 8w0);
        bool carries = pkt_poison != 0;
        bool poisons = is_new && !first && ps == 0 && new_poison != 0;
        bool adds = is_new && !first && ps == 0 && new_poison == 0;
        bool opens = is_new && first;    /* the first contribution of a round on this set */
        bit<32> info_rank = (bit<32>)hdr.agg.rank;
        bit<32> info_call = hdr.agg.call;
        bit<32> info_total = hdr.agg.total;
        bit<32> info_flags = (bit<32>)hdr.agg.flags;
        ps = opens ? pkt_poison : (is_new ? (ps | new_poison) : ps);
        rc = opens ? hdr.agg.call : rc;
        rt = opens ? hdr.agg.total : rt;
        po = opens ? hdr.agg.offset : po;
        pf = opens ? hdr.agg.flags : pf;
        fin_s = opens ? 1w0 : fin_s;

        bitmap.write(si, bm_s);
        bitmap.write(so, bm_o);
        count.write(si, cnt_s);
        count.write(so, cnt_o);
        max_exp.write(si, e_s);
        final.write(si, fin_s);
        final.write(so, fin_o);
        round_call.write(si, rc);
        round_total.write(si, rt);
        round_offset.write(si, po);
        round_flags.write(si, pf);
        poison.write(si, ps);

        bit<32> base = si * 64;
        bit<32> old;
        bit<32> sum;
        VALUE_UPDATE_INFO(0, info_rank)
        VALUE_UPDATE_INFO(1, info_call)
        VALUE_UPDATE_INFO(2, info_total)
        VALUE_UPDATE_INFO(3, info_flags)
        FOR_EACH_DATA_VALUE(VALUE_UPDATE)

        /* One level: complete when all n contributed. A leaf: when all m local ranks did; it
         * answers a resend itself only once the spine's result is in (final). */
        bool complete = cnt_s == meta.m;
        bool leaf = meta.leaf == 1;
        bool first_local = hdr.agg.rank == meta.first_local;
        bit<3> resend = (leaf && fin_s == 1) ? OUT_RESENT
                      : (!complete ? OUT_RETRANS_IGNORED
                      : (!leaf ? OUT_RESENT
                      : (first_local ? OUT_UPSTREAM_RESENT : OUT_RETRANS_IGNORED)));
        meta.outcome = is_new ? (complete ? (leaf ? OUT_UPSTREAM : OUT_MULTICAST) : OUT_AGGREGATED)
                              : resend;
        hdr.agg.exp = e_s;
        hdr.agg.flags = pf | ps;
        hdr.agg.offset = po;
        hdr.agg.call = rc;
        hdr.agg.total = rt;
    }

#define VALUE_STORE(i) \
        values.read(old, base + i); \
        values.write(base + i, ok ? hdr.vals.v##i : old);

    /* A leaf takes the spine's RESULT for a slot only as the answer to its partial: the slot is
     * of this installation, locally complete, not final yet, the result carries the job's key and
     * the partial's identity (call, total, offset, PRIME/FLOAT). Then the result replaces the
     * partial, its poison is kept, and the set is final. */
    action store_result() {
        bit<32> slot = (bit<32>)(hdr.agg.pool & POOL_SLOT_MASK);
        bit<32> si = 2 * slot + (bit<32>)(hdr.agg.pool >> 15);
        bit<16> gen;
        bit<8> cnt_s;
        bit<1> fin_s;
        bit<32> rc;
        bit<32> rt;
        bit<32> po;
        bit<8> pf;
        bit<8> ps;
        bit<8> e_s;
        slot_gen.read(gen, slot);
        count.read(cnt_s, si);
        final.read(fin_s, si);
        round_call.read(rc, si);
        round_total.read(rt, si);
        round_offset.read(po, si);
        round_flags.read(pf, si);
        poison.read(ps, si);
        max_exp.read(e_s, si);
        bool ok = gen == meta.generation && cnt_s == meta.m && fin_s == 0 && hdr.agg.key == meta.key
                  && hdr.agg.call == rc && hdr.agg.total == rt && hdr.agg.offset == po
                  && (hdr.agg.flags & IDENTITY_FLAGS) == (pf & IDENTITY_FLAGS);
        final.write(si, ok ? 1w1 : fin_s);
        max_exp.write(si, ok ? hdr.agg.exp : e_s);
        poison.write(si, ok ? (hdr.agg.flags & POISON_FLAGS) : ps);
        bit<32> base = si * 64;
        bit<32> old;
        FOR_EACH_VALUE(VALUE_STORE)
        meta.stored = ok ? 1w1 : 1w0;
    }

    /* Turn the DATA packet into this leaf's partial for the spine: a worker's DATA with rank = the
     * leaf index, the slot's value, exponent, round identity and poison (aggregate_slot left them
     * in the header), no key; from this leaf's address. */
    action make_partial() {
        meta.to_spine = 1;
        hdr.agg.rank = meta.leaf_index;
        hdr.agg.key = 0;
        hdr.ethernet.dstAddr = meta.spine_mac;
        hdr.ethernet.srcAddr = meta.agg_mac;
        hdr.ipv4.srcAddr = hdr.ipv4.dstAddr;
        hdr.ipv4.dstAddr = meta.spine_ip;
        hdr.udp.srcPort = UDP_PORT;
        hdr.udp.dstPort = meta.spine_udp_port;
        standard_metadata.egress_spec = meta.up_port;
    }

    /* Turn the DATA packet into a RESULT from the aggregator; egress sets the destination. */
    action make_result() {
        meta.is_result = 1;
        hdr.agg.type = MSG_RESULT;
        hdr.agg.key = meta.key;
        hdr.ethernet.srcAddr = meta.agg_mac;
        hdr.ipv4.srcAddr = hdr.ipv4.dstAddr;
        hdr.udp.srcPort = UDP_PORT;
    }

    /* The switch answers ARP for the aggregator address, so hosts need no static entry. */
    action arp_reply() {
        hdr.arp.oper = 2;
        hdr.arp.tha = hdr.arp.sha;
        hdr.arp.sha = meta.agg_mac;
        hdr.arp.tpa = hdr.arp.spa;
        hdr.arp.spa = meta.lookup_ip;
        hdr.ethernet.dstAddr = hdr.ethernet.srcAddr;
        hdr.ethernet.srcAddr = meta.agg_mac;
        standard_metadata.egress_spec = standard_metadata.ingress_port;
    }

    apply {
        /* bmv2 wants each table applied at one place: pick the address to look up first. */
        bool lookup = false;
        if (hdr.arp.isValid() && hdr.arp.oper == 1 && hdr.arp.ptype == 0x0800) {
            meta.lookup_ip = hdr.arp.tpa;
            lookup = true;
        } else if (hdr.udp.isValid() && hdr.udp.dstPort == UDP_PORT) {
            meta.lookup_ip = hdr.ipv4.dstAddr;
            lookup = true;
        }
        if (lookup) {
            aggregator.apply();
        }
        if (meta.to_aggregator == 1 && hdr.arp.isValid()) {
            arp_reply();
        } else if (meta.to_aggregator == 0) {
            l2_forward.apply();
        } else if (!hdr.agg.isValid()) {
            drop_for(DROP_TRUNCATED);
        } else if (hdr.agg.version != VERSION) {
            drop_for(DROP_BAD_VERSION);
        } else if (hdr.agg.type != MSG_DATA && hdr.agg.type != MSG_RESULT) {
            drop_for(DROP_BAD_TYPE);
        } else {
            job_table.apply();
            bool data = hdr.agg.type == MSG_DATA;
            if (data && meta.job_found == 0) {
                drop_for(DROP_UNKNOWN_JOB);
            } else if (!data && (meta.job_found == 0 || meta.leaf == 0)) {
                drop_for(DROP_BAD_TYPE);  /* a RESULT only for a job aggregated here as a leaf */
            } else if (data && hdr.agg.rank >= (bit<16>)meta.n) {
                drop_for(DROP_BAD_RANK);
            } else if (!data && hdr.agg.rank != meta.leaf_index) {
                drop_for(DROP_BAD_RANK);
            } else {
                if (data) {
                    worker_table.apply();
                }
                /* A rank is its ingress port and its address (IPv4, UDP port), as registered; the
                 * spine is the upstream port and its address. */
                bool authentic = (data && meta.worker_found == 1
                        && standard_metadata.ingress_port == meta.worker_port
                        && hdr.ipv4.srcAddr == meta.worker_ip && hdr.udp.srcPort == meta.worker_udp_port)
                    || (!data && standard_metadata.ingress_port == meta.up_port
                        && hdr.ipv4.srcAddr == meta.spine_ip && hdr.udp.srcPort == meta.spine_udp_port);
                if (!authentic) {
                    drop_for(DROP_SPOOFED);
                } else if (((hdr.agg.pool & POOL_SLOT_MASK) - meta.slot_base) >= meta.slot_count) {
                    drop_for(DROP_BAD_POOL);  /* unsigned wrap-around makes this a range check */
                } else if (!hdr.vals.isValid() || hdr.agg.elems != P4_K
                        || standard_metadata.parser_error != error.NoError
                        || hdr.ipv4.totalLen != AGG_IP_LEN) {
                    drop_for(DROP_TRUNCATED);
                } else if (!data) {
                    store_result();
                    if (meta.stored == 1) {
                        multicast.count(meta.counter_index);
                        make_result();
                        meta.multicast = 1;
                        standard_metadata.mcast_grp = meta.mgrp;
                    } else {
                        stale_results.count(meta.counter_index);
                        drop();
                    }
                } else {
                    aggregate_slot();
                    if (meta.outcome == OUT_MULTICAST) {
                        aggregated.count(meta.counter_index);
                        multicast.count(meta.counter_index);
                        make_result();
                        meta.multicast = 1;
                        standard_metadata.mcast_grp = meta.mgrp;
                    } else if (meta.outcome == OUT_UPSTREAM) {
                        aggregated.count(meta.counter_index);
                        upstream.count(meta.counter_index);
                        make_partial();
                    } else if (meta.outcome == OUT_UPSTREAM_RESENT) {
                        upstream_resent.count(meta.counter_index);
                        make_partial();
                    } else if (meta.outcome == OUT_RESENT) {
                        resent.count(meta.counter_index);
                        make_result();
                        meta.multicast = 0;
                        standard_metadata.egress_spec = standard_metadata.ingress_port;
                    } else {
                        if (meta.outcome == OUT_AGGREGATED) {
                            aggregated.count(meta.counter_index);
                        } else {
                            retrans_ignored.count(meta.counter_index);
                        }
                        drop();
                    }
                }
            }
        }
    }
}

control MyEgress(inout headers_t hdr, inout metadata_t meta,
                 inout standard_metadata_t standard_metadata) {

    action set_result_dst(mac_t mac, ip4_t ip, bit<16> udp_port) {
        hdr.ethernet.dstAddr = mac;
        hdr.ipv4.dstAddr = ip;
        hdr.udp.dstPort = udp_port;
    }

    action drop() {
        mark_to_drop(standard_metadata);
    }

    /* Per copy of a result: the replica id of a multicast copy is the rank it goes to; a
     * unicast resend goes back to the rank in the header. */
    table result_dst {
        key = {
            hdr.agg.job: exact @name("job");
            meta.dst_rank: exact @name("rank");
        }
        actions = { set_result_dst; drop; }
        default_action = drop();
        size = 2048;
    }

    apply {
        if (meta.is_result == 1) {
            meta.dst_rank = meta.multicast == 1 ? (bit<16>)standard_metadata.egress_rid : hdr.agg.rank;
            hdr.agg.rank = meta.dst_rank;
            result_dst.apply();
        } else if (meta.l2_flood == 1 && standard_metadata.egress_port == standard_metadata.ingress_port) {
            drop();  /* flooding never sends a frame back where it came from */
        }
    }
}

#define VALUE_CSUM(i) , hdr.vals.v##i

control MyComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        update_checksum(hdr.ipv4.isValid() && hdr.ipv4.ihl == 5,
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.totalLen,
              hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.fragOffset, hdr.ipv4.ttl,
              hdr.ipv4.protocol, hdr.ipv4.srcAddr, hdr.ipv4.dstAddr },
            hdr.ipv4.hdrChecksum, HashAlgorithm.csum16);
        /* Results and partials are fully parsed (UDP length is checked): the payload is all fields. */
        update_checksum(meta.is_result == 1 || meta.to_spine == 1,
            { hdr.ipv4.srcAddr, hdr.ipv4.dstAddr, 8w0, hdr.ipv4.protocol, hdr.udp.length_,
              hdr.udp.srcPort, hdr.udp.dstPort, hdr.udp.length_,
              hdr.agg.version, hdr.agg.type, hdr.agg.flags, hdr.agg.exp, hdr.agg.job,
              hdr.agg.rank, hdr.agg.pool, hdr.agg.elems, hdr.agg.offset, hdr.agg.call,
              hdr.agg.total, hdr.agg.key
              FOR_EACH_VALUE(VALUE_CSUM) },
            hdr.udp.checksum, HashAlgorithm.csum16);
    }
}

control MyDeparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.ethernet);
        packet.emit(hdr.arp);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.udp);
        packet.emit(hdr.agg);
        packet.emit(hdr.vals);
    }
}

V1Switch(MyParser(), MyVerifyChecksum(), MyIngress(), MyEgress(), MyComputeChecksum(), MyDeparser()) main;
