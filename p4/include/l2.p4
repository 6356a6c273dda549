/* The aggregator's address and ordinary L2 traffic: the aggregator table picks the packets this
 * switch aggregates (and the ARP requests it answers); everything else is forwarded by MAC, so
 * the job's ARP and TCP rendezvous cross the same switch. Tables and actions keep the names of
 * the one-control program (@name ".MyIngress..."): controller/switchagg_controller/p4_program.py
 * and the P4Info IDs depend on them. */
#ifndef SWITCHAGG_L2_P4
#define SWITCHAGG_L2_P4

#include "headers.p4"

/* Sets meta.to_aggregator (and agg_mac) for ARP requests for, and UDP to port 48879 of, an
 * aggregator address, and answers those ARP requests. */
control AggregatorAddress(inout headers_t hdr, inout metadata_t meta,
                          inout standard_metadata_t standard_metadata) {

    @name(".MyIngress.to_aggregator")
    action to_aggregator(mac_t mac) {
        meta.to_aggregator = 1;
        meta.agg_mac = mac;
    }

    @name(".MyIngress.not_aggregator")
    action not_aggregator() {
        meta.to_aggregator = 0;
    }

    @name(".MyIngress.aggregator")
    table aggregator {
        key = { meta.lookup_ip: exact @name("dst_ip"); }
        actions = { to_aggregator; not_aggregator; }
        default_action = not_aggregator();
        size = 16;
    }

    /* The switch answers ARP for the aggregator address, so hosts need no static entry. */
    @name(".MyIngress.arp_reply")
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
        }
    }
}

/* Everything not for the aggregator: exact destination MAC to a port or a flood group. */
control L2Forward(inout headers_t hdr, inout metadata_t meta,
                  inout standard_metadata_t standard_metadata) {

    @name(".MyIngress.drop")
    action drop() {
        mark_to_drop(standard_metadata);
    }

    @name(".MyIngress.l2_unicast")
    action l2_unicast(port_t port) {
        standard_metadata.egress_spec = port;
    }

    @name(".MyIngress.l2_broadcast")
    action l2_broadcast(bit<16> group) {
        standard_metadata.mcast_grp = group;
        meta.l2_flood = 1;
    }

    @name(".MyIngress.l2_forward")
    table l2_forward {
        key = { hdr.ethernet.dstAddr: exact @name("dst_mac"); }
        actions = { l2_unicast; l2_broadcast; drop; }
        default_action = drop();
        size = 1024;
    }

    apply {
        l2_forward.apply();
    }
}

/* Egress: flooding never sends a frame back where it came from. */
control L2FloodPrune(inout headers_t hdr, inout metadata_t meta,
                     inout standard_metadata_t standard_metadata) {
    apply {
        if (meta.l2_flood == 1 && standard_metadata.egress_port == standard_metadata.ingress_port) {
            mark_to_drop(standard_metadata);
        }
    }
}

#endif
