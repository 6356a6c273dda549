"""switchagg-ctl: run the controller (job service + data plane) and inspect or steer it.

switchagg-ctl serve --software --secret-file s.txt --state ctl.db --listen 127.0.0.1:50051
switchagg-ctl serve ... --metrics-port 9400 [--metrics-host 0.0.0.0]
switchagg-ctl serve --topology topo.yaml --secret-file s.txt --state ctl.db [--fallback]
switchagg-ctl push --topology topo.yaml
switchagg-ctl jobs --service 127.0.0.1:50051 --admin-secret-file ctl.db.admin-secret
switchagg-ctl counters --service 127.0.0.1:50051 --admin-secret-file A [--interval 2] [--count N]
switchagg-ctl top --service 127.0.0.1:50051 --admin-secret-file A [--interval 2] [--count N | --once] [--json]
switchagg-ctl teardown JOB --service 127.0.0.1:50051 --admin-secret-file A

The join secret (--secret-file) lets workers join; the client commands, an operator's, need the
admin secret, which serve writes to STATE.admin-secret (mode 0600) unless given --admin-secret-file.
They take --service, --admin-secret and --admin-secret-file from $SWITCHAGG_JOB_SERVICE,
$SWITCHAGG_ADMIN_SECRET and $SWITCHAGG_ADMIN_SECRET_FILE when not given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from switchagg import protocol
from switchagg._proto import jobs_pb2, jobs_pb2_grpc
from switchagg.cli_util import add_renamed, add_version, quiet_broken_pipe, stdout_closed

if TYPE_CHECKING:
    from switchagg_controller.app import ControllerConfig


DEFAULT_SERVICE = "127.0.0.1:50051"
DEFAULT_INTERVAL = 2.0  # seconds between rounds: counters --count, top


class CliError(Exception):
    pass


def _read_secret_file(path: str, what: str) -> str:
    try:
        secret = Path(path).read_text().strip()
    except OSError as e:
        raise CliError(f"cannot read the secret file {what}: {e.strerror}") from None
    if not secret:
        raise CliError(f"the secret file {what} is empty")
    return secret


def _find_secret(path: str | None, value: str | None, env: str) -> str | None:
    """The flags, else the variables (the workers' order for the join secret,
    host/switchagg/torch/dataplane.py): $ENV, then $ENV_FILE; None if none is set."""
    if path:
        return _read_secret_file(path, path)
    if value:
        return value
    if os.environ.get(env):
        return os.environ[env]
    file_env = f"{env}_FILE"
    if os.environ.get(file_env):
        return _read_secret_file(os.environ[file_env], f"{file_env}={os.environ[file_env]}")
    return None


def _secret(args: argparse.Namespace) -> str:
    """The join secret."""
    secret = _find_secret(args.secret_file, args.secret, "SWITCHAGG_SECRET")
    if secret is None:
        raise CliError(
            "a secret is needed: --secret-file or --secret, or $SWITCHAGG_SECRET_FILE or $SWITCHAGG_SECRET"
        )
    return secret


def _admin_secret(args: argparse.Namespace) -> str:
    """The admin secret of a client command."""
    secret = _find_secret(args.admin_secret_file, args.admin_secret, "SWITCHAGG_ADMIN_SECRET")
    if secret is None or args.secret or args.secret_file:
        join = "--secret-file/--secret is the join secret, which no longer lists, counts or tears down jobs: "
        raise CliError(
            (join if args.secret or args.secret_file else "")
            + f"{args.command} needs the admin secret: --admin-secret-file or --admin-secret, or "
            "$SWITCHAGG_ADMIN_SECRET_FILE or $SWITCHAGG_ADMIN_SECRET (serve keeps it in "
            "STATE.admin-secret unless given one)"
        )
    return secret


def _add_secret(p: argparse.ArgumentParser, admin: bool = False) -> None:
    """--secret and --secret-file (admin: --admin-secret and --admin-secret-file)."""
    prefix, env, what = ("admin-", "ADMIN_", "the admin secret") if admin else ("", "", "the join secret")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        f"--{prefix}secret",
        metavar="SECRET",
        help=f"{what} (visible in ps: prefer --{prefix}secret-file; default $SWITCHAGG_{env}SECRET)",
    )
    g.add_argument(
        f"--{prefix}secret-file",
        metavar="FILE",
        help=f"file holding {what} (default $SWITCHAGG_{env}SECRET_FILE)",
    )


def _add_client(p: argparse.ArgumentParser) -> None:
    """An operator's command: the job service's address and the admin secret."""
    p.add_argument(
        "--service",
        default=os.environ.get("SWITCHAGG_JOB_SERVICE") or DEFAULT_SERVICE,
        help="job service address, host:port or unix:/path "
        f"(default $SWITCHAGG_JOB_SERVICE, else {DEFAULT_SERVICE})",
    )
    _add_secret(p, admin=True)
    for flag in ("--secret", "--secret-file"):  # the join secret: refused, with what to use instead
        p.add_argument(flag, help=argparse.SUPPRESS)


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (one object per line) for scripts")


def _add_repeat(p: argparse.ArgumentParser, what: str, once: bool) -> tuple[argparse.Action, argparse.Action]:
    """The one spelling of "again and again" (counters, top): --interval SECONDS, --count N."""
    interval = p.add_argument(
        "--interval",
        type=float,
        default=None if once else DEFAULT_INTERVAL,
        metavar="SECONDS",
        help=f"repeat every SECONDS (default: once; with --count: {DEFAULT_INTERVAL:g})"
        if once
        else "seconds between reads (default %(default)s)",
    )
    count = p.add_argument(
        "--count",
        type=int,
        default=0,
        metavar="N",
        help=f"stop after N {what} (default 0: {'with --interval, ' if once else ''}until interrupted)",
    )
    return interval, count


def _add_p4(p: argparse.ArgumentParser) -> None:
    p.add_argument("--p4-json", type=Path, help="bmv2 JSON (default: the installed p4/build/switchagg.json)")
    p.add_argument(
        "--p4info",
        type=Path,
        help="P4Info text or binary (default: the installed p4/build/switchagg.p4info.txtpb)",
    )


def _p4_artifacts(args: argparse.Namespace) -> tuple[Path, Path]:
    from switchagg_controller.app import p4_artifacts

    return p4_artifacts(args.p4_json, args.p4info)


# -- serve ------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from switchagg_controller.app import ControllerConfig

    config = ControllerConfig(
        secret=_secret(args),
        admin_secret=_find_secret(args.admin_secret_file, args.admin_secret, "SWITCHAGG_ADMIN_SECRET") or "",
        **{name: getattr(args, name) for name in SERVE_FLAGS},
    )
    return asyncio.run(_serve_on_loop(config))


# The serve flags that are ControllerConfig fields, by the same names.
SERVE_FLAGS = (
    "state", "listen", "topology", "two_level", "reducers", "software", "fallback", "software_listen",
    "software_advertise", "p4_json", "p4info", "p4_slots", "sw_k", "sw_slots", "switch_wait",
    "join_timeout", "reap_timeout", "metrics_port", "metrics_host", "max_jobs_per_client",
    "max_slots_per_client", "max_pending_joins",
)  # fmt: skip


async def _serve_on_loop(config: ControllerConfig) -> int:
    """The controller until SIGTERM or SIGINT."""
    from switchagg_controller.app import Controller

    controller = Controller(config)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    try:
        print(await controller.start(), flush=True)
        await stopped.wait()
    finally:
        await controller.stop()
    return 0


# -- client commands --------------------------------------------------------------------------


def _stub(args: argparse.Namespace) -> tuple[jobs_pb2_grpc.JobServiceStub, grpc.Channel]:
    channel = grpc.insecure_channel(args.service)
    return jobs_pb2_grpc.JobServiceStub(channel), channel


def _rpc(args: argparse.Namespace, method: str, request: object) -> object:
    stub, channel = _stub(args)
    try:
        return getattr(stub, method)(request, timeout=args.timeout)
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.Call) else None
        details = e.details() if isinstance(e, grpc.Call) else str(e)
        raise CliError(f"{method} on {args.service}: {details} ({code.name if code else 'error'})") from None
    finally:
        channel.close()


def format_jobs(reply: jobs_pb2.ListJobsReply) -> str:
    if not reply.jobs:
        return "no jobs"
    head = f"{'id':>5} {'name':<18} {'state':<8} {'plane':<9} {'n':>3} {'slots':>13} {'K':>5} {'gen':>5}"
    lines = [head + "  workers"]
    for j in reply.jobs:
        slots = f"{j.slot_base}..{j.slot_base + j.slot_count - 1}" if j.state == "active" else "-"
        workers = " ".join(
            f"{w.rank}={w.ip}:{w.udp_port}{'(left)' if w.left else ''}"
            if j.state == "active"
            else f"{w.ip}:{w.udp_port}"
            for w in j.workers
        )
        lines.append(
            f"{j.job_id or '-':>5} {j.name:<18} {j.state:<8} {j.data_plane or '-':<9} {j.world_size:>3} "
            f"{slots:>13} {j.k or '-':>5} {j.generation or '-':>5}  {workers}"
        )
        for s in j.shards:  # a striped job: one line per shard, under its job
            lines.append(
                f"{'':>5}   shard {s.index}: {s.node} {s.aggregator_ip}:{s.aggregator_port} "
                f"slots {s.slot_base}..{s.slot_base + s.slot_count - 1}"
            )
    return "\n".join(lines)


def jobs_json(reply: jobs_pb2.ListJobsReply) -> dict[str, Any]:
    """`jobs --json`: every key always present; job_id and the slots are null while pending."""
    jobs = []
    for j in reply.jobs:
        active = j.state == "active"
        jobs.append(
            {
                "name": j.name,
                "state": j.state,
                "data_plane": j.data_plane or None,
                "world_size": j.world_size,
                "job_id": j.job_id if active else None,
                "slot_base": j.slot_base if active else None,
                "slot_count": j.slot_count if active else None,
                "k": j.k if active else None,
                "generation": j.generation if active else None,
                "workers": [
                    {"rank": w.rank if active else None, "ip": w.ip, "udp_port": w.udp_port, "left": w.left}
                    for w in j.workers
                ],
                "shards": [
                    {
                        "index": s.index,
                        "node": s.node,
                        "aggregator": f"{s.aggregator_ip}:{s.aggregator_port}",
                        "slot_base": s.slot_base,
                        "slot_count": s.slot_count,
                    }
                    for s in j.shards
                ],
            }
        )
    return {"jobs": jobs}


def counters_json(reply: jobs_pb2.CountersReply) -> dict[str, Any]:
    """`counters --json`: per data plane, totals/drops/faults by name and per-job counters; the
    data planes that could not be read (a switch that is away) under "unavailable", with why."""
    planes: dict[str, dict[str, Any]] = {}
    for c in reply.counters:
        plane = planes.setdefault(
            c.data_plane,
            {"data_plane": c.data_plane, "total": {}, "drops": {}, "faults": {}, "jobs": {}},
        )
        if c.scope == "job":
            job = plane["jobs"].setdefault(
                c.index, {"job_id": c.index, **dict.fromkeys(protocol.JOB_COUNTERS, 0)}
            )
            job[c.name] = c.packets
        elif c.scope in plane:
            plane[c.scope][c.name] = c.packets
    for plane in planes.values():
        plane["jobs"] = [plane["jobs"][i] for i in sorted(plane["jobs"])]
    unavailable = [{"data_plane": u.data_plane, "error": u.error} for u in reply.unavailable]
    return {"data_planes": list(planes.values()), "unavailable": unavailable}


def format_counters(reply: jobs_pb2.CountersReply) -> str:
    lines = []
    by_plane: dict[str, list[jobs_pb2.Counter]] = {}
    for c in reply.counters:
        by_plane.setdefault(c.data_plane, []).append(c)
    for plane, counters in by_plane.items():
        lines.append(f"[{plane}]")
        for scope in ("total", "drops", "faults"):
            row = [f"{c.name} {c.packets}" for c in counters if c.scope == scope]
            if row:
                lines.append(f"  {scope}: " + "  ".join(row))
        jobs = sorted({c.index for c in counters if c.scope == "job"})
        if jobs:
            lines.append(f"  {'job':>6} " + " ".join(f"{n:>16}" for n in protocol.JOB_COUNTERS))
            for job_id in jobs:
                values = {c.name: c.packets for c in counters if c.scope == "job" and c.index == job_id}
                lines.append(
                    f"  {job_id:>6} " + " ".join(f"{values.get(n, 0):>16}" for n in protocol.JOB_COUNTERS)
                )
    for u in reply.unavailable:
        lines.append(f"[{u.data_plane}]\n  unavailable: {u.error}")
    return "\n".join(lines) if lines else "no counters"


def _print_json(value: object) -> None:
    print(json.dumps(value, sort_keys=True), flush=True)  # one line: --interval gives JSON lines


def _jobs(args: argparse.Namespace) -> int:
    reply = _rpc(args, "ListJobs", jobs_pb2.ListJobsRequest(admin_secret=_admin_secret(args)))
    assert isinstance(reply, jobs_pb2.ListJobsReply)
    if args.json:
        _print_json(jobs_json(reply))
    else:
        print(format_jobs(reply))
    return 0


def _teardown(args: argparse.Namespace) -> int:
    reply = _rpc(args, "Teardown", jobs_pb2.TeardownRequest(admin_secret=_admin_secret(args), job=args.job))
    assert isinstance(reply, jobs_pb2.TeardownReply)
    print(f"job {args.job} torn down" + (f" (id {reply.job_id})" if reply.job_id else " while joining"))
    return 0


def _counters(args: argparse.Namespace) -> int:
    if args.interval is not None and args.interval <= 0:
        raise CliError("--interval needs a positive number of seconds")
    if args.count < 0:
        raise CliError("--count needs a number of rounds (0: until interrupted)")
    repeat = args.interval is not None or args.count > 0
    interval = DEFAULT_INTERVAL if args.interval is None else args.interval
    rounds = 0
    while True:
        if args.topology:
            switches = _switch_counters(args)
            if args.json:
                _print_json({"switches": switches})
            else:
                print(format_switch_counters(switches), flush=True)
        else:
            reply = _rpc(args, "Counters", jobs_pb2.CountersRequest(admin_secret=_admin_secret(args)))
            assert isinstance(reply, jobs_pb2.CountersReply)
            if args.json:
                _print_json(counters_json(reply))
            else:
                print(format_counters(reply), flush=True)
        rounds += 1
        if not repeat or (args.count and rounds >= args.count):
            return 0
        time.sleep(interval)
        if not args.json:
            print(flush=True)


def _switch_counters(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Counters read straight from the switches (no job service needed): per switch, drops by
    reason and the job counters by counter index (not job id: only the controller knows those)."""
    from switchagg_controller import p4_program
    from switchagg_controller.switch_session import SwitchSession
    from switchagg_controller.topology import load_topologies

    topologies = load_topologies(args.topology)
    _, p4info = _p4_artifacts(args)
    switches = []
    for t in topologies:
        # Reads only: the running controller stays primary.
        with SwitchSession(t.switch_address, t.device_id, p4info, primary=False) as s:
            drops = s.read_counter(p4_program.DROP_COUNTER)
            per_job = {name: s.read_counter(c) for name, c in p4_program.JOB_COUNTER_NAMES.items()}
        indices = sorted({i for values in per_job.values() for i, (_, p) in values.items() if p})
        switches.append(
            {
                "switch": t.name,
                "drops": {n: drops.get(i, (0, 0))[1] for i, n in enumerate(protocol.DROP_REASONS)},
                "jobs": [
                    {"index": i, **{n: per_job[n].get(i, (0, 0))[1] for n in protocol.JOB_COUNTERS}}
                    for i in indices
                ],
            }
        )
    return switches


