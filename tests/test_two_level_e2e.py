"""Two-level aggregation end to end (docs/PROTOCOL.md, Two levels): 2 leaves x 2 workers + 1 spine,
every one a separate process (workers: switchagg_lab.testing.worker; leaves and spine: the
switchagg-aggregator CLI), over real UDP: on loopback, and in network namespaces with 5% loss on
every hop in both directions (nftables)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from switchagg.protocol import UDP_PORT
from switchagg_lab.testbed import tools
from switchagg_lab.testing.checks import check_results, inputs, result_file
from switchagg_lab.testing.hierarchy import Layout, Node, run_hierarchy
from switchagg_lab.testing.kit import free_ports
from switchagg_lab.testing.reliability import Reliability

RACKS = [2, 2]
N = sum(RACKS)


def ok(procs: list[subprocess.CompletedProcess[str]]) -> None:
    assert all(p.returncode == 0 for p in procs), [p.stderr[-2000:] for p in procs]


def test_two_level_int32_exact_and_float32_within_bound(tmp_path: Path) -> None:
    k, slots = 256, 8
    tensors = [("int32", 10_000), ("float32", 9_999), ("int32", 1), ("float32", 100_001), ("int32", 50_000)]
    tensors += [("float32/16", 50_001), ("float32/8", 50_001)]  # narrow lanes: leaves and spine alike
    o = run_hierarchy(Layout.loopback(RACKS, free_ports(3)), 1, tensors, tmp_path, slots=slots, k=k)
    ok(o.workers)
    check_results(1, N, k, tensors, tmp_path)  # float32: the bound of n = 4, the job's total
    for leaf in o.leaves:
        c = leaf["jobs"]["1"]
        assert sum(leaf["drops"].values()) == 0
        # One partial up per completed local round; every one answered by the spine.
        assert c["upstream"] == c["multicast"] == c["aggregated"] // 2 > 0
    spine = o.spine["jobs"]["1"]
    assert (
        spine["aggregated"]
        == 2 * spine["multicast"]
        == sum(leaf["jobs"]["1"]["upstream"] for leaf in o.leaves)
    )
    # Nothing is lost, but the aggregators serve with several threads (the CLI's default), whose
    # results for different slots may overtake each other: a worker may take that for a loss and
    # resend. Each resend that reached the spine was answered there (resent, or ignored while the
    # other leaf's partial was missing), and each answer reached its leaf as a stale result.
    leaves = [leaf["jobs"]["1"] for leaf in o.leaves]
    assert sum(c["upstream_resent"] for c in leaves) == spine["resent"] + spine["retrans_ignored"]
    assert sum(c["stale_results"] for c in leaves) == spine["resent"]


@pytest.mark.reliability(
    "duplicated packets",
    "two-level (2 leaves x 2 workers + spine): 5% dropped and 5% duplicated in and out of every leaf "
    "and the spine (fault injector), 2 allreduces",
    sums=2 * N,
    recovery="every loss repaired, every duplicate ignored",
    state="nothing: the same bits as a loss-free run",
)
def test_two_level_with_faults_on_every_node_is_exact(tmp_path: Path) -> None:
    """5% drops and duplicates in and out of every leaf and the spine (the aggregators' fault
    injector, no root needed): every hop loses packets both ways, the sums stay exact and equal to
    a loss-free run's bits."""
    k, slots = 128, 8
    tensors = [("int32", 20_000), ("float32", 20_000)]
    faults = ["--drop-in", "0.05", "--dup-in", "0.05", "--drop-out", "0.05", "--dup-out", "0.05"]
    seeds = {"spine": "1", "l0": "2", "l1": "3"}
    clean, lossy = tmp_path / "clean", tmp_path / "lossy"
    clean.mkdir()
    lossy.mkdir()
    ok(run_hierarchy(Layout.loopback(RACKS, free_ports(3)), 1, tensors, clean, slots=slots, k=k).workers)
    o = run_hierarchy(
        Layout.loopback(RACKS, free_ports(3)), 1, tensors, lossy, slots=slots, k=k, rto=0.02,
        node_args=lambda name: [*faults, "--seed", seeds[name]],
    )  # fmt: skip
    ok(o.workers)
    stats = check_results(1, N, k, tensors, lossy)
    for node in [*o.leaves, o.spine]:
        assert min(node["faults"].values()) > 0, node["faults"]
    assert all(leaf["jobs"]["1"]["upstream_resent"] > 0 for leaf in o.leaves)  # lost partials/results
    assert o.spine["jobs"]["1"]["resent"] > 0  # the spine answered re-sent partials
    assert sum(s["retransmits"] for s in stats) > 0
    for rank in range(N):
        a, b = np.load(result_file(clean, 1, rank)), np.load(result_file(lossy, 1, rank))
        for i in range(len(tensors)):
            np.testing.assert_array_equal(a[f"t{i}"], b[f"t{i}"])


