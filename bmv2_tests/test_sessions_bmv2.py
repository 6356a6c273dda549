"""A sum belongs to the run that asked for it (docs/PROTOCOL.md, Sessions; issue 41), through the P4
switch: one job installed once on bmv2, and runs of a script of two ranks, each rank a process in
its namespace (the scenarios of switchagg_lab.testing.standing_job, as tests/test_sessions.py runs
them on the software aggregator)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from switchagg import protocol
from switchagg_controller import p4_program
from switchagg_lab.bmv2.switch_jobs import make_job
from switchagg_lab.testbed import AGG_IP
from switchagg_lab.testing import standing_job as sj
from switchagg_lab.testing.reliability import Reliability

N = 2


@pytest.fixture
def start(bed: Any, switch: Any) -> Iterator[sj.Start]:
    """Job 41 (2 ranks, 16 slots) installed on the switch for the whole test: a standing job."""
    eps = bed.endpoints[:N]
    job = make_job(41, eps, slot_base=600, slot_count=16, counter_index=9)
    switch.apply(p4_program.desired_state(bed.topology(), [job]))

    def start_rank(rank: int, base: int, calls: int, timeout: float) -> subprocess.Popen[str]:
        w, e = job.workers[rank], eps[rank]
        agg, bind = (AGG_IP, protocol.UDP_PORT), (e.ip, w.udp_port)
        slots = (job.slot_base, job.slot_count, protocol.P4_K)
        argv = sj.rank_argv(job.job_id, rank, N, agg, bind, job.key, base, calls, timeout, *slots)
        return e.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    yield start_rank


@pytest.mark.reliability(
    "standing job reused",
    "bmv2 data plane: 4 runs of a 2-rank script (a process per rank) one after another on one installed "
    "job, each run's first call of the same identity as the run before's last",
    state="nothing: the switch serves the next run",
    recovery="none needed: each session's hello",
)
def test_every_run_on_a_standing_job_gets_its_own_sums(start: sj.Start, reliability: Reliability) -> None:
    hellos = sj.Hellos()
    reliability.record(runs=4, sums=sj.runs_one_after_another(start, N, hellos), recovery=hellos.summary())


@pytest.mark.reliability(
    "standing job reused",
    "bmv2 data plane: a 2-rank run SIGKILLed mid-call, then new runs on the same installed job",
    state="the killed run's rounds, half done, stay in the registers; no later session sees them",
    recovery="none needed",
)
def test_a_run_killed_mid_call_leaves_nothing_for_the_next(start: sj.Start, reliability: Reliability) -> None:
    reliability.record(sums=sj.killed_mid_call_then_a_new_run(start, N))


@pytest.mark.reliability(
    "rank restarted alone",
    "bmv2 data plane: rank 1 of a running 2-rank run SIGKILLed and started again while rank 0 goes on",
    outcome="failed cleanly",
    state="nothing: the next run of both ranks is exact",
)
def test_a_rank_restarted_alone_fails_every_rank(start: sj.Start, reliability: Reliability) -> None:
    sums, elapsed = sj.restarted_alone(start, N)
    reliability.record(sums=sums, recovery_s=round(elapsed, 1))