def format_switch_counters(switches: list[dict[str, Any]]) -> str:
    blocks = []
    for sw in switches:
        lines = [f"[{sw['switch']}]"] if len(switches) > 1 else []
        lines.append("drops: " + "  ".join(f"{n} {v}" for n, v in sw["drops"].items()))
        lines.append(f"{'index':>6} " + " ".join(f"{n:>16}" for n in protocol.JOB_COUNTERS))
        for job in sw["jobs"]:
            lines.append(f"{job['index']:>6} " + " ".join(f"{job[n]:>16}" for n in protocol.JOB_COUNTERS))
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


def _top(args: argparse.Namespace) -> int:
    from switchagg_controller import top

    if args.interval <= 0:
        raise CliError("--interval needs a positive number of seconds")
    if args.count < 0:
        raise CliError("--count needs a number of refreshes (0: until interrupted)")
    iterations = 1 if args.once else args.count
    secret = _admin_secret(args)

    def read() -> top.Snapshot:
        jobs = _rpc(args, "ListJobs", jobs_pb2.ListJobsRequest(admin_secret=secret))
        counters = _rpc(args, "Counters", jobs_pb2.CountersRequest(admin_secret=secret))
        assert isinstance(jobs, jobs_pb2.ListJobsReply) and isinstance(counters, jobs_pb2.CountersReply)
        return top.Snapshot(time.monotonic(), jobs_json(jobs), counters_json(counters))

    refresh = sys.stdout.isatty() and not args.json
    before, shown = read(), 0
    while not iterations or shown < iterations:
        time.sleep(args.interval)
        after = read()
        v = top.view(before, after)
        if args.json:
            _print_json(v)
        else:
            title = (
                f"switchagg-ctl top  {args.service}  every {args.interval:g} s  {time.strftime('%H:%M:%S')}"
            )
            print(
                ("\x1b[H\x1b[2J" if refresh else "" if not shown else "\n") + top.render(v, title), flush=True
            )
        before, shown = after, shown + 1
    return 0


