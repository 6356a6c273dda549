"""switchagg-testbed: an emulated rack on this host (root), for training and benchmarks.

    switchagg-testbed up -n 4 --rate 1gbit         # 4 workers, 1 Gbit/s links, software aggregator
    switchagg-testbed run -- python3 -c 'import os; print(os.environ["RANK"])'
    switchagg-testbed run -- torchrun --nnodes {n} --node-rank {rank} --nproc-per-node 1 \\
        --master-addr {master} --master-port 29500 examples/train_digits.py --backend switchagg
    switchagg-testbed status
    switchagg-testbed down
    switchagg-testbed up --racks 4,4 --rate 400mbit --uplink-rate 200mbit   # two levels: leaves, a spine

`up` builds the namespaces and links (switchagg_lab.testbed.rack) and starts the job service
(`switchagg-ctl serve`) in the switch namespace: with `--data-plane software` it serves jobs on its
software aggregator at 10.201.0.254, with `bmv2` it programs simple_switch_grpc. `run` starts the
command once per worker namespace, with RANK/WORLD_SIZE/MASTER_ADDR and the SWITCHAGG_* variables
that point the torch backend at the job service; {rank}, {n}, {ip} and {master} in the command are
replaced. `down` removes every namespace, link and process of the testbed, also after a crash.

With `--reducers M`, M reducer hosts (namespaces of their own, links capped like the workers') run a
software aggregator each, and the job service stripes every job across them (docs/TESTBED.md).

With `--racks`, the workers sit in racks behind leaf namespaces cabled to a spine namespace
(switchagg_lab.testbed.racks), worker links capped by `--rate` and uplinks by `--uplink-rate`; a
software aggregator runs in each leaf and in the spine, and the job service in the spine installs
two-level jobs on them through their control sockets (docs/CONTROLLER.md, Two levels in software).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from switchagg import protocol
from switchagg.cli_util import add_version, parse_rate, quiet_broken_pipe, silence_stdout
from switchagg_lab.testbed import netns, racks, tools
from switchagg_lab.testbed.rack import AGG_IP, DATA_PLANES, MAX_ENDPOINTS, MAX_REDUCERS, Testbed, remove
from switchagg_lab.testbed.racks import SPINE_IP, Racks
from switchagg_lab.testbed.reducer_hosts import start_reducer_service
from switchagg_lab.testbed.testbed_controller import (
    service_address,
    start_job_service,
    start_two_level_service,
    worker_env,
)

STATE_ROOT = Path(os.environ.get("SWITCHAGG_TESTBED_DIR", "/run/switchagg-testbed"))
NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class CliError(Exception):
    pass


def _dir(name: str) -> Path:
    return STATE_ROOT / name


def _prefix(name: str) -> str:
    return f"sat{name}-"


def ctl_env(name: str) -> dict[str, str]:
    """The variables that point switchagg-ctl (the admin secret) and a worker (the join secret) at
    the testbed's job service."""
    return {
        "SWITCHAGG_JOB_SERVICE": service_address(_dir(name)),
        "SWITCHAGG_SECRET_FILE": str(_dir(name) / "secret"),
        "SWITCHAGG_ADMIN_SECRET_FILE": str(_dir(name) / "admin.secret"),
    }


