"""Packets per second through bmv2: the aggregation path vs plain L2 forwarding, same switch, same run.

Both measurements use the one simple_switch_grpc running p4/switchagg.p4 in the namespace
testbed of bmv2_tests (so: root, bmv2, a compiled program). Two endpoints each blast a bounded
number of frames (326 bytes) as fast as Python can send them; bmv2 is the bottleneck and drops the
excess at its input, and the rate is what comes out the other side, measured at the receivers
from first to last frame:

* L2: UDP frames to the other endpoint's MAC (not to the aggregator), forwarded by l2_forward;
  the rate counts both directions.
* aggregation: DATA packets of a 2-worker job, each (slot, set) of the pool used once per pass,
  a fresh generation per pass; the rate is the DATA the switch aggregated (its `aggregated`
  counter) over the time its results were coming out.

Prints a table and one JSON line. Bounded: --frames per endpoint per run, --timeout per run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from switchagg import protocol
from switchagg_controller import p4_program
from switchagg_controller.switch_session import SwitchSession
from switchagg_lab.bmv2.frames import RESULT_PORT_BASE, counters, data_frame
from switchagg_lab.bmv2.switch_jobs import make_job
from switchagg_lab.testbed import Endpoint, Testbed
from switchagg_lab.testbed.tools import find_tool, missing_for_switch, tool_env
from switchagg_lab.testing.progress import Steps

ROOT = Path(__file__).resolve().parents[1]

FRAME_LEN = 14 + 20 + 8 + protocol.packet_len(protocol.P4_K)  # both kinds (tests/test_docs.py)


class Receiver(threading.Thread):
    """Counts frames matching a UDP port on one endpoint until ``expected`` or the deadline."""

    def __init__(self, e: Endpoint, udp_dport: int, expected: int, deadline: float) -> None:
        super().__init__(daemon=True)
        self.sock = e.raw_socket()
        self.sock.settimeout(0.5)
        self.dport, self.expected, self.deadline = udp_dport, expected, deadline
        self.count, self.first, self.last = 0, 0.0, 0.0

    def run(self) -> None:
        while self.count < self.expected and time.monotonic() < self.deadline:
            try:
                data, addr = self.sock.recvfrom(65535)
            except TimeoutError:
                if self.count and time.monotonic() - self.last > 2.0:
                    break  # the switch has drained: the rest was dropped at its input
                continue
            if addr[2] == 4 or len(data) < 42 or int.from_bytes(data[36:38], "big") != self.dport:
                continue  # outgoing, or not the measured stream
            now = time.monotonic()
            if not self.count:
                self.first = now
            self.count, self.last = self.count + 1, now
        self.sock.close()


def _blast(e: Endpoint, frames: list[bytes]) -> None:
    s = e.raw_socket()
    try:
        for f in frames:
            s.send(f)
    finally:
        s.close()


def _run(senders: list[tuple[Endpoint, list[bytes]]], *receivers: Receiver) -> None:
    for r in receivers:
        r.start()
    threads = [threading.Thread(target=_blast, args=(e, fs), daemon=True) for e, fs in senders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for r in receivers:
        r.join(timeout=max(1.0, r.deadline - time.monotonic() + 1))


def measure_l2(a: Endpoint, b: Endpoint, frames: int, timeout: float) -> float:
    port = 9999
    pad = FRAME_LEN - 42

    def frame(src: Endpoint, dst: Endpoint) -> bytes:
        return bytes(
            Ether(src=src.mac, dst=dst.mac)
            / IP(src=src.ip, dst=dst.ip)
            / UDP(sport=port, dport=port)
            / Raw(b"\0" * pad)
        )

    deadline = time.monotonic() + timeout
    to_a, to_b = Receiver(a, port, frames, deadline), Receiver(b, port, frames, deadline)
    # Both directions at once, as the two workers load the switch; the rate counts both.
    _run([(a, [frame(a, b)] * frames), (b, [frame(b, a)] * frames)], to_a, to_b)
    got = [r for r in (to_a, to_b) if r.count]
    if not got:
        return 0.0
    window = max(r.last for r in got) - min(r.first for r in got)
    return (sum(r.count for r in got) - 1) / window if window > 0 else 0.0


def measure_agg(bed: Testbed, switch: SwitchSession, frames: int, timeout: float) -> float:
    a, b = bed.endpoints[0], bed.endpoints[1]
    pool = 2 * protocol.P4_NUM_SLOTS  # (slot, set) pairs: one use each per pass
    per_rank: dict[int, list[bytes]] = {0: [], 1: []}
    values = list(range(protocol.P4_K))
    passes = -(-frames // pool)
    for _ in range(passes):
        for i in range(min(pool, frames - len(per_rank[0]))):
            for rank, e in ((0, a), (1, b)):
                h = protocol.Header(
                    job=61, rank=rank, slot=i // 2, shadow=i % 2, offset=i * 64, values=values
                )
                per_rank[rank].append(data_frame(e, h.pack()))
    # Passes reuse slots, so each needs its own generation: install, blast, reinstall.
    processed, seconds = 0, 0.0
    for p in range(passes):
        job = make_job(61, [a, b], slot_base=0, slot_count=protocol.P4_NUM_SLOTS, counter_index=0)
        switch.apply(p4_program.desired_state(bed.topology(), [job]))
        chunk = slice(p * pool, (p + 1) * pool)
        n = len(per_rank[0][chunk])
        before = counters(switch, {job.job_id: 0})[1][job.job_id]["aggregated"]
        rx = Receiver(a, RESULT_PORT_BASE + a.index, n, time.monotonic() + timeout)
        _run([(a, per_rank[0][chunk]), (b, per_rank[1][chunk])], rx)
        # DATA the pipeline aggregated (bmv2 drops the excess at its input, so fewer than sent),
        # over the time results were coming out.
        if rx.count > 1:
            processed += counters(switch, {job.job_id: 0})[1][job.job_id]["aggregated"] - before
            seconds += rx.last - rx.first
    return processed / seconds if seconds else 0.0


def bmv2_version() -> str:
    binary = find_tool("simple_switch_grpc")
    if binary is None:
        return "?"
    p = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, env=tool_env())
    return (p.stdout or p.stderr).strip().splitlines()[0] if (p.stdout or p.stderr).strip() else "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--frames", type=int, default=6000, help="frames per endpoint per measurement (max 200000)"
    )
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per measurement at most")
    ap.add_argument("--repeat", type=int, default=2, help="measurements of each kind (best is reported)")
    args = ap.parse_args()
    if not 1 <= args.frames <= 200_000 or not 1 <= args.repeat <= 10 or not 0 < args.timeout <= 600:
        ap.error("--frames must be 1..200000, --repeat 1..10, --timeout 0..600 s")
    reason = missing_for_switch()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp, Testbed(2, Path(tmp)) as bed:
        switch = SwitchSession(
            bed.grpc_address, bed.device_id, p4_program.P4INFO, p4_program.BMV2_JSON, force_pipeline=True
        ).open()
        try:
            switch.apply(p4_program.desired_state(bed.topology(), []))
            l2, agg = [], []
            progress = Steps(2 * args.repeat)
            for i in range(args.repeat):  # alternate, so drift on a shared machine hits both alike
                progress.step(f"L2 forwarding, run {i + 1} of {args.repeat}")
                l2.append(measure_l2(bed.endpoints[0], bed.endpoints[1], args.frames, args.timeout))
                progress.step(f"aggregation, run {i + 1} of {args.repeat}")
                agg.append(measure_agg(bed, switch, args.frames, args.timeout))
        finally:
            switch.close()
    best_l2, best_agg = max(l2), max(agg)
    ratio = best_agg / best_l2 if best_l2 else 0.0
    print(f"bmv2: {bmv2_version()}   frame: {FRAME_LEN} bytes   frames/endpoint/run: {args.frames}")
    print(f"{'path':<14}{'best pps':>12}   runs")
    print(f"{'L2 forward':<14}{best_l2:>12.0f}   {', '.join(f'{x:.0f}' for x in l2)}")
    print(f"{'aggregation':<14}{best_agg:>12.0f}   {', '.join(f'{x:.0f}' for x in agg)}")
    print(
        f"aggregation / L2 = {ratio:.3f}   "
        f"({best_agg * protocol.P4_K / 2:.0f} summed int32 elements/s per worker)"
    )
    print(
        json.dumps(
            {
                "bench": "bmv2",
                "bmv2": bmv2_version(),
                "frame_bytes": FRAME_LEN,
                "frames": args.frames,
                "l2_pps": round(best_l2),
                "agg_pps": round(best_agg),
                "ratio": round(ratio, 4),
                "l2_runs": [round(x) for x in l2],
                "agg_runs": [round(x) for x in agg],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
