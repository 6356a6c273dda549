"""Faults of the reliability suite (docs/RELIABILITY.md) that no other test covers: loss of 0.1, 1
and 5% both ways and duplicated packets on the emulated rack (namespaces, veths, nftables), and a
one-level software aggregator killed and restarted under a running job. Every sum that comes back
is checked and the wrong ones counted (the goal: none); a fault may make a job fail, but only
cleanly: an error on every rank, never a wrong sum.

The rack tests need root, iproute2 and nftables, and skip, saying why, elsewhere."""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from switchagg import Session, SwitchaggError, protocol
from switchagg.aggregator import SoftwareAggregator, new_key
from switchagg_lab.testbed import netns, tools
from switchagg_lab.testing.checks import float_bound
from switchagg_lab.testing.reliability import Reliability

RACK_REASON = tools.missing_for(["ip", "tc", "nft"], "the emulated-rack fault tests")

N, K, SLOTS = 3, 256, 16  # 1 KiB packets: many of them, so that 0.1% loss hits some
STEPS, LENGTH = 20, 100_000  # allreduces per run, alternately int32 and float32: ~7,800 packets each way
STEPS_AT = {0.1: 100, 1: 40, 5: 20}  # more at low loss, so that it hits a hundred packets or more
PORT = protocol.UDP_PORT


