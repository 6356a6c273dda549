/* Checksums: nothing is verified (ingress checks lengths instead); IPv4 and, for what this
 * switch writes (results, partials), UDP are recomputed. */
#ifndef SWITCHAGG_CHECKSUM_P4
#define SWITCHAGG_CHECKSUM_P4

#include "headers.p4"

control MyVerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
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

#endif
