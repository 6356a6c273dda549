/* Results to the workers. Ingress: the packet itself becomes the RESULT (from the aggregator's
 * address); a completed slot, or a spine's result stored at a leaf, is multicast to the job's
 * group (one replica per local rank, replica id = rank); a retransmission to a complete slot is
 * answered by unicast out of its ingress port; anything else is absorbed. Egress: each copy gets
 * its rank's address. Names are those of the one-control program (@name ".MyIngress..." and
 * ".MyEgress..."): the controller fills result_dst and reads these counters by name. */
#ifndef SWITCHAGG_RESULT_P4
#define SWITCHAGG_RESULT_P4

#include "headers.p4"

control Result(inout headers_t hdr, inout metadata_t meta,
               inout standard_metadata_t standard_metadata) {

    @name(".MyIngress.multicast")
    counter(MAX_JOBS, CounterType.packets_and_bytes) multicast;
    @name(".MyIngress.resent")
    counter(MAX_JOBS, CounterType.packets_and_bytes) resent;
    @name(".MyIngress.retrans_ignored")
    counter(MAX_JOBS, CounterType.packets_and_bytes) retrans_ignored;

    /* Turn the DATA packet into a RESULT from the aggregator; egress sets the destination. */
    @name(".MyIngress.make_result")
    action make_result() {
        meta.is_result = 1;
        hdr.agg.type = MSG_RESULT;
        hdr.agg.key = meta.key ^ hdr.agg.key; /* the DATA's incarnation: a result answers only its session */
        hdr.ethernet.srcAddr = meta.agg_mac;
        hdr.ipv4.srcAddr = hdr.ipv4.dstAddr;
        hdr.udp.srcPort = UDP_PORT;
    }

    apply {
        if (meta.outcome == OUT_MULTICAST || meta.outcome == OUT_STORED) {
            multicast.count(meta.counter_index);
            make_result();
            meta.multicast = 1;
            standard_metadata.mcast_grp = meta.mgrp;
        } else if (meta.outcome == OUT_RESENT) {
            resent.count(meta.counter_index);
            make_result();
            meta.multicast = 0;
            standard_metadata.egress_spec = standard_metadata.ingress_port;
        } else if (meta.outcome == OUT_RETRANS_IGNORED) {
            retrans_ignored.count(meta.counter_index);
            mark_to_drop(standard_metadata);
        } else if (meta.outcome == OUT_AGGREGATED) {
            mark_to_drop(standard_metadata);
        }
    }
}

/* Per copy of a result: the replica id of a multicast copy is the rank it goes to; a unicast
 * resend goes back to the rank in the header. */
control ResultDestination(inout headers_t hdr, inout metadata_t meta,
                          inout standard_metadata_t standard_metadata) {

    @name(".MyEgress.set_result_dst")
    action set_result_dst(mac_t mac, ip4_t ip, bit<16> udp_port) {
        hdr.ethernet.dstAddr = mac;
        hdr.ipv4.dstAddr = ip;
        hdr.udp.dstPort = udp_port;
    }

    @name(".MyEgress.drop")
    action drop() {
        mark_to_drop(standard_metadata);
    }

    @name(".MyEgress.result_dst")
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
        }
    }
}

#endif
