/* switchagg: in-network integer aggregation (docs/PROTOCOL.md), P4_16 for v1model / bmv2.
 *
 * One program for both levels of docs/PROTOCOL.md "Two levels": a job installed with set_job is
 * aggregated here completely (one level, or the spine of a two-level job, whose ranks are the
 * leaves); a job installed with set_leaf_job is summed over its local ranks and the partial goes
 * up to the spine, whose RESULT this switch stores and multicasts to the local ranks.
 *
 * Aggregation packets (UDP to the aggregator address, port 48879) are summed in registers;
 * everything else is forwarded by an L2 table so the job's ordinary traffic (ARP, TCP
 * rendezvous) crosses the same switch.
 *
 * This file only composes; each concern is a control of its own in include/ (docs/BMV2.md).
 * Their tables, actions, registers and counters keep the names MyIngress.x / MyEgress.x
 * (@name), which controller/switchagg_controller/p4_program.py uses; change both together.
 */
#include <core.p4>
#include <v1model.p4>

#include "include/constants.p4"
#include "include/headers.p4"
#include "include/parser.p4"
#include "include/checksum.p4"
#include "include/l2.p4"
#include "include/validate.p4"
#include "include/authenticate.p4"
#include "include/aggregate.p4"
#include "include/uplink.p4"
#include "include/result.p4"

control MyIngress(inout headers_t hdr, inout metadata_t meta,
                  inout standard_metadata_t standard_metadata) {

    AggregatorAddress() address;
    L2Forward() l2;
    ValidatePacket() validate;
    Authenticate() authenticate;
    ValidatePayload() validate_payload;
    Aggregate() aggregate;
    LeafUplink() uplink;
    Result() result;

    /* Every failed check is counted here, by reason (protocol.DROP_INDEX). */
    counter(NUM_DROP_REASONS, CounterType.packets_and_bytes) drops;

    action drop_for(bit<32> reason) {
        drops.count(reason);
        mark_to_drop(standard_metadata);
    }

    apply {
        address.apply(hdr, meta, standard_metadata);
        if (meta.to_aggregator == 0) {
            l2.apply(hdr, meta, standard_metadata);
            return;
        }
        if (hdr.arp.isValid()) {
            return;    /* an ARP request for the aggregator: answered by address */
        }
        /* The checks in the software aggregator's order; the first failure is the drop reason. */
        validate.apply(hdr, meta, standard_metadata);
        if (meta.rejected == 0) {
            authenticate.apply(hdr, meta, standard_metadata);
        }
        if (meta.rejected == 0) {
            validate_payload.apply(hdr, meta, standard_metadata);
        }
        if (meta.rejected == 1) {
            drop_for(meta.drop_reason);
            return;
        }
        aggregate.apply(hdr, meta, standard_metadata);    /* sets meta.outcome */
        uplink.apply(hdr, meta, standard_metadata);       /* a leaf's outcomes */
        result.apply(hdr, meta, standard_metadata);       /* results, resends, absorbed packets */
    }
}

control MyEgress(inout headers_t hdr, inout metadata_t meta,
                 inout standard_metadata_t standard_metadata) {

    ResultDestination() result_destination;
    L2FloodPrune() flood_prune;

    apply {
        result_destination.apply(hdr, meta, standard_metadata);
        flood_prune.apply(hdr, meta, standard_metadata);
    }
}

V1Switch(MyParser(), MyVerifyChecksum(), MyIngress(), MyEgress(), MyComputeChecksum(), MyDeparser()) main;
