/* A leaf of a two-level job (docs/PROTOCOL.md "The P4 program: one program, two roles"): a
 * locally complete slot goes up to the spine as this leaf's partial; a spine RESULT that does not
 * answer a waiting partial is dropped. (An accepted one is multicast by Result.) */
#ifndef SWITCHAGG_UPLINK_P4
#define SWITCHAGG_UPLINK_P4

#include "headers.p4"

control LeafUplink(inout headers_t hdr, inout metadata_t meta,
                   inout standard_metadata_t standard_metadata) {

    @name(".MyIngress.upstream")
    counter(MAX_JOBS, CounterType.packets_and_bytes) upstream;
    @name(".MyIngress.upstream_resent")
    counter(MAX_JOBS, CounterType.packets_and_bytes) upstream_resent;
    @name(".MyIngress.stale_results")
    counter(MAX_JOBS, CounterType.packets_and_bytes) stale_results;

    /* Turn the DATA packet into this leaf's partial for the spine: a worker's DATA with rank = the
     * leaf index, the slot's value, exponent, round identity and poison (aggregate_slot left them
     * in the header), the session's incarnation in the key field (the DATA's); from this leaf's address. */
    @name(".MyIngress.make_partial")
    action make_partial() {
        meta.to_spine = 1;
        hdr.agg.rank = meta.leaf_index;
        hdr.ethernet.dstAddr = meta.spine_mac;
        hdr.ethernet.srcAddr = meta.agg_mac;
        hdr.ipv4.srcAddr = hdr.ipv4.dstAddr;
        hdr.ipv4.dstAddr = meta.spine_ip;
        hdr.udp.srcPort = UDP_PORT;
        hdr.udp.dstPort = meta.spine_udp_port;
        standard_metadata.egress_spec = meta.up_port;
    }

    apply {
        if (meta.outcome == OUT_UPSTREAM) {
            upstream.count(meta.counter_index);
            make_partial();
        } else if (meta.outcome == OUT_UPSTREAM_RESENT) {
            upstream_resent.count(meta.counter_index);
            make_partial();
        } else if (meta.outcome == OUT_STALE_RESULT) {
            stale_results.count(meta.counter_index);
            mark_to_drop(standard_metadata);
        }
    }
}

#endif
