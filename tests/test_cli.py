"""What every console script shares (host/switchagg/cli_util.py): --version from the package
metadata; switchagg-ctl's defaults from the workers' variables (a real controller on a Unix
socket)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

import switchagg
from switchagg_lab.testing.controller import ADMIN_SECRET, SECRET, Controller
from switchagg_lab.testing.kit import free_port

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = (ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
# [project.scripts]: name = "module:function"
SCRIPTS = dict(re.findall(r'^(switchagg-[a-z-]+) = "([\w.:]+)"$', PYPROJECT, re.M))


def _run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs the console script ``name`` as its entry point, with this interpreter."""
    module, func = SCRIPTS[name].split(":")
    code = f"import sys; from {module} import {func} as main; sys.argv[0] = {name!r}; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)


def test_version_is_the_package_metadata() -> None:
    declared = re.search(r'^version = "([^"]+)"$', PYPROJECT, re.M)
    assert declared is not None
    assert switchagg.__version__ == metadata.version("switchagg") == declared.group(1)


def test_every_console_script_is_installed() -> None:
    scripts = metadata.entry_points(group="console_scripts")
    installed = {e.name for e in scripts if e.dist is not None and e.dist.name == "switchagg"}
    assert len(SCRIPTS) >= 4 and installed == set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_version_flag(name: str) -> None:
    r = _run_script(name, "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{name} {switchagg.__version__}"
    assert r.stderr == ""


# -- switchagg-ctl: $SWITCHAGG_JOB_SERVICE, $SWITCHAGG_ADMIN_SECRET, $SWITCHAGG_ADMIN_SECRET_FILE ---


@pytest.fixture(scope="module")
def unix_controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controller]:
    pytest.importorskip("grpc", reason="the controller needs its extra (pip install .[controller])")
    tmp = tmp_path_factory.mktemp("ctl")
    udp = f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}"
    ctl = Controller(tmp, ["--software", "--software-listen", udp]).start(listen=f"unix:{tmp}/jobs.sock")
    yield ctl
    ctl.stop()


