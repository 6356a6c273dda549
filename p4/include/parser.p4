/* Parser and deparser: Ethernet / ARP or IPv4 / UDP / the aggregation header / K values. */
#ifndef SWITCHAGG_PARSER_P4
#define SWITCHAGG_PARSER_P4

#include "headers.p4"

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

#endif
