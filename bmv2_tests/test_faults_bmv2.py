"""Malformed and spoofed packets are dropped, counted by reason, and change no slot state,
while another job keeps allreducing exactly through the same switch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from switchagg import protocol
from switchagg.protocol import Header
from switchagg_controller import p4_program
from switchagg_lab.bmv2.frames import Wire, counters, data_frame, delta, result_port
from switchagg_lab.bmv2.run import check_results, finish, start_job
from switchagg_lab.bmv2.switch_jobs import make_job

REPEAT = 3  # copies of each bad packet


def _slot_state(bed: Any, slot: int) -> dict[str, list[int]]:
    sets = [2 * slot, 2 * slot + 1]
    return {
        "set_gen": bed.registers("MyIngress.set_gen", sets),
        "set_inc": bed.registers("MyIngress.set_inc", sets),
        "bitmap": bed.registers("MyIngress.bitmap", sets),
        "count": bed.registers("MyIngress.count", sets),
        "max_exp": bed.registers("MyIngress.max_exp", sets),
        "values": bed.registers("MyIngress.values", [s * 64 + i for s in sets for i in (0, 1, 31, 63)]),
    }


def _lying_udp_length(e: Any, payload: bytes) -> bytes:
    """A frame whose UDP length claims a full packet but whose bytes end early (parser runs out)."""
    frame = Ether(data_frame(e, payload))
    frame[UDP].len = 8 + protocol.packet_len(protocol.P4_K)
    frame[IP].len = 20 + frame[UDP].len
    del frame[UDP].chksum
    return bytes(frame)


def _bad_frames(
    e: Any, pkt: Callable[..., bytes], full: bytes, running: Any
) -> dict[str, list[tuple[int, bytes]]]:
    """Drop reason -> the (sending endpoint, frame) pairs that must be dropped for it: rank 1's
    DATA of the idle job (``full``) altered one way each."""
    # reason -> (sending endpoint, frame)
    bad: dict[str, list[tuple[int, bytes]]] = {
        "bad_version": [(3, data_frame(e[3], pkt(rank=1, version=1)))],
        "bad_type": [
            (3, data_frame(e[3], pkt(rank=1, type=protocol.MSG_RESULT))),
            (3, data_frame(e[3], pkt(rank=1, flags=protocol.FLAG_FLOAT | protocol.LANE_FLAGS))),  # no width
        ],
        "unknown_job": [(3, data_frame(e[3], pkt(rank=1, job=999)))],
        "bad_rank": [(3, data_frame(e[3], pkt(rank=2)))],
        "spoofed": [
            (5, data_frame(e[5], full)),  # rank 1 of the idle job from a foreign port
            (5, data_frame(e[5], full, src_ip=e[3].ip)),  # ... even with rank 1's source address
            (
                3,
                data_frame(e[3], full, sport=result_port(e[3]) + 1000),
            ),  # rank 1's port, another UDP port
            (2, data_frame(e[2], full)),  # rank 0's port claiming rank 1
            (
                5,
                data_frame(e[5], pkt(job=running.job_id, slot=running.slot_base)),
            ),  # into the running job
        ],
        "bad_pool": [
            (3, data_frame(e[3], pkt(rank=1, slot=running.slot_base))),
            (3, data_frame(e[3], pkt(rank=1, slot=5))),
        ],
        "truncated": [
            (3, data_frame(e[3], full[:10])),
            (3, data_frame(e[3], full[:-4])),
            (3, data_frame(e[3], full + b"\0" * 4)),
            (3, data_frame(e[3], pkt(rank=1, elems=63))),
            (3, _lying_udp_length(e[3], full[:100])),
        ],
    }
    return bad


def test_bad_packets_dropped_counted_and_harmless(bed: Any, switch: Any, tmp_path: Path) -> None:
    e = bed.endpoints
    running = make_job(41, e[0:2], slot_base=300, slot_count=8, counter_index=5)
    idle = make_job(42, e[2:4], slot_base=320, slot_count=2, counter_index=6)
    switch.apply(p4_program.desired_state(bed.topology(), [running, idle]))
    tensors = [("int32", 2048)] * 12
    wire = Wire(e[2:6])
    try:
        wire.drain()
        procs = start_job(running, e[0:2], tensors, tmp_path, seed=9)
        slot = idle.slot_base
        ones = [1] * 64

        def pkt(**kw: Any) -> bytes:
            fields: dict[str, Any] = {"job": idle.job_id, "rank": 0, "slot": slot, "values": ones, **kw}
            return Header(**fields).pack()

        # A half-finished round on the idle job: rank 0's contribution sits in the slot.
        cap = wire.exchange(2, [data_frame(e[2], pkt(values=list(range(64))))])
        assert cap.results(2) == [] and cap.results(3) == []
        state = _slot_state(bed, slot)
        assert state["count"][0] == 1 and state["bitmap"][0] == 1

        full = pkt(rank=1)
        bad = _bad_frames(e, pkt, full, running)
        before = counters(switch, {idle.job_id: idle.counter_index})
        for frames in bad.values():
            for sender, f in frames:
                cap = wire.exchange(sender, [f] * REPEAT)
                assert all(cap.results(i) == [] for i in range(2, 6)), "a bad packet produced a result"
        drops, jobs = delta(before, counters(switch, {idle.job_id: idle.counter_index}))
        assert drops == {reason: REPEAT * len(bad.get(reason, [])) for reason in protocol.DROP_REASONS}
        assert jobs[idle.job_id] == dict.fromkeys(protocol.JOB_COUNTERS, 0)
        assert _slot_state(bed, slot) == state, "a dropped packet changed the slot's registers"

        # The genuine rank 1 completes the round with exactly rank 0 + rank 1.
        cap = wire.exchange(3, [data_frame(e[3], full)])
        want = Header(
            job=idle.job_id,
            rank=0,
            slot=slot,
            type=protocol.MSG_RESULT,
            elems=64,
            values=[v + 1 for v in range(64)],
        )
        assert cap.results(2) == [want.pack()]
        want.rank = 1
        assert cap.results(3) == [want.pack()]
        finish(procs)
        check_results(running, tensors, tmp_path, seed=9)
    finally:
        wire.close()