def ctl_lines(name: str) -> list[str]:
    """What to paste into a shell to reach the testbed's controller with switchagg-ctl."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in ctl_env(name).items())
    return [f"export {exports}", "switchagg-ctl jobs    # or top, counters, teardown JOB"]


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "n": sum(args.racks) if args.racks else args.workers,
        "data_plane": args.data_plane,
        "rate_mbit": args.rate,
        "mtu": args.mtu,
        "sw_k": args.sw_k,
        "sw_slots": args.sw_slots,
        "racks": args.racks,
        "uplink_rate_mbit": args.uplink_rate,
        "reducers": args.reducers,
    }


# The flag of each spec key, to say what a refused `up` asked for differently.
SPEC_FLAGS = {
    "n": "-n",
    "data_plane": "--data-plane",
    "rate_mbit": "--rate",
    "mtu": "--mtu",
    "sw_k": "--sw-k",
    "sw_slots": "--sw-slots",
    "racks": "--racks",
    "uplink_rate_mbit": "--uplink-rate",
    "reducers": "--reducers",
}


def _flag_value(key: str, value: Any) -> str:
    if value is None or value == 0 and key == "reducers":
        return "unset"
    if key == "data_plane":
        return "software" if value == "soft" else str(value)
    if isinstance(value, list):
        return ",".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def spec_difference(name: str, up: dict[str, Any], asked: dict[str, Any]) -> str:
    """One sentence: how the testbed that is up differs from the one asked for."""
    keys = [k for k in SPEC_FLAGS if up.get(k) != asked.get(k)]
    keys += sorted(k for k in set(up) | set(asked) if k not in SPEC_FLAGS and up.get(k) != asked.get(k))

    def flags(spec: dict[str, Any]) -> str:
        return ", ".join(f"{SPEC_FLAGS.get(k, k)} {_flag_value(k, spec.get(k))}" for k in keys)

    return (
        f"testbed {name} is up with {flags(up)}, not {flags(asked)}: "
        f"run `switchagg-testbed down --name {name}` first"
    )


def _bed(name: str, spec: dict[str, Any]) -> Testbed | Racks:
    if spec.get("racks"):
        return Racks(
            spec["racks"],
            worker_mbit=spec["rate_mbit"],
            uplink_mbit=spec["uplink_rate_mbit"],
            mtu=spec["mtu"] or 9000,
            prefix=_prefix(name),
        )
    return Testbed(
        spec["n"],
        _dir(name),
        data_plane=spec["data_plane"],
        rate_mbit=spec["rate_mbit"],
        mtu=spec["mtu"],
        prefix=_prefix(name),
        reducers=spec.get("reducers") or 0,
    )


def _load(name: str) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads((_dir(name) / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state


def _healthy(name: str, state: dict[str, Any]) -> bool:
    bed = _bed(name, state["spec"])
    pids = state.get("pids", {}).values()
    return bed.built() and all(netns.pid_alive(p) for p in pids)


def _check_tools(spec: dict[str, Any]) -> None:
    needed = ["ip", "tc"] + (["ethtool"] if spec["data_plane"] == "bmv2" else [])
    reason = tools.missing_for(needed, "switchagg-testbed")
    if reason is None and spec["data_plane"] == "bmv2":
        reason = tools.missing_bmv2()
    if reason:
        raise CliError(reason)
    try:
        import grpc  # noqa: F401

        import switchagg_controller  # noqa: F401
    except ImportError as e:
        raise CliError(
            f"the job service needs the controller: pip install 'switchagg[controller]' ({e})"
        ) from e


def cmd_up(args: argparse.Namespace) -> int:
    spec = _spec(args)
    if not 1 <= spec["n"] <= MAX_ENDPOINTS:
        raise CliError(f"-n must be within 1..{MAX_ENDPOINTS}")
    for key, flag in (("rate_mbit", "--rate"), ("uplink_rate_mbit", "--uplink-rate")):
        if spec[key] is not None and spec[key] <= 0:
            raise CliError(f"{flag} must be positive (Mbit/s)")
    if spec["racks"]:
        if spec["data_plane"] != "soft":
            raise CliError("--racks runs software leaves and spine: --data-plane software")
        if not 1 <= len(spec["racks"]) <= racks.MAX_RACKS:
            raise CliError(f"--racks names 1..{racks.MAX_RACKS} racks")
    elif spec["uplink_rate_mbit"] is not None:
        raise CliError("--uplink-rate needs --racks")
    if spec["reducers"]:
        if spec["racks"] or spec["data_plane"] != "soft":
            raise CliError(
                "--reducers puts reducer hosts beside one software rack: no --racks, --data-plane software"
            )
        if not 1 <= spec["reducers"] <= MAX_REDUCERS:
            raise CliError(f"--reducers must be within 1..{MAX_REDUCERS}")
    _check_tools(spec)
    state = _load(args.name)
    if state is not None and _healthy(args.name, state):
        if state["spec"] == spec:
            print(f"testbed {args.name} is up already (nothing changed)")
            return 0
        raise CliError(spec_difference(args.name, state["spec"], spec))
    _down(args.name)  # whatever a crashed or half-built run left
    workdir = _dir(args.name)
    workdir.mkdir(parents=True, exist_ok=True)
    bed = _bed(args.name, spec)
    try:
        bed.start()
        if isinstance(bed, Racks):
            pids = start_two_level_service(bed, workdir, spec["sw_k"], spec["sw_slots"])
        elif bed.reducer_hosts:
            pids = start_reducer_service(bed, workdir, spec["sw_k"], spec["sw_slots"])
        else:
            pids = {"service": start_job_service(bed, workdir, spec["sw_k"], spec["sw_slots"]).pid}
            if bed.switch is not None and bed.switch.pid:
                pids["bmv2"] = bed.switch.pid
    except BaseException:
        _down(args.name)
        raise
    state = {"spec": spec, "prefix": bed.prefix, "pids": pids, "created": time.time()}
    (workdir / "state.json").write_text(json.dumps(state, indent=1))
    rate = f"{spec['rate_mbit']:g} Mbit/s" if spec["rate_mbit"] else "uncapped"
    workers = ", ".join(e.ip for e in bed.endpoints)
    if isinstance(bed, Racks):
        uplinks = f"{spec['uplink_rate_mbit']:g} Mbit/s" if spec["uplink_rate_mbit"] else "uncapped"
        where = (
            f"racks {spec['racks']}, leaves at {', '.join(leaf.worker_ip for leaf in bed.leaves)}, "
            f"spine at {SPINE_IP}, worker links {rate}, uplinks {uplinks}"
        )
    else:
        where = f"{_plane_name(spec)} data plane at {AGG_IP}, links {rate}"
        if bed.reducer_hosts:
            where += (
                f", {len(bed.reducer_hosts)} reducer hosts ({', '.join(e.ip for e in bed.reducer_hosts)})"
            )
    print(
        f"testbed {args.name}: {spec['n']} workers ({workers}), {where}, MTU {bed.mtu}; "
        f"job service unix:{workdir / 'jobs.sock'}; switchagg-ctl reaches it with:"
    )
    print("\n".join(f"  {line}" for line in ctl_lines(args.name)))
    return 0


def _down(name: str) -> list[str]:
    state = _load(name)
    for pid in (state or {}).get("pids", {}).values():
        if netns.pid_alive(pid) and _group_leader(pid):  # started in a session of its own by `up`
            os.killpg(pid, signal.SIGKILL)
    gone = remove(_prefix(name)) + racks.remove(_prefix(name))
    shutil.rmtree(_dir(name), ignore_errors=True)
    return gone


def _group_leader(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def cmd_down(args: argparse.Namespace) -> int:
    gone = _down(args.name)
    print(f"testbed {args.name}: removed {len(gone)} namespaces and links" if gone else "nothing to remove")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = _load(args.name)
    if state is None:
        leftovers = [n for n in netns.namespaces() if n.startswith(_prefix(args.name))]
        msg = f"testbed {args.name} is down" + (
            f" (leftovers: {', '.join(leftovers)}; run down)" if leftovers else ""
        )
        if args.json:
            print(json.dumps({"name": args.name, "up": False, "leftovers": leftovers}))
        else:
            print(msg)
        return 1
    bed = _bed(args.name, state["spec"])
    built = bed.built()
    processes = {k: netns.pid_alive(p) for k, p in state["pids"].items()}
    report = {
        "name": args.name,
        "up": built and all(processes.values()),
        "spec": state["spec"],
        "processes": processes,
        "service": service_address(_dir(args.name)),
        "ctl_env": ctl_env(args.name),
        "links": bed.link_stats() if built else [],
    }
    if args.json:
        print(json.dumps(report))
        return 0 if report["up"] else 1
    spec = state["spec"]
    rate = f"{spec['rate_mbit']:g} Mbit/s" if spec["rate_mbit"] else "uncapped"
    print(f"testbed {args.name}: {'up' if report['up'] else 'BROKEN (run down, then up)'}")
    print(f"  {spec['n']} workers, {_plane_name(spec)} data plane, links {rate}")
    print(
        "  processes: "
        + ", ".join(f"{k} {'running' if v else 'GONE'}" for k, v in report["processes"].items())
    )
    print(f"  job service: {report['service']}; switchagg-ctl reaches it with:")
    print("\n".join(f"    {line}" for line in ctl_lines(args.name)))
    names = [(f"h{e.index}", e.ip) for e in bed.endpoints]
    if isinstance(bed, Racks):
        names += [(f"up{leaf.index}", f"rack{leaf.index}") for leaf in bed.leaves]
    for (label, where), link in zip(names, report["links"], strict=False):
        up, down = link["up"], link["down"]
        print(
            f"  {label:<4} {where:<12} up {up['bytes'] / 1e6:10.1f} MB ({up['dropped']} dropped)"
            f"  down {down['bytes'] / 1e6:10.1f} MB ({down['dropped']} dropped)"
        )
    return 0 if report["up"] else 1


def _substitute(argv: Sequence[str], values: dict[str, str]) -> list[str]:
    out = []
    for a in argv:
        for key, value in values.items():
            a = a.replace("{" + key + "}", value)
        out.append(a)
    return out


def cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("run needs a command: switchagg-testbed run -- CMD ...")
    state = _load(args.name)
    if state is None or not _healthy(args.name, state):
        raise CliError(f"testbed {args.name} is not up: switchagg-testbed up first")
    bed = _bed(args.name, state["spec"])
    workdir = _dir(args.name)
    procs: list[subprocess.Popen[str]] = []
    for e in bed.endpoints:
        env = {**os.environ, **worker_env(bed.endpoints, e.index, workdir, args.master_port)}
        values = {"rank": str(e.index), "n": str(bed.n), "ip": e.ip, "master": bed.endpoints[0].ip}
        procs.append(
            e.popen(
                _substitute(command, values),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
    lock = threading.Lock()

    def relay(rank: int, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:  # read to the end, also once stdout is gone: the ranks must not block
            with lock:
                try:
                    sys.stdout.write(f"[h{rank}] {line}")
                    sys.stdout.flush()
                except BrokenPipeError:  # the reader went away (| head): the ranks run on
                    silence_stdout()

    relays = [threading.Thread(target=relay, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in relays:
        t.start()
    code = _wait_all(procs, args.timeout, args.grace)
    for t in relays:
        t.join(timeout=5)
    return code


def _wait_all(procs: list[subprocess.Popen[str]], timeout: float, grace: float) -> int:
    """Waits for every rank; after a rank fails, the others get ``grace`` seconds to fail on
    their own (their timeouts), then they are killed. Returns the first non-zero exit code."""
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    code = 0
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed and first_failure is None:
                first_failure, code = now, failed[0]
            if now > deadline or (first_failure is not None and now > first_failure + grace):
                why = "timed out" if now > deadline else f"a rank failed {grace:.0f} s ago"
                print(f"switchagg-testbed: {why}: killing the remaining ranks", file=sys.stderr)
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
                code = code or 124
    return code or next((p.returncode for p in procs if p.returncode), 0)


def _racks(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--racks {text!r}: expected workers per rack, e.g. 4,4") from None
    if not all(1 <= c <= 32 for c in counts) or sum(counts) > MAX_ENDPOINTS:
        raise argparse.ArgumentTypeError(f"--racks {text!r}: 1..32 workers per rack, {MAX_ENDPOINTS} in all")
    return counts


def _data_plane(text: str) -> str:
    """``software`` (the name switchagg-ctl serve --software and the job service use) or ``bmv2``;
    ``soft``, the former name, still accepted. The spec (state.json) keeps ``soft``."""
    if text in ("software", "soft"):
        return "soft"
    if text in DATA_PLANES:
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: choose software or bmv2")


def _plane_name(spec: dict[str, Any]) -> str:
    return "software" if spec["data_plane"] == "soft" else str(spec["data_plane"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="switchagg-testbed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="cmd", required=True)

    def named(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--name", default="sa", help="testbed name, [a-z][a-z0-9]{0,7} (default %(default)s)")
        return p

    p = named(sub.add_parser("up", help="build the testbed and start its job service (idempotent)"))
    p.add_argument("-n", "--workers", type=int, default=4, help="worker namespaces (default %(default)s)")
    p.add_argument(
        "--data-plane",
        type=_data_plane,
        default="soft",
        metavar="{software,bmv2}",
        help="the switch: the software aggregator (as switchagg-ctl serve --software) or bmv2 "
        "(default software)",
    )
    p.add_argument(
        "--rate",
        type=parse_rate,
        metavar="RATE",
        help="cap every (worker) link each way (tbf): Mbit/s, or tc's units: 1gbit, 200mbit, 500kbit",
    )
    p.add_argument(
        "--racks", type=_racks, metavar="N,N,...", help="workers per rack: leaves behind a spine (two levels)"
    )
    p.add_argument(
        "--uplink-rate",
        type=parse_rate,
        metavar="RATE",
        help="with --racks: cap each leaf's uplink (as --rate)",
    )
    p.add_argument(
        "--reducers",
        type=int,
        default=0,
        metavar="M",
        help="M reducer hosts (software aggregators in namespaces of their own, links capped as the "
        "workers'): jobs are striped across them (SWITCHAGG_SHARDS=0 runs one on the switch)",
    )
    p.add_argument("--mtu", type=int, help="link MTU (default 9000 software, 1500 bmv2)")
    p.add_argument("--sw-k", type=int, default=protocol.DEFAULT_SW_K, help="K of the software aggregator")
    p.add_argument("--sw-slots", type=int, default=protocol.DEFAULT_SW_SLOTS, help="slots per software job")
    p.set_defaults(func=cmd_up)

    p = named(sub.add_parser("run", help="run a command in every worker namespace"))
    p.add_argument("--timeout", type=float, default=3600, help="kill every rank after this (s)")
    p.add_argument("--grace", type=float, default=30, help="after a rank fails, kill the rest after (s)")
    p.add_argument("--master-port", type=int, default=29500, help="MASTER_PORT (default %(default)s)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    p.set_defaults(func=cmd_run)

    p = named(sub.add_parser("status", help="what is up, and the bytes each link carried"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = named(sub.add_parser("down", help="remove every namespace, link and process of the testbed"))
    p.set_defaults(func=cmd_down)
    return parser


@quiet_broken_pipe
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not NAME.match(args.name):
        print(f"switchagg-testbed: --name {args.name!r} must match {NAME.pattern}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("switchagg-testbed: needs root (network namespaces and veth pairs)", file=sys.stderr)
        return 2
    try:
        code: int = args.func(args)
    except (CliError, netns.TestbedError, ValueError) as e:
        print(f"switchagg-testbed: {e}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