def tensor(rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng([step, rank])
    if step % 2 == 0:
        return rng.integers(-(2**28), 2**28, LENGTH, dtype=np.int32)
    return (rng.standard_normal(LENGTH) * (rank + 1)).astype(np.float32)


def wrong_sums(step: int, results: list[np.ndarray]) -> int:
    """How many ranks' results of this step are wrong: int32 not the exact sum, float32 outside the
    documented bound or not the same bits as rank 0's."""
    xs = [tensor(r, step) for r in range(len(results))]
    if step % 2 == 0:
        want = np.sum([x.astype(np.int64) for x in xs], axis=0).astype(np.int32)
        return sum(not np.array_equal(got, want) for got in results)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    bound = float_bound(xs, K)
    return sum(
        bool((np.abs(got.astype(np.float64) - exact) > bound).any()) or not np.array_equal(got, results[0])
        for got in results
    )


def allreduce_steps(sessions: list[Session], steps: int) -> tuple[int, int, list[float]]:
    """``steps`` allreduces on every rank at once; -> (sums checked, wrong sums, seconds per step)."""
    checked = wrong = 0
    seconds = []
    for step in range(steps):
        xs = [tensor(r, step) for r in range(len(sessions))]
        t0 = time.monotonic()
        for f in [s.allreduce_async(x) for s, x in zip(sessions, xs, strict=True)]:
            f.result(timeout=120)
        seconds.append(time.monotonic() - t0)
        checked += len(xs)
        wrong += wrong_sums(step, xs)
    return checked, wrong, seconds


# ---- the emulated rack ----


def _rule(chain: str, hook: str, dev: str, match: str, percent: float, action: str) -> str:
    """An nftables netdev chain on ``dev`` doing ``action`` to ``percent``% of the aggregation packets
    ``match`` selects (numgen random mod 100000: 0.001% steps)."""
    return (
        f"  chain {chain} {{\n    type filter hook {hook} device {dev} priority 0; policy accept;\n"
        f"    {match} numgen random mod 100000 < {round(percent * 1000)} counter {action}\n  }}\n"
    )


def set_faults(bed: Any, loss: float = 0.0, dup: float = 0.0) -> None:
    """Loss: on each worker's eth0, ``loss``% of the DATA leaving and of the RESULTs arriving
    dropped. Duplication: ``dup``% of the DATA leaving each worker and of the RESULTs leaving each
    switch port towards it sent twice (nftables ``dup`` to the same device). Zero: no rule."""
    clear_faults(bed)
    for e in bed.endpoints:
        port = bed.switch_port(e)
        worker, switch = "", ""
        if loss:
            worker += _rule("lose_out", "egress", "eth0", f"udp dport {PORT}", loss, "drop")
            worker += _rule("lose_in", "ingress", "eth0", f"udp sport {PORT}", loss, "drop")
        if dup:
            worker += _rule("dup_out", "egress", "eth0", f"udp dport {PORT}", dup, 'dup to "eth0"')
            switch += _rule(f"dup_{port}", "egress", port, f"udp sport {PORT}", dup, f'dup to "{port}"')
        if worker:
            netns.sh("nft", "-f", "-", ns=e.ns, stdin=f"table netdev sarel {{\n{worker}}}\n", timeout=30)
        if switch:
            netns.sh("nft", "-f", "-", ns=bed.switch_ns, stdin=f"table netdev sarel{port} {{\n{switch}}}\n")


def clear_faults(bed: Any) -> None:
    for e in bed.endpoints:
        netns.sh("nft", "delete table netdev sarel", ns=e.ns, check=False)
        netns.sh("nft", f"delete table netdev sarel{bed.switch_port(e)}", ns=bed.switch_ns, check=False)


def fault_counts(bed: Any) -> dict[str, int]:
    """Packets each rule hit so far, by chain kind (lose_out, lose_in, dup_out, dup_in)."""
    counts = dict.fromkeys(("lose_out", "lose_in", "dup_out", "dup_in"), 0)
    outs = [netns.sh("nft", "list table netdev sarel", ns=e.ns, check=False) for e in bed.endpoints]
    outs += [
        netns.sh("nft", f"list table netdev sarel{bed.switch_port(e)}", ns=bed.switch_ns, check=False)
        for e in bed.endpoints
    ]
    for out in outs:
        for chain, n in re.findall(r"chain (\w+) \{.*?counter packets (\d+)", out, re.S):
            counts["dup_in" if chain.startswith("dup_p") else chain] += int(n)
    return counts


@pytest.fixture(scope="module")
def rack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, SoftwareAggregator]]:
    if RACK_REASON:
        pytest.skip(RACK_REASON)
    from switchagg_lab.testbed.rack import AGG_IP, Testbed

    with Testbed(N, tmp_path_factory.mktemp("rack"), data_plane="soft", rate_mbit=1000) as bed:
        with netns.in_netns(bed.switch_ns):
            agg = SoftwareAggregator(host=AGG_IP, port=PORT).start()
        try:
            yield bed, agg
        finally:
            clear_faults(bed)
            agg.stop()
        prefix = bed.prefix
    assert not [ns for ns in netns.namespaces() if ns.startswith(prefix)]


_jobs = iter(range(1, 1000))


def rack_run(
    bed: Any, agg: SoftwareAggregator, loss: float = 0.0, dup: float = 0.0, steps: int = STEPS
) -> dict[str, Any]:
    """One job of STEPS allreduces on the rack with these faults; faults and job gone afterwards."""
    job = next(_jobs)
    key = new_key()
    sessions: list[Session] = []
    try:
        for e in bed.endpoints:
            with netns.in_netns(e.ns):
                sessions.append(
                    Session(
                        job,
                        e.index,
                        N,
                        agg.address,
                        0,
                        SLOTS,
                        K,
                        bind=(e.ip, 0),
                        timeout=30,
                        rto=0.02,
                        key=key,
                    )
                )
        agg.add_job(job, N, 0, SLOTS, K, 1, [s.local_address for s in sessions], key=key)
        set_faults(bed, loss, dup)
        checked, wrong, seconds = allreduce_steps(sessions, steps)
        faults = fault_counts(bed)
        clear_faults(bed)
        stats = [s.stats() for s in sessions]
        job_counters = agg.counters()["jobs"][job]
    finally:
        clear_faults(bed)
        for s in sessions:
            s.close()
        if job in agg.jobs():
            agg.remove_job(job)
    return {
        "checked": checked,
        "wrong": wrong,
        "seconds": seconds,
        "faults": faults,
        "sent": sum(s["sent"] for s in stats),
        "retransmits": sum(s["retransmits"] for s in stats),
        "stale": sum(s["stale"] for s in stats),
        "job": job_counters,
    }