@pytest.mark.reliability(
    "aggregator restarted",
    "two-level: leaf 0 (a switchagg-aggregator process) SIGKILLed mid-job and restarted empty, 4 ranks x "
    "400 allreduces",
    recovery="exact: the workers' resends rebuild the rounds; failed: the session timeout (5 s)",
    state="a failed job's sessions broken; the restarted leaf holds the job",
)
def test_a_restarted_leaf_completes_the_job_or_fails_it_cleanly(
    tmp_path: Path, reliability: Reliability
) -> None:
    """Leaf 0 is killed mid-job and started again with empty slots. Its workers' resends rebuild
    every round none of them had finished; a round that one finished and another did not (a
    result lost at the moment of the kill) cannot be rebuilt, and then every worker fails with the
    session timeout. Either way, no worker ever holds a wrong sum (docs/PROTOCOL.md)."""
    k, slots = 256, 8
    tensors = [("int32", 20_000)] * 400

    def restart_leaf0(nodes: dict[str, Node]) -> None:
        time.sleep(0.5)  # the job is under way (it takes seconds; checked below: work after the restart)
        nodes["l0"].restart()

    o = run_hierarchy(
        Layout.loopback(RACKS, free_ports(3)), 1, tensors, tmp_path, slots=slots, k=k, timeout=5.0,
        during=restart_leaf0,
    )  # fmt: skip
    assert o.nodes["l0"].killed == 1
    codes = [p.returncode for p in o.workers]
    assert set(codes) <= {0, 3}, [p.stderr[-2000:] for p in o.workers]
    restarted = o.leaves[0]["jobs"]["1"]
    assert restarted["aggregated"] > 0  # the restart was mid-job: its workers came back to it
    exact = codes.count(0) == len(codes)
    reliability.record(sums=len(tensors) * codes.count(0), outcome="exact" if exact else "failed cleanly")
    if all(c == 0 for c in codes):
        stats = check_results(1, N, k, tensors, tmp_path)
        assert restarted["aggregated"] > 0 and restarted["upstream"] > 0  # the job went on through it
        assert sum(s["retransmits"] for s in stats[:2]) > 0  # leaf 0's workers rebuilt lost rounds
        print(f"\nleaf restart: the job completed exactly; restarted leaf {restarted}")
    else:
        for p in o.workers:
            if p.returncode == 3:
                assert "SwitchaggTimeout" in p.stderr, p.stderr[-2000:]
        # A worker that finished (the failure hit after its last round) holds exact sums.
        for r in [r for r, c in enumerate(codes) if c == 0]:
            got = np.load(result_file(tmp_path, 1, r))
            for i, (dtype, size) in enumerate(tensors):
                want = np.sum([inputs(1, q, size, dtype, i).astype(np.int64) for q in range(N)], axis=0)
                np.testing.assert_array_equal(got[f"t{i}"], want.astype(np.int32))
        print(f"\nleaf restart: the job failed cleanly (exit codes {codes}); restarted leaf {restarted}")


NETNS_REASON = tools.missing_for(["ip", "tc", "nft"], "the two-level namespace test")


@pytest.mark.reliability(
    "loss",
    "two-level racks in namespaces: 5% dropped each way on every worker link and uplink (nftables), "
    "4 ranks x 3 allreduces",
    sums=3 * N,
    recovery="every loss repaired by retransmission (workers and leaves)",
    state="nothing: namespaces and rules removed",
)
@pytest.mark.skipif(NETNS_REASON is not None, reason=NETNS_REASON or "")
def test_two_level_with_5_percent_loss_on_every_hop_in_namespaces(tmp_path: Path) -> None:
    """Workers, leaves and the spine in their own namespaces; nftables drops 5% of aggregation
    packets leaving and arriving at every worker and every leaf uplink: worker<->leaf and
    leaf<->spine, both ways. Every sum is exact."""
    from switchagg_lab.testbed.racks import SPINE_IP, Racks

    k, slots = 1024, 8
    tensors = [("int32", 200_000), ("float32", 200_000), ("int32", 7), ("float32/8", 200_000)]
    with Racks(RACKS) as bed:
        ns = {f"h{w.index}": w.ns for w in bed.workers} | {f"l{lf.index}": lf.ns for lf in bed.leaves}
        ns["spine"] = bed.spine_ns
        layout = Layout(
            rack_of=bed.rack_of,
            leaf_binds=[("0.0.0.0", UDP_PORT)] * len(bed.leaves),  # workers' side and uplink, one socket
            leaf_addrs=[lf.address for lf in bed.leaves],
            leaf_views=[lf.spine_view for lf in bed.leaves],
            spine=(SPINE_IP, UDP_PORT),
            worker_bind=lambda rank: (bed.workers[rank].ip, 0),
            launcher=lambda name: ["ip", "netns", "exec", ns[name]],
        )
        hops = [*bed.workers, *(lf.uplink for lf in bed.leaves)]
        for hop in hops:
            hop.set_loss(5)
        o = run_hierarchy(layout, 1, tensors, tmp_path, slots=slots, k=k, rto=0.02)
        lost = [hop.lost_each_way() for hop in hops]
    ok(o.workers)
    stats = check_results(1, N, k, tensors, tmp_path)
    assert all(out > 0 and back > 0 for out, back in lost), lost  # every hop, both ways
    assert all(leaf["jobs"]["1"]["upstream_resent"] > 0 for leaf in o.leaves)
    assert sum(s["retransmits"] for s in stats) > 0
    print(f"\n5% loss per hop: packets lost (out, in) per worker link and uplink {lost}")
