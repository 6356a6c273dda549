/* A DATA's rank is its registered ingress port and address (IPv4, UDP port: worker table); a
 * RESULT's sender is the spine, on the job's uplink port from the spine's address (job table,
 * set_leaf_job). Anything else counts as spoofed. */
#ifndef SWITCHAGG_AUTHENTICATE_P4
#define SWITCHAGG_AUTHENTICATE_P4

#include "headers.p4"

control Authenticate(inout headers_t hdr, inout metadata_t meta,
                     inout standard_metadata_t standard_metadata) {

    @name(".MyIngress.set_worker")
    action set_worker(port_t port, ip4_t ip, bit<16> udp_port) {
        meta.worker_found = 1;
        meta.worker_port = port;
        meta.worker_ip = ip;
        meta.worker_udp_port = udp_port;
    }

    @name(".MyIngress.unknown_worker")
    action unknown_worker() {
        meta.worker_found = 0;
    }

    @name(".MyIngress.worker_table")
    table worker_table {
        key = {
            hdr.agg.job: exact @name("job");
            hdr.agg.rank: exact @name("rank");
        }
        actions = { set_worker; unknown_worker; }
        default_action = unknown_worker();
        size = 2048;
    }

    apply {
        bool data = hdr.agg.type == MSG_DATA;
        if (data) {
            worker_table.apply();
        }
        bool authentic = (data && meta.worker_found == 1
                && standard_metadata.ingress_port == meta.worker_port
                && hdr.ipv4.srcAddr == meta.worker_ip && hdr.udp.srcPort == meta.worker_udp_port)
            || (!data && standard_metadata.ingress_port == meta.up_port
                && hdr.ipv4.srcAddr == meta.spine_ip && hdr.udp.srcPort == meta.spine_udp_port);
        if (!authentic) {
            reject_for(meta, DROP_SPOOFED);
        }
    }
}

#endif