def _ctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHAGG_")}
    return subprocess.run(
        [sys.executable, "-m", "switchagg_controller.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )


def test_ctl_takes_service_and_admin_secret_from_the_variables(unix_controller: Controller) -> None:
    service, secret_file = unix_controller.address, str(unix_controller.admin_secret_file)
    assert service.startswith("unix:")
    for env in (
        {"SWITCHAGG_JOB_SERVICE": service, "SWITCHAGG_ADMIN_SECRET_FILE": secret_file},
        {"SWITCHAGG_JOB_SERVICE": service, "SWITCHAGG_ADMIN_SECRET": ADMIN_SECRET},
        # the join secret's order: SWITCHAGG_ADMIN_SECRET before SWITCHAGG_ADMIN_SECRET_FILE
        {
            "SWITCHAGG_JOB_SERVICE": service,
            "SWITCHAGG_ADMIN_SECRET": ADMIN_SECRET,
            "SWITCHAGG_ADMIN_SECRET_FILE": "/nonexistent",
        },
    ):
        r = _ctl("jobs", "--json", env=env)
        assert r.returncode == 0 and json.loads(r.stdout) == {"jobs": []}, (env, r.stderr)
        r = _ctl("counters", env=env)
        assert r.returncode == 0 and "[software]" in r.stdout, (env, r.stderr)


def test_ctl_flags_win_over_the_variables(unix_controller: Controller) -> None:
    service, secret_file = unix_controller.address, str(unix_controller.admin_secret_file)
    wrong = {"SWITCHAGG_JOB_SERVICE": "127.0.0.1:1", "SWITCHAGG_ADMIN_SECRET": "wrong"}
    r = _ctl("jobs", "--service", service, "--admin-secret-file", secret_file, env=wrong)
    assert r.returncode == 0 and r.stdout.strip() == "no jobs", r.stderr
    env = {"SWITCHAGG_JOB_SERVICE": service, "SWITCHAGG_ADMIN_SECRET": ADMIN_SECRET}
    r = _ctl("jobs", "--admin-secret", "wrong", env=env)
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr, r.stderr


def test_ctl_says_which_secret_is_missing(tmp_path: Path) -> None:
    # The workers' variables name the join secret, which lists nothing: the admin secret is asked for.
    r = _ctl("jobs", env={"SWITCHAGG_JOB_SERVICE": "127.0.0.1:1", "SWITCHAGG_SECRET": SECRET})
    assert r.returncode == 1
    assert "jobs needs the admin secret: --admin-secret-file or --admin-secret, or " in r.stderr
    assert "$SWITCHAGG_ADMIN_SECRET_FILE or $SWITCHAGG_ADMIN_SECRET" in r.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    r = _ctl("jobs", env={"SWITCHAGG_ADMIN_SECRET_FILE": str(empty)})
    assert r.returncode == 1 and f"SWITCHAGG_ADMIN_SECRET_FILE={empty} is empty" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# -- a closed pipe (| head) ends quietly ---------------------------------------------------------

QUIET = ("Traceback", "Errno 32", "Broken pipe", "Exception ignored")


def _closed_early(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs argv with stdout a pipe whose read end is closed before the command writes."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()
    err = p.stderr.read()
    p.wait(timeout=120)
    return subprocess.CompletedProcess(argv, p.returncode, "", err)


def _head(command: str, lines: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``command | head -LINES`` in bash with pipefail: the status is the command's."""
    script = f"set -o pipefail; {command} | head -{lines}"
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_into_a_closed_pipe(name: str, flag: str) -> None:
    module, func = SCRIPTS[name].split(":")
    code = f"import sys; from {module} import {func} as main; sys.argv[0] = {name!r}; sys.exit(main())"
    r = _closed_early([sys.executable, "-c", code, flag])
    assert r.returncode == 0 and not any(q in r.stderr for q in QUIET), r.stderr


def test_ctl_read_commands_into_head_exit_0_quietly(unix_controller: Controller) -> None:
    env = {
        **os.environ,
        "SWITCHAGG_JOB_SERVICE": unix_controller.address,
        "SWITCHAGG_ADMIN_SECRET_FILE": str(unix_controller.admin_secret_file),
    }
    ctl = f"{sys.executable} -m switchagg_controller.cli"
    for command, lines in (
        (f"{ctl} counters --watch 1 --count 2", 5),  # the command (--watch: --interval's old name)
        (f"{ctl} counters --interval 0.1 --count 100", 1),  # head is gone before the second round
        (f"{ctl} counters --json --interval 0.1 --count 100", 1),
        (f"{ctl} top --interval 0.1 --count 100", 1),
        (f"{ctl} top --json --interval 0.1 --count 100", 1),
    ):
        r = _head(command, lines, env)
        assert r.returncode == 0 and not any(q in r.stderr for q in QUIET), (command, r.stderr)
        assert len(r.stdout.splitlines()) == lines, (command, r.stdout)
    for what in ("jobs", "counters", "top --once"):
        r = _closed_early([*ctl.split(), *what.split()], env)
        assert r.returncode == 0 and not any(q in r.stderr for q in QUIET), (what, r.stderr)


def test_aggregator_stats_into_head_exit_0_quietly() -> None:
    port = free_port(socket.SOCK_DGRAM)
    command = f"{sys.executable} -m switchagg.aggregator_cli --port {port} --stats-interval 0.05"
    r = _head(command, 1, dict(os.environ))
    assert r.returncode == 0 and not any(q in r.stderr for q in QUIET), r.stderr
    assert r.stdout.startswith("switchagg-aggregator listening on")


def test_a_socket_broken_pipe_is_still_an_error() -> None:
    from switchagg.cli_util import quiet_broken_pipe

    @quiet_broken_pipe
    def main() -> int:
        raise BrokenPipeError(32, "Broken pipe")  # stdout (pytest's capture) is fine

    with pytest.raises(BrokenPipeError):
        main()


# -- rates in tc's units; one flag name per idea (old names hidden, for one release) -------------


@pytest.mark.parametrize(
    ("text", "mbit"),
    [
        ("200", 200.0),  # a bare number stays Mbit/s
        ("0.5", 0.5),
        ("1gbit", 1000.0),
        ("200mbit", 200.0),
        ("500kbit", 0.5),
        ("1GBit", 1000.0),
        ("2 gbit", 2000.0),
        ("1000000bit", 1.0),
        ("100mibit", 104.8576),
        ("12.5mbps", 100.0),  # tc: bps is bytes per second
        ("1e3", 1000.0),
    ],
)
def test_rates_in_tc_units(text: str, mbit: float) -> None:
    from switchagg.cli_util import parse_rate

    assert parse_rate(text) == pytest.approx(mbit)


@pytest.mark.parametrize("text", ["0", "-1", "1g", "1 mb", "fast", "", "0kbit"])
def test_rates_refused(text: str) -> None:
    import argparse

    from switchagg.cli_util import parse_rate

    with pytest.raises(argparse.ArgumentTypeError):
        parse_rate(text)


def test_testbed_up_parses_rates_and_the_data_plane() -> None:
    from switchagg_lab.testbed.testbed_cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["up", "--racks", "2,2", "--rate", "1gbit", "--uplink-rate", "200mbit"])
    assert (args.rate, args.uplink_rate, args.data_plane) == (1000.0, 200.0, "soft")
    assert parser.parse_args(["up", "--rate", "500kbit"]).rate == 0.5
    assert parser.parse_args(["up", "--rate", "200"]).rate == 200.0
    assert parser.parse_args(["up", "--data-plane", "software"]).data_plane == "soft"
    assert parser.parse_args(["up", "--data-plane", "soft"]).data_plane == "soft"  # the old name
    assert parser.parse_args(["up", "--data-plane", "bmv2"]).data_plane == "bmv2"


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["up", "--rate", "1g"], "tc's units"),
        (["up", "--uplink-rate", "0"], "positive"),
        (["up", "--data-plane", "p4"], "software or bmv2"),
    ],
)
def test_testbed_up_refuses(argv: list[str], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    from switchagg_lab.testbed.testbed_cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


def _subparser_help(parser: object, command: str) -> str:
    import argparse

    assert isinstance(parser, argparse.ArgumentParser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return str(action.choices[command].format_help())
    raise AssertionError(command)


def test_one_flag_name_per_idea_old_names_hidden(capsys: pytest.CaptureFixture[str]) -> None:
    from switchagg_controller.cli import build_parser as ctl_parser
    from switchagg_lab.testbed.testbed_cli import build_parser as testbed_parser

    ctl = ctl_parser()
    for command in ("counters", "top"):  # again and again: --interval SECONDS, --count N
        text = _subparser_help(ctl, command)
        assert "--interval SECONDS" in text and "--count N" in text
        assert "--watch" not in text and "--iterations" not in text
    args = ctl.parse_args(["counters", "--interval", "0.5", "--count", "3"])
    assert (args.interval, args.count) == (0.5, 3)
    assert ctl.parse_args(["counters"]).interval is None  # once
    assert ctl.parse_args(["top"]).interval == 2.0
    capsys.readouterr()
    # the old names still work, and say the new one
    args = ctl.parse_args(["counters", "--watch", "1", "--count", "2"])
    assert (args.interval, args.count) == (1.0, 2)
    assert "--watch is now --interval" in capsys.readouterr().err
    args = ctl.parse_args(["top", "--iterations", "4", "--interval", "0.5"])
    assert (args.interval, args.count) == (0.5, 4)
    assert "--iterations is now --count" in capsys.readouterr().err
    # the software aggregator: switchagg-ctl serve --software, switchagg-testbed up --data-plane software
    serve = _subparser_help(ctl, "serve")
    assert "--software " in serve
    # serve takes both secrets and the quotas; an operator's command, the admin secret only
    for flag in (
        "--secret-file",
        "--admin-secret-file",
        "--max-jobs-per-client N",
        "--max-slots-per-client N",
    ):
        assert flag in serve, flag
    assert "--max-pending-joins N" in serve
    for command in ("jobs", "counters", "top", "teardown"):
        text = _subparser_help(ctl, command)
        assert "--admin-secret-file" in text and "--secret-file" not in text.replace(
            "--admin-secret-file", ""
        )
    up = _subparser_help(testbed_parser(), "up")
    assert "{software,bmv2}" in up and "soft," not in up and "MBIT" not in up


def test_a_refused_testbed_up_says_in_one_sentence_what_differs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`up` while a testbed of another shape is up: the flags that differ, not the raw spec."""
    from switchagg_lab.testbed import testbed_cli

    parser = testbed_cli.build_parser()
    up = testbed_cli._spec(parser.parse_args(["up", "-n", "4"]))
    monkeypatch.setattr(testbed_cli, "_check_tools", lambda spec: None)
    monkeypatch.setattr(testbed_cli, "_load", lambda name: {"spec": up, "pids": {}})
    monkeypatch.setattr(testbed_cli, "_healthy", lambda name, state: True)
    monkeypatch.setattr(testbed_cli.os, "geteuid", lambda: 0)
    assert testbed_cli.main(["up", "-n", "8", "--rate", "200mbit"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "switchagg-testbed: testbed sa is up with -n 4, --rate unset, not -n 8, --rate 200: "
        "run `switchagg-testbed down --name sa` first"
    ), err
    assert testbed_cli.main(["up", "-n", "4"]) == 0  # the same shape: nothing to do
    assert "up already" in capsys.readouterr().out