def _timing(seconds: list[float]) -> str:
    return f"allreduces of 0.4 MB: median {statistics.median(seconds):.2f} s, slowest {max(seconds):.2f} s"


@pytest.mark.reliability(
    "loss",
    "none (the baseline of the loss rows), emulated rack",
    state="nothing: job removed, sessions reusable",
)
def test_the_emulated_rack_without_faults(
    rack: tuple[Any, SoftwareAggregator], reliability: Reliability
) -> None:
    bed, agg = rack
    r = rack_run(bed, agg)
    reliability.record(
        tried=f"none (the baseline of the loss rows), emulated rack: {N} ranks x {STEPS} allreduces",
        sums=r["checked"],
        wrong=r["wrong"],
        recovery=_timing(r["seconds"]),
    )
    assert r["wrong"] == 0


@pytest.mark.reliability(
    "loss",
    "{percent}% of aggregation packets dropped each way at every worker link, emulated rack (nftables)",
    state="nothing: rules and job removed, sessions reusable",
)
@pytest.mark.parametrize("percent", [0.1, 1, 5])
def test_loss_on_the_emulated_rack_changes_no_sum(
    rack: tuple[Any, SoftwareAggregator], percent: float, reliability: Reliability
) -> None:
    bed, agg = rack
    r = rack_run(bed, agg, loss=percent, steps=STEPS_AT[percent])
    f = r["faults"]
    reliability.record(
        tried=f"{percent}% of aggregation packets dropped each way at every worker link, emulated rack "
        f"(nftables): {N} ranks x {STEPS_AT[percent]} allreduces, {r['sent']} DATA sent, "
        f"{f['lose_out']} DATA and {f['lose_in']} RESULTs dropped",
        sums=r["checked"],
        wrong=r["wrong"],
        recovery=f"every loss repaired by retransmission ({r['retransmits']} resent); "
        + _timing(r["seconds"]),
    )
    assert r["wrong"] == 0
    assert f["lose_out"] > 0 and f["lose_in"] > 0, f  # both ways, at every rate tried
    assert r["retransmits"] > 0


@pytest.mark.reliability(
    "duplicated packets",
    "5% of DATA and 5% of RESULTs sent twice on every worker link, emulated rack (nftables dup)",
    state="nothing: rules and job removed, sessions reusable",
)
def test_duplicated_packets_on_the_emulated_rack_change_no_sum(
    rack: tuple[Any, SoftwareAggregator], reliability: Reliability
) -> None:
    bed, agg = rack
    r = rack_run(bed, agg, dup=5)
    f = r["faults"]
    reliability.record(
        tried=f"5% of DATA and 5% of RESULTs sent twice on every worker link, emulated rack (nftables "
        f"dup): {N} ranks x {STEPS} allreduces, {f['dup_out']} DATA and {f['dup_in']} RESULTs duplicated",
        sums=r["checked"],
        wrong=r["wrong"],
        recovery=f"duplicates ignored ({r['job']['retrans_ignored']} at the aggregator, {r['stale']} stale "
        f"at the workers); {_timing(r['seconds'])}",
    )
    assert r["wrong"] == 0
    assert f["dup_out"] > 0 and f["dup_in"] > 0, f
    assert r["stale"] > 0 and r["job"]["retrans_ignored"] + r["job"]["resent"] > 0


# ---- a software aggregator restarted under a running job ----

RESTART_RUNS, RESTART_STEPS, RESTART_LENGTH = 3, 150, 20_000


