"""Kill-to-reprogrammed: how long a restarted bmv2 stays without the controller's state.

A real `switchagg-ctl serve --topology` manages one bmv2 of a namespace testbed (so: root, bmv2,
a compiled program); each round kills the switch, starts it again (empty: no pipeline, no
entries) and measures from the kill until a read-only P4Runtime reader sees the controller's
table entries back. Prints one line per round and one JSON line. Bounded: --rounds, and each
round gives up after --timeout seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from switchagg_lab.testbed import Testbed
from switchagg_lab.testbed.tools import missing_for_switch
from switchagg_lab.testing.controller import Controller

ROOT = Path(__file__).resolve().parents[1]


def programmed(address: str) -> bool:
    from switchagg_controller import p4_program
    from switchagg_controller.p4rt import P4RuntimeError
    from switchagg_controller.switch_session import SwitchSession

    try:
        with SwitchSession(address, 0, p4_program.P4INFO, primary=False, timeout=10) as s:
            return bool(s.read_table_entries())
    except (P4RuntimeError, TimeoutError):
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=120.0, help="longest wait per round (s)")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds between rounds")
    args = parser.parse_args()
    reason = missing_for_switch()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    from switchagg_controller.topology import dump_topology

    tmp = Path(tempfile.mkdtemp(prefix="switchagg-reconnect-"))
    seconds = []
    with Testbed(2, tmp / "bed", subnet="10.215.0.") as bed:
        assert bed.switch is not None
        topo = tmp / "topology.yaml"
        topo.write_text(dump_topology(bed.topology()))
        ctl = Controller(tmp, ["--topology", str(topo)]).start(listen=f"unix:{tmp}/jobs.sock")
        try:
            if not programmed(bed.grpc_address):
                print("the controller did not program the switch", file=sys.stderr)
                return 1
            for _ in range(args.rounds):
                start = time.monotonic()
                bed.switch.kill()
                bed.switch.start()
                back = time.monotonic() - start  # bmv2 answers again (empty)
                while not programmed(bed.grpc_address):
                    if time.monotonic() - start > args.timeout:
                        print(f"not reprogrammed within {args.timeout:g} s", file=sys.stderr)
                        return 1
                    time.sleep(0.05)
                seconds.append(time.monotonic() - start)
                print(f"kill -> reprogrammed: {seconds[-1]:.2f} s (bmv2 back after {back:.2f} s)", flush=True)
                time.sleep(args.pause)
        finally:
            ctl.stop()
    print(json.dumps({"kill_to_reprogrammed_s": [round(s, 3) for s in seconds]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
