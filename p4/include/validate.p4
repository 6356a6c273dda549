/* The checks of an aggregation packet, in the software aggregator's order; each control records
 * only the first failure (reject_for) and MyIngress skips the rest. The order is part of the
 * protocol (which drop reason a malformed packet counts under): ValidatePacket, then
 * Authenticate (authenticate.p4), then ValidatePayload. */
#ifndef SWITCHAGG_VALIDATE_P4
#define SWITCHAGG_VALIDATE_P4

#include "headers.p4"

/* The header (version, type, a lane width), the job (job table) and the rank. A RESULT is
 * accepted only for a job aggregated here as a leaf, from the spine (rank = this leaf's index). */
control ValidatePacket(inout headers_t hdr, inout metadata_t meta,
                       inout standard_metadata_t standard_metadata) {

    @name(".MyIngress.set_job")
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
    @name(".MyIngress.set_leaf_job")
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

    @name(".MyIngress.unknown_job")
    action unknown_job() {
        meta.job_found = 0;
    }

    @name(".MyIngress.job_table")
    table job_table {
        key = { hdr.agg.job: exact @name("job"); }
        actions = { set_job; set_leaf_job; unknown_job; }
        default_action = unknown_job();
        size = MAX_JOBS;
    }

    apply {
        if (!hdr.agg.isValid()) {
            reject_for(meta, DROP_TRUNCATED);
        } else if (hdr.agg.version != VERSION) {
            reject_for(meta, DROP_BAD_VERSION);
        } else if ((hdr.agg.type != MSG_DATA && hdr.agg.type != MSG_RESULT)
                || (hdr.agg.flags & LANE_FLAGS) == LANE_FLAGS) {
            reject_for(meta, DROP_BAD_TYPE);    /* LANES = 0x30 names no lane width */
        } else {
            job_table.apply();
            bool data = hdr.agg.type == MSG_DATA;
            if (data && meta.job_found == 0) {
                reject_for(meta, DROP_UNKNOWN_JOB);
            } else if (!data && (meta.job_found == 0 || meta.leaf == 0)) {
                reject_for(meta, DROP_BAD_TYPE);
            } else if (data && hdr.agg.rank >= (bit<16>)meta.n) {
                reject_for(meta, DROP_BAD_RANK);
            } else if (!data && hdr.agg.rank != meta.leaf_index) {
                reject_for(meta, DROP_BAD_RANK);
            }
        }
    }
}

/* After authentication: the slot is in the job's range and the packet carries exactly K values. */
control ValidatePayload(inout headers_t hdr, inout metadata_t meta,
                        inout standard_metadata_t standard_metadata) {
    apply {
        if (((hdr.agg.pool & POOL_SLOT_MASK) - meta.slot_base) >= meta.slot_count) {
            reject_for(meta, DROP_BAD_POOL);  /* unsigned wrap-around makes this a range check */
        } else if (!hdr.vals.isValid() || hdr.agg.elems != P4_K
                || standard_metadata.parser_error != error.NoError
                || hdr.ipv4.totalLen != AGG_IP_LEN) {
            reject_for(meta, DROP_TRUNCATED);
        }
    }
}

#endif