def _restart_run(run: int) -> dict[str, Any]:
    """Three ranks allreduce RESTART_STEPS int32 tensors; after some steps the aggregator is stopped
    (its socket closed, its slots lost) and a new one bound to the same port gets the job again.
    -> what every rank got, and when."""
    key = 0x5EED0000 + run
    agg = SoftwareAggregator("127.0.0.1", 0).start()
    address = agg.address
    sessions = [Session(1, r, N, address, 0, 8, 1024, timeout=3.0, rto=0.02, key=key) for r in range(N)]
    addrs = [s.local_address for s in sessions]
    agg._agg.add_job(1, N, 0, 8, 1024, 1, addrs, key=key)
    done: list[list[tuple[float, np.ndarray]]] = [[] for _ in range(N)]
    errors: list[tuple[float, BaseException] | None] = [None] * N

    def rank(r: int) -> None:
        try:
            for step in range(RESTART_STEPS):
                x = (np.arange(RESTART_LENGTH, dtype=np.int32) * (step + 1) + 1000 * r).astype(np.int32)
                sessions[r].allreduce(x)
                done[r].append((time.monotonic(), x))
        except SwitchaggError as e:
            errors[r] = (time.monotonic(), e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(N)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while min(len(d) for d in done) < 10 + 5 * run and time.monotonic() < deadline:
        time.sleep(0.002)
    assert all(errors[r] is None for r in range(N)), errors
    agg.stop()  # mid-job: the ranks are somewhere in their next allreduces
    killed = time.monotonic()
    time.sleep(0.3)  # down a while (a process restart): resends meet a closed port
    agg = SoftwareAggregator(*address).start()
    agg._agg.add_job(1, N, 0, 8, 1024, 2, addrs, key=key)
    try:
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a rank hung"
    finally:
        agg.stop()
        for s in sessions:
            s.close()
    return {"done": done, "errors": errors, "killed": killed}


@pytest.mark.reliability(
    "aggregator restarted",
    "one-level software aggregator stopped mid-job and restarted on its port with the job, 3 ranks",
    state="a failed job's sessions are broken (open new ones); the restarted aggregator holds the job",
)
def test_an_aggregator_restarted_mid_job_gives_exact_sums_or_fails_cleanly(reliability: Reliability) -> None:
    """docs/PROTOCOL.md: a restarted aggregator has empty slots. Rounds no rank had finished are
    rebuilt from the workers' resends; a round that some rank finished and another did not cannot
    be, and then every rank fails with its session timeout. Never a wrong sum."""
    checked = wrong = exact_runs = failed_runs = 0
    recovery: list[float] = []
    for run in range(RESTART_RUNS):
        r = _restart_run(run)
        for steps in r["done"]:
            for step, (_, x) in enumerate(steps):
                base = np.arange(RESTART_LENGTH, dtype=np.int64) * (step + 1)
                want = (N * base + 1000 * sum(range(N))).astype(np.int32)
                checked += 1
                wrong += not np.array_equal(x, want)
        errors = r["errors"]
        if all(e is None for e in errors):
            exact_runs += 1
            # recovered: every rank finished a step it began after the restart
            after = [next(t for t, _ in steps if t > r["killed"]) for steps in r["done"]]
            recovery.append(max(after) - r["killed"])
        else:
            failed_runs += 1
            for e in errors:  # a rank that finished anyway holds only exact sums (counted above)
                assert e is None or "no result from the aggregator" in str(e[1]), e
            recovery.append(max(e[0] for e in errors if e is not None) - r["killed"])
    outcome = f"{exact_runs} exact, {failed_runs} failed cleanly (session timeout, 3 s)"
    reliability.record(
        tried=f"one-level software aggregator stopped mid-job and restarted on its port with the job "
        f"(new generation), 3 ranks x {RESTART_STEPS} allreduces",
        runs=RESTART_RUNS,
        sums=checked,
        wrong=wrong,
        outcome=outcome,
        recovery_s=[round(x, 2) for x in recovery],
    )
    assert wrong == 0
