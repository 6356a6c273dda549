/* The slots (docs/PROTOCOL.md "Aggregation state per slot"): generations, the two shadow sets
 * of each slot with their bitmaps, counts, exponents and values, the round's call identity and
 * poison, and a leaf's `final` flag. One action per packet reads and writes all of a set
 * (bmv2 runs an action atomically over the registers it uses), so every register lives in this
 * control; it leaves its decision in meta.outcome for LeafUplink and Result. Names are those of
 * the one-control program (@name ".MyIngress..."): the controller and the bmv2 tests read these
 * registers and counters by name. */
#ifndef SWITCHAGG_AGGREGATE_P4
#define SWITCHAGG_AGGREGATE_P4

#include "headers.p4"

control Aggregate(inout headers_t hdr, inout metadata_t meta,
                  inout standard_metadata_t standard_metadata) {

    /* Index: 2 * slot + set, (2 * slot + set) * K + i for value i. A set's stamp is the generation of
     * its installation and the session incarnation of its round (docs/PROTOCOL.md, Sessions). */
    @name(".MyIngress.set_gen")      register<bit<16>>(NUM_SETS) set_gen;
    @name(".MyIngress.set_inc")      register<bit<32>>(NUM_SETS) set_inc;
    @name(".MyIngress.bitmap")       register<bit<32>>(NUM_SETS) bitmap;
    @name(".MyIngress.count")        register<bit<8>>(NUM_SETS) count;
    @name(".MyIngress.max_exp")      register<bit<8>>(NUM_SETS) max_exp;
    @name(".MyIngress.values")       register<bit<32>>(NUM_SETS * 64) values;
    /* The round's identity, from its first contribution, and the poison it got (docs/PROTOCOL.md,
     * Call identity); a leaf's partial carries them up. */
    @name(".MyIngress.round_call")   register<bit<32>>(NUM_SETS) round_call;
    @name(".MyIngress.round_total")  register<bit<32>>(NUM_SETS) round_total;
    @name(".MyIngress.round_offset") register<bit<32>>(NUM_SETS) round_offset;
    @name(".MyIngress.round_flags")  register<bit<8>>(NUM_SETS) round_flags;
    @name(".MyIngress.poison")       register<bit<8>>(NUM_SETS) poison;
    /* Leaf jobs only: the set holds the spine's result. */
    @name(".MyIngress.final")        register<bit<1>>(NUM_SETS) final;

    @name(".MyIngress.aggregated")
    counter(MAX_JOBS, CounterType.packets_and_bytes) aggregated;

/* Narrow lanes (docs/PROTOCOL.md): a value word adds each lane on its own, wrapping within the
 * lane (lane_h: the lanes' sign bits; 0x80000000 makes it the plain 32-bit add), and a scale word
 * takes the unsigned max of each byte (masked bytes compare like the bytes themselves). */
#define LANE_ADD(a, b) ((((a) & ~lane_h) + ((b) & ~lane_h)) ^ (((a) ^ (b)) & lane_h))
#define BYTE_MAX(a, b, m) (((a) & (m)) > ((b) & (m)) ? ((a) & (m)) : ((b) & (m)))
#define SCALE_MAX(a, b) (BYTE_MAX(a, b, 32w0xFF000000) | BYTE_MAX(a, b, 32w0x00FF0000) \
                         | BYTE_MAX(a, b, 32w0x0000FF00) | BYTE_MAX(a, b, 32w0x000000FF))

/* A poisoned round adds nothing more; the contribution that poisons it writes, into values 0..3,
 * who differed: from its payload if it carries that (an abort, a poisoned partial), else its
 * rank, call, total and flags. Only values 0..3 can be scale words (scale: this one is). */