def _push(args: argparse.Namespace) -> int:
    """Pipeline and L2 state only; jobs are the running controller's business."""
    from switchagg_controller import p4_program
    from switchagg_controller.switch_session import SwitchSession
    from switchagg_controller.topology import load_topologies

    json_path, p4info = _p4_artifacts(args)
    for t in load_topologies(args.topology):
        state = p4_program.desired_state(t, [])
        with SwitchSession(
            t.switch_address,
            t.device_id,
            p4info,
            json_path,
            t.election_id,
            force_pipeline=args.force_pipeline,
        ) as s:
            if not s.is_primary:
                raise CliError(f"{t.switch_address}: another controller is primary (higher election id)")
            changes = s.apply(state, delete_others=not args.keep_jobs)
        # A switch that held no entries was empty: finsy pushed the pipeline (or it was fresh).
        what = f"{json_path.name} already running" if s.held_state else f"pushed {json_path.name}"
        print(f"{what} on {t.switch_address}: {changes} change(s)")
    return 0


def _add_serve(p: argparse.ArgumentParser) -> None:
    """serve's flags: each a ControllerConfig field of the same name (SERVE_FLAGS)."""
    p.add_argument(
        "--listen",
        default=DEFAULT_SERVICE,
        help="job service address, host:port or unix:/path (default %(default)s)",
    )
    _add_secret(p)
    _add_secret(p, admin=True)  # absent: STATE.admin-secret, made (0600) if missing
    p.add_argument("--state", default="switchagg-ctl.db", help="SQLite state file (default %(default)s)")
    p.add_argument("--topology", help="topology YAML of the P4 switch (or switches)")
    _add_p4(p)
    p.add_argument("--software", action="store_true", help="serve jobs on an embedded software aggregator")
    p.add_argument(
        "--fallback", action="store_true", help="with --topology: jobs that do not fit go to software"
    )
    p.add_argument(
        "--two-level",
        metavar="FILE",
        help="software leaves and spine (YAML; docs/CONTROLLER.md), before --software",
    )
    p.add_argument(
        "--reducers",
        metavar="FILE",
        help="the pool striped jobs run on: software reducers, P4 switch rails (YAML; docs/CONTROLLER.md)",
    )
    p.add_argument("--software-listen", default="127.0.0.1:48879", help="software aggregator UDP address")
    p.add_argument("--software-advertise", help="aggregator IP told to workers (default: the listen IP)")
    p.add_argument("--sw-k", type=int, default=protocol.DEFAULT_SW_K, help="K on the software aggregator")
    p.add_argument("--sw-slots", type=int, default=protocol.DEFAULT_SW_SLOTS, help="slots per software job")
    p.add_argument("--p4-slots", type=int, default=64, help="slots per P4 job")
    p.add_argument("--switch-wait", type=float, default=30.0, help="seconds to wait for the switch at start")
    p.add_argument("--join-timeout", type=float, default=60.0, help="longest wait for a job's workers")
    p.add_argument("--reap-timeout", type=float, default=30.0, help="silence after which a job is reaped")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: a free one)")
    p.add_argument(
        "--metrics-host", default="127.0.0.1", help="metrics address (0.0.0.0: any; default %(default)s)"
    )
    from switchagg_controller.app import ControllerConfig as Defaults

    quota = "per client (the address its joins come from; a Unix socket's callers are one); 0: no limit"
    p.add_argument(
        "--max-jobs-per-client", type=_count, default=Defaults.max_jobs_per_client, metavar="N",
        help=f"jobs, joining or running, {quota} (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--max-slots-per-client", type=_count, default=Defaults.max_slots_per_client, metavar="N",
        help=f"slots of running jobs {quota} (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--max-pending-joins", type=_count, default=Defaults.max_pending_joins, metavar="N",
        help="joins waiting for their jobs, all clients together; 0: no limit (default %(default)s)",
    )  # fmt: skip
    p.set_defaults(func=_serve)


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a count (0 or more), not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchagg-ctl", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    _add_serve(sub.add_parser("serve", help="run the job service and program the data plane"))

    p = sub.add_parser("push", help="push the P4 pipeline and the topology's L2 entries to the switch")
    p.add_argument("--topology", required=True)
    _add_p4(p)
    p.add_argument("--keep-jobs", action="store_true", help="leave entries not in the L2 state alone")
    p.add_argument("--force-pipeline", action="store_true", help="push the pipeline even if it is running")
    p.set_defaults(func=_push)

    p = sub.add_parser("jobs", help="list jobs and their slots")
    _add_client(p)
    _add_json(p)
    p.set_defaults(func=_jobs)

    p = sub.add_parser("counters", help="show the data planes' counters")
    _add_client(p)
    p.add_argument("--topology", help="read the P4 switch directly instead of asking the job service")
    _add_p4(p)
    interval, _ = _add_repeat(p, "rounds", once=True)
    add_renamed(p, "--watch", interval)
    _add_json(p)
    p.set_defaults(func=_counters)

    p = sub.add_parser("top", help="a refreshing table of jobs, their rates, losses and slots")
    _add_client(p)
    _, count = _add_repeat(p, "refreshes", once=False)
    add_renamed(p, "--iterations", count)
    p.add_argument("--once", action="store_true", help="one refresh (two reads) and exit")
    _add_json(p)
    p.set_defaults(func=_top)

    p = sub.add_parser("teardown", help="remove a job (by name or id) and free its slots")
    p.add_argument("job")
    _add_client(p)
    p.set_defaults(func=_teardown)

    for p in sub.choices.values():
        p.add_argument("--timeout", type=float, default=10.0, help=argparse.SUPPRESS)
    return parser


@quiet_broken_pipe
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    if not args.verbose:  # finsy reports every reconnection; our supervisor says what matters
        logging.getLogger("finsy").setLevel(logging.ERROR)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if isinstance(e, BrokenPipeError) and stdout_closed():
            raise  # the reader went away (| head): quiet_broken_pipe ends it with 0
        from switchagg_controller.app import ConfigError
        from switchagg_controller.jobs import JobError
        from switchagg_controller.topology import TopologyError

        known: tuple[type[Exception], ...] = (
            CliError,
            ConfigError,
            TopologyError,
            JobError,
            OSError,
            ValueError,
        )
        try:
            from switchagg_controller.p4rt import P4RuntimeError

            known += (P4RuntimeError,)
        except ImportError:
            pass
        if isinstance(e, known):
            print(f"switchagg-ctl: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
