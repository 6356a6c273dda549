"""The emulated rack (switchagg_lab.testbed) with the software data plane: real namespaces, veths,
token-bucket caps and a real job through the software aggregator in the switch namespace; and
switchagg-testbed's up/run/status/down, including recovery from a crashed run. Needs root and
iproute2; skipped, with the reason, elsewhere."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from switchagg import protocol
from switchagg_lab.testbed import netns, tools
from switchagg_lab.testbed.rack import AGG_IP, Testbed
from switchagg_lab.testing.kit import run_testbed_cli as cli

REASON = tools.missing_for(["ip", "tc"], "the testbed tests")
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def _ours(prefix: str) -> list[str]:
    return [n for n in netns.namespaces() if n.startswith(prefix)]


def test_a_job_through_the_soft_switch_namespace_is_exact(tmp_path: Path) -> None:
    from switchagg.aggregator import SoftwareAggregator
    from switchagg_lab.testing import checks
    from switchagg_lab.testing.local import run_job

    n, k, slots = 3, 2048, 16
    tensors = [("int32", 3 * k + 5), ("float32", 20000)]
    with Testbed(n, tmp_path / "bed", data_plane="soft", rate_mbit=400) as bed:
        qdisc = netns.sh("tc", "qdisc", "show", "dev", "eth0", ns=bed.endpoints[1].ns)
        assert "tbf" in qdisc and "400Mbit" in qdisc, qdisc
        with netns.in_netns(bed.switch_ns):  # the aggregator's socket lives in the switch namespace
            agg = SoftwareAggregator(host=AGG_IP, port=protocol.UDP_PORT).start()
        try:
            run_job(
                agg, 5, n, tensors, tmp_path, slots=slots, k=k,
                launcher=lambda r: ["ip", "netns", "exec", bed.endpoints[r].ns],
                per_rank={e.index: {"bind": [e.ip, 0]} for e in bed.endpoints},
            )  # fmt: skip
            drops = agg.counters()["drops"]
        finally:
            agg.stop()
        checks.check_results(5, n, k, tensors, tmp_path)
        assert drops["spoofed"] == 0, drops
        payload = (3 * k + 5 + 20000) * 4
        for link in bed.link_stats():  # every byte crossed a capped link both ways
            assert link["up"]["bytes"] >= payload and link["down"]["bytes"] >= payload, link
        prefix = bed.prefix
    assert _ours(prefix) == []


NAME = f"t{os.getpid() % 10**7}"  # testbed names are host-wide: one per test process
PREFIX = f"sat{NAME}-"


def test_a_long_queue_on_a_slow_link_is_not_taken_for_loss(tmp_path: Path) -> None:
    """A window of 192 KiB (22 slots of frame-sized packets, K by the links' MTU 9000) on a 20 Mbit/s
    link, 77 ms of queue: the capped links queue it instead of dropping its tail, and the queueing is
    not taken for loss. Exact sums as ever."""
    import numpy as np

    from switchagg import Session
    from switchagg.aggregator import SoftwareAggregator, new_key

    k = protocol.k_for_mtu(9000)
    n, slots, length = 2, protocol.window_slots(k), 8192 * 96
    with Testbed(n, tmp_path / "bed", data_plane="soft", rate_mbit=20) as bed:
        with netns.in_netns(bed.switch_ns):
            agg = SoftwareAggregator(host=AGG_IP, port=protocol.UDP_PORT).start()
        sessions = []
        key = new_key()
        try:
            for e in bed.endpoints:
                with netns.in_netns(e.ns):
                    sessions.append(
                        Session(1, e.index, n, agg.address, 0, slots, k, bind=(e.ip, 0), timeout=60, key=key)
                    )
            agg.add_job(1, n, 0, slots, k, 1, [s.local_address for s in sessions], key=key)
            xs = [np.arange(length, dtype=np.int32) * (r + 1) for r in range(n)]
            for f in [s.allreduce_async(x) for s, x in zip(sessions, xs, strict=True)]:
                f.result(timeout=120)
            for x in xs:
                np.testing.assert_array_equal(x, np.arange(length, dtype=np.int32) * 3)
            stats = [s.stats() for s in sessions]
            links = bed.link_stats()
        finally:
            for s in sessions:
                s.close()
            agg.stop()
    sent = sum(s["sent"] for s in stats)
    resent = sum(s["retransmits"] for s in stats)
    # Timing out on the queue would resend most of every window; a stalled (descheduled) peer
    # may still cost a window now and then.
    assert resent < sent / 4, (stats, links)
    assert all(link["up"]["dropped"] == link["down"]["dropped"] == 0 for link in links), links


@pytest.fixture
def cli_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    env = {**os.environ, "SWITCHAGG_TESTBED_DIR": str(tmp_path / "state")}
    yield env
    cli("down", "--name", NAME, env=env)


def test_the_testbed_command_up_run_status_down(cli_env: dict[str, str]) -> None:
    env = cli_env
    up = cli("up", "--name", NAME, "-n", "2", "--rate", "100", env=env)
    assert up.returncode == 0, up.stderr
    again = cli("up", "--name", NAME, "-n", "2", "--rate", "100mbit", env=env)  # tc's units: the same
    assert again.returncode == 0 and "up already" in again.stdout, again.stderr
    other = cli("up", "--name", NAME, "-n", "3", env=env)
    assert other.returncode == 1 and "down" in other.stderr

    script = (
        "import os, socket; from switchagg import Session; import numpy as np;"
        "s = Session.from_job_service(os.environ['SWITCHAGG_JOB_SERVICE'], "
        "open(os.environ['SWITCHAGG_SECRET_FILE']).read().strip(), 'cli', int(os.environ['WORLD_SIZE']), "
        "rank=int(os.environ['RANK']), bind=(os.environ['SWITCHAGG_WORKER_BIND'], 0));"
        "x = np.arange(5000, dtype=np.int32) * (int(os.environ['RANK']) + 1); s.allreduce(x);"
        "print('sum-ok' if (x == np.arange(5000, dtype=np.int32) * 3).all() else 'sum-WRONG', "
        "s.data_plane, '{ip}'); s.close()"
    )
    run = cli("run", "--name", NAME, "--timeout", "120", "--", sys.executable, "-c", script, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = sorted(line for line in run.stdout.splitlines() if "sum-" in line)
    assert lines == ["[h0] sum-ok software 10.201.0.1", "[h1] sum-ok software 10.201.0.2"], run.stdout

    status = cli("status", "--name", NAME, "--json", env=env)
    report = json.loads(status.stdout)
    assert status.returncode == 0 and report["up"] and report["processes"] == {"service": True}
    assert all(link["up"]["bytes"] > 20000 and link["down"]["bytes"] > 20000 for link in report["links"])
    # status prints how switchagg-ctl reaches the testbed's controller: the workers' variables
    state_dir = Path(env["SWITCHAGG_TESTBED_DIR"], NAME)
    ctl_env = {
        "SWITCHAGG_JOB_SERVICE": f"unix:{state_dir / 'jobs.sock'}",
        "SWITCHAGG_SECRET_FILE": str(state_dir / "secret"),
        "SWITCHAGG_ADMIN_SECRET_FILE": str(state_dir / "admin.secret"),
    }
    assert report["ctl_env"] == ctl_env
    text = cli("status", "--name", NAME, env=env).stdout
    export = next(line.strip() for line in text.splitlines() if line.strip().startswith("export "))
    assert dict(item.split("=", 1) for item in shlex.split(export)[1:]) == ctl_env, text
    ctl = subprocess.run(
        [sys.executable, "-m", "switchagg_controller.cli", "jobs", "--json"],
        capture_output=True, text=True, timeout=60, env={**env, **ctl_env},
    )  # fmt: skip
    assert ctl.returncode == 0 and "jobs" in json.loads(ctl.stdout), ctl.stderr

    # | head: the relay stops writing, the ranks run to the end, exit status 0, no traceback
    testbed = f"{sys.executable} -m switchagg_lab.testbed.testbed_cli"
    piped = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {testbed} run --name {NAME} -- seq 200000 | head -1"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert piped.returncode == 0 and piped.stderr == "" and piped.stdout.endswith(" 1\n"), piped

    failing = cli("run", "--name", NAME, "--grace", "5", "--", "sh", "-c", "exit $((RANK + 3))", env=env)
    assert failing.returncode in (3, 4), failing.stderr

    down = cli("down", "--name", NAME, env=env)
    assert down.returncode == 0 and _ours(PREFIX) == []
    assert not Path(env["SWITCHAGG_TESTBED_DIR"], NAME).exists()
    gone = cli("status", "--name", NAME, env=env)
    assert gone.returncode == 1 and "down" in gone.stdout


def test_up_after_a_crash_sweeps_what_the_crashed_run_left(cli_env: dict[str, str]) -> None:
    env = cli_env
    assert cli("up", "--name", NAME, "-n", "2", env=env).returncode == 0
    state = json.loads(Path(env["SWITCHAGG_TESTBED_DIR"], NAME, "state.json").read_text())
    os.kill(state["pids"]["service"], 9)  # the job service dies; its namespaces stay behind
    # a half-built link
    netns.sh("ip", "link", "add", f"{PREFIX}h7", "type", "veth", "peer", "name", f"{PREFIX}h8")
    netns.sh("ip", "netns", "add", f"{PREFIX}h5")  # and a namespace of a larger testbed
    status = cli("status", "--name", NAME, env=env)
    assert status.returncode == 1 and "BROKEN" in status.stdout
    up = cli("up", "--name", NAME, "-n", "2", env=env)
    assert up.returncode == 0, up.stderr
    assert f"{PREFIX}h" not in netns.sh("ip", "-o", "link", "show")
    assert sorted(_ours(PREFIX)) == [f"{PREFIX}h0", f"{PREFIX}h1", f"{PREFIX}sw"]
    assert cli("status", "--name", NAME, env=env).returncode == 0


def test_the_testbed_command_builds_racks_with_two_level_aggregation(cli_env: dict[str, str]) -> None:
    env = cli_env
    up = cli("up", "--name", NAME, "--racks", "2,2", "--rate", "400", "--uplink-rate", "200", env=env)
    assert up.returncode == 0, up.stderr
    assert "leaves at 10.212.1.254, 10.212.2.254, spine at 10.212.0.254" in up.stdout
    bad = cli("up", "--name", "other", "--racks", "2,2", "--data-plane", "bmv2", env=env)
    assert bad.returncode == 1 and "--data-plane software" in bad.stderr

    size = 200_000  # 800 kB per worker: the uplinks' share is measurable
    script = (
        "import os; from switchagg import Session; import numpy as np;"
        "s = Session.from_job_service(os.environ['SWITCHAGG_JOB_SERVICE'], "
        "open(os.environ['SWITCHAGG_SECRET_FILE']).read().strip(), 'racks', int(os.environ['WORLD_SIZE']), "
        "rank=int(os.environ['RANK']), bind=(os.environ['SWITCHAGG_WORKER_BIND'], 0));"
        f"x = np.arange({size}, dtype=np.int32) * (int(os.environ['RANK']) + 1); s.allreduce(x);"
        f"print('sum-ok' if (x == np.arange({size}, dtype=np.int32) * 10).all() else 'sum-WRONG', "
        "s.data_plane, '{ip}'); s.close()"
    )
    run = cli("run", "--name", NAME, "--timeout", "120", "--", sys.executable, "-c", script, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = sorted(line for line in run.stdout.splitlines() if "sum-" in line)
    assert lines == [
        f"[h{i}] sum-ok two-level {ip}"
        for i, ip in enumerate(["10.212.1.1", "10.212.1.2", "10.212.2.1", "10.212.2.2"])
    ], run.stdout

    status = cli("status", "--name", NAME, "--json", env=env)
    report = json.loads(status.stdout)
    assert status.returncode == 0 and report["up"], status.stdout
    assert set(report["processes"]) == {"spine", "rack0", "rack1", "service"}
    workers, uplinks = report["links"][:4], report["links"][4:]
    assert len(uplinks) == 2
    for rack, uplink in enumerate(uplinks):  # a leaf sends one partial up for its two workers
        rack_up = sum(w["up"]["bytes"] for w in workers[2 * rack : 2 * rack + 2])
        assert 4 * size < uplink["up"]["bytes"] < 0.75 * rack_up, (uplink, rack_up)

    down = cli("down", "--name", NAME, env=env)
    assert down.returncode == 0 and _ours(PREFIX) == []