#define VALUE_UPDATE(i) \
        values.read(old, base + i); \
        sum = is_new ? (first ? hdr.vals.v##i : (adds ? LANE_ADD(old, hdr.vals.v##i) : old)) : old; \
        values.write(base + i, sum); \
        hdr.vals.v##i = sum;
#define VALUE_UPDATE_INFO(i, info, scale) \
        values.read(old, base + i); \
        sum = is_new ? (first ? hdr.vals.v##i \
                      : (adds ? ((scale) ? SCALE_MAX(old, hdr.vals.v##i) : LANE_ADD(old, hdr.vals.v##i)) \
                      : (poisons ? (carries ? hdr.vals.v##i : (info)) : old))) \
              : old; \
        values.write(base + i, sum); \
        hdr.vals.v##i = sum;

    /* The whole read-modify-write of one slot for a DATA packet. Written with ?: (no branches)
     * so every target compiles it. On return hdr.agg and hdr.vals hold the slot's state
     * (identity, poison, exponent, values), i.e. the result if it is complete. */
    @name(".MyIngress.aggregate_slot")
    action aggregate_slot() {
        bit<32> slot = (bit<32>)(hdr.agg.pool & POOL_SLOT_MASK);
        bit<32> shadow = (bit<32>)(hdr.agg.pool >> 15);
        bit<32> si = 2 * slot + shadow;
        bit<32> so = 2 * slot + (1 - shadow);

        /* A set of another installation or another session (a DATA's key field is its session's
         * incarnation) is empty for this packet: no earlier session's bit makes it a retransmission. */
        bit<16> gen;
        bit<32> inc;
        set_gen.read(gen, si);
        set_inc.read(inc, si);
        bool fresh = gen != meta.generation || inc != hdr.agg.key;
        set_gen.write(si, meta.generation);
        set_inc.write(si, hdr.agg.key);
        /* the other set's round is this packet's to leave only if it is of its session */
        bit<16> gen_o;
        bit<32> inc_o;
        set_gen.read(gen_o, so);
        set_inc.read(inc_o, so);
        bool same_o = gen_o == meta.generation && inc_o == hdr.agg.key;

        bit<32> bm_s;
        bit<32> bm_o;
        bit<8> cnt_s;
        bit<8> e_s;
        bitmap.read(bm_s, si);
        bitmap.read(bm_o, so);
        count.read(cnt_s, si);
        max_exp.read(e_s, si);
        bm_s = fresh ? 32w0 : bm_s;
        cnt_s = fresh ? 8w0 : cnt_s;
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
        final.read(fin_s, si);
        fin_s = fresh ? 1w0 : fin_s;

        bit<32> me = 32w1 << (bit<8>)hdr.agg.rank;
        bool is_new = (bm_s & me) == 0;
        bool first = bm_s == 0;
        bm_s = bm_s | me;
        bm_o = (is_new && same_o) ? (bm_o & ~me) : bm_o;
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
        max_exp.write(si, e_s);
        final.write(si, fin_s);
        round_call.write(si, rc);
        round_total.write(si, rt);
        round_offset.write(si, po);
        round_flags.write(si, pf);
        poison.write(si, ps);

        /* The round's lane width (a contribution that adds has the round's identity, LANES
         * included). At P4_K = 64 a payload leads with scale_words(64, w) words of scale bytes:
         * word 0 for 16- and 8-bit lanes, word 1 too for 8-bit ones. */
        bit<8> lanes = pf & LANE_FLAGS;
        bit<32> lane_h = lanes == FLAG_LANE16 ? 32w0x80008000
                       : (lanes == FLAG_LANE8 ? 32w0x80808080 : 32w0x80000000);
        bool scale0 = lanes != 0;
        bool scale1 = lanes == FLAG_LANE8;

        bit<32> base = si * 64;
        bit<32> old;
        bit<32> sum;
        VALUE_UPDATE_INFO(0, info_rank, scale0)
        VALUE_UPDATE_INFO(1, info_call, scale1)
        VALUE_UPDATE_INFO(2, info_total, false)
        VALUE_UPDATE_INFO(3, info_flags, false)
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
     * of this installation, locally complete, not final yet, the result carries the job's key for the
     * set's session (key ^ incarnation) and the partial's identity (call, total, offset, PRIME/FLOAT/LANES). Then the result replaces
     * the partial (narrow lanes too: the spine did the lane arithmetic), its poison is kept, and
     * the set is final. */
    @name(".MyIngress.store_result")
    action store_result() {
        bit<32> slot = (bit<32>)(hdr.agg.pool & POOL_SLOT_MASK);
        bit<32> si = 2 * slot + (bit<32>)(hdr.agg.pool >> 15);
        bit<16> gen;
        bit<32> inc;
        bit<8> cnt_s;
        bit<1> fin_s;
        bit<32> rc;
        bit<32> rt;
        bit<32> po;
        bit<8> pf;
        bit<8> ps;
        bit<8> e_s;
        set_gen.read(gen, si);
        set_inc.read(inc, si);
        count.read(cnt_s, si);
        final.read(fin_s, si);
        round_call.read(rc, si);
        round_total.read(rt, si);
        round_offset.read(po, si);
        round_flags.read(pf, si);
        poison.read(ps, si);
        max_exp.read(e_s, si);
        bool ok = gen == meta.generation && cnt_s == meta.m && fin_s == 0 && hdr.agg.key == (meta.key ^ inc)
                  && hdr.agg.call == rc && hdr.agg.total == rt && hdr.agg.offset == po
                  && (hdr.agg.flags & IDENTITY_FLAGS) == (pf & IDENTITY_FLAGS);
        final.write(si, ok ? 1w1 : fin_s);
        max_exp.write(si, ok ? hdr.agg.exp : e_s);
        poison.write(si, ok ? (hdr.agg.flags & POISON_FLAGS) : ps);
        bit<32> base = si * 64;
        bit<32> old;
        FOR_EACH_VALUE(VALUE_STORE)
        meta.outcome = ok ? OUT_STORED : OUT_STALE_RESULT;
        hdr.agg.key = inc; /* Result writes the job's key for this session: meta.key ^ hdr.agg.key */
    }

    apply {
        if (hdr.agg.type == MSG_DATA) {
            aggregate_slot();
            /* a new contribution, whatever it completed */
            if (meta.outcome == OUT_AGGREGATED || meta.outcome == OUT_MULTICAST
                    || meta.outcome == OUT_UPSTREAM) {
                aggregated.count(meta.counter_index);
            }
        } else {
            store_result();
        }
    }
}

#endif
