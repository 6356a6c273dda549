"""`switchagg-ctl top`: jobs, their rates and loss indications, and slot occupancy, in 80 columns.

Rates come from two reads of the job service (ListJobs and Counters, as `jobs --json` and
`counters --json` give them) ``interval`` seconds apart. Gbit/s is what the data plane took in
for the job: contributions times their datagram's UDP payload (header + 4 K bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from switchagg import protocol
from switchagg_controller import allocation

WIDTH = 80


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.monotonic() of the read
    jobs: dict[str, Any]  # cli.jobs_json
    counters: dict[str, Any]  # cli.counters_json


def _job_counters(s: Snapshot) -> dict[int, list[tuple[str, dict[str, int]]]]:
    """job id -> [(the data plane label its counters are under, e.g. "p4:s1", counters)]: one
    entry per switch or node the job is installed on (a two-level job: its leaves and spine)."""
    out: dict[int, list[tuple[str, dict[str, int]]]] = {}
    for p in s.counters["data_planes"]:
        for j in p["jobs"]:
            out.setdefault(j["job_id"], []).append((p["data_plane"], j))
    return out


def _job_totals(planes: list[tuple[str, dict[str, int]]]) -> dict[str, int]:
    """A job's counters as one: on one level, its plane's. On two, the workers' contributions are
    what the leaves aggregated (the planes with leaf counters), the results what the spine
    multicast; resends and ignored retransmissions, loss on any hop, add up over all planes."""
    if len(planes) == 1:
        return planes[0][1]
    leaves = [c for _, c in planes if protocol.LEAF_COUNTERS[0] in c]
    spines = [c for _, c in planes if protocol.LEAF_COUNTERS[0] not in c]
    return {
        "aggregated": sum(c["aggregated"] for c in leaves or spines),
        "multicast": sum(c["multicast"] for c in spines or leaves),
        "resent": sum(c["resent"] for _, c in planes),
        "retrans_ignored": sum(c["retrans_ignored"] for _, c in planes),
    }


def _pool(plane: str) -> int:
    return protocol.P4_NUM_SLOTS if plane.split(":")[0] == allocation.P4 else allocation.SW_POOL_SLOTS


def view(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """What `top --json` prints for one refresh: per job and per data plane, rates over the interval."""
    dt = max(after.at - before.at, 1e-9)
    old, new = _job_counters(before), _job_counters(after)

    def rate(job_id: int, name: str) -> float | None:
        if job_id not in old or job_id not in new or len(old[job_id]) != len(new[job_id]):
            return None  # new in this interval, or (some of) its counters unreadable: no rate yet
        return (_job_totals(new[job_id])[name] - _job_totals(old[job_id])[name]) / dt

    jobs = []
    slots: dict[str, int] = {}
    for j in after.jobs["jobs"]:
        job_id = j["job_id"]
        on = [name for name, _ in new.get(job_id, [])]
        plane = on[0] if len(on) == 1 else j["data_plane"]  # a job on several: its data plane
        if j["state"] == "active":
            for name in on or [plane]:  # the job holds its slot range on every switch it crosses
                slots[name] = slots.get(name, 0) + j["slot_count"]
        contributions = rate(job_id, "aggregated") if job_id is not None else None
        jobs.append(
            {
                "job_id": job_id,
                "name": j["name"],
                "state": j["state"],
                "data_plane": plane,
                "world_size": j["world_size"],
                "contributions_per_s": contributions,
                "results_per_s": rate(job_id, "multicast") if job_id is not None else None,
                "gbit_per_s": None
                if contributions is None
                else contributions * (protocol.HEADER_LEN + 4 * j["k"]) * 8 / 1e9,
                "resent_per_s": rate(job_id, "resent") if job_id is not None else None,
                "retrans_ignored_per_s": rate(job_id, "retrans_ignored") if job_id is not None else None,
            }
        )
    old_drops = {p["data_plane"]: sum(p["drops"].values()) for p in before.counters["data_planes"]}
    planes = []
    for p in after.counters["data_planes"]:
        name, drops = p["data_plane"], sum(p["drops"].values())
        planes.append(
            {
                "data_plane": name,
                "jobs": len(p["jobs"]),
                "slots_allocated": slots.get(name, 0),
                "slots_pool": _pool(name),
                "drops_per_s": (drops - old_drops[name]) / dt if name in old_drops else None,
                "drops": dict(p["drops"]),
            }
        )
    unavailable = [u["data_plane"] for u in after.counters.get("unavailable", [])]
    return {"interval_s": dt, "jobs": jobs, "data_planes": planes, "unavailable": unavailable}


def _num(x: float | None, width: int, digits: int = 1) -> str:
    """A rate in ``width`` characters: 1234.5, 123.4k, 12.3M ('-' when unknown)."""
    if x is None:
        return f"{'-':>{width}}"
    for scale, suffix in ((1.0, ""), (1e3, "k"), (1e6, "M"), (1e9, "G")):
        text = f"{x / scale:.{digits}f}{suffix}"
        if len(text) <= width:
            return f"{text:>{width}}"
    return f"{'>':>{width}}"


def render(v: dict[str, Any], title: str) -> str:
    lines = [title]
    lines.append(
        f"{'id':>5} {'job':<13} {'plane':<9} {'n':>2} {'contrib/s':>9} {'results/s':>9} "
        f"{'Gbit/s':>7} {'resent/s':>8} {'ignored/s':>9}"
    )
    for j in v["jobs"]:
        plane = j["data_plane"] if j["state"] == "active" else j["state"]
        lines.append(
            f"{j['job_id'] or '-':>5} {j['name']:<13.13} {plane:<9.9} {j['world_size']:>2} "
            f"{_num(j['contributions_per_s'], 9)} {_num(j['results_per_s'], 9)} "
            f"{_num(j['gbit_per_s'], 7, 2)} {_num(j['resent_per_s'], 8)} "
            f"{_num(j['retrans_ignored_per_s'], 9)}"
        )
    if not v["jobs"]:
        lines.append("  no jobs")
    lines.append("")
    lines.append(f"{'data plane':<20} {'jobs':>4} {'slots':>15} {'drops/s':>9}  drops")
    for p in v["data_planes"]:
        used = f"{p['slots_allocated']}/{p['slots_pool']}"
        share = f"{100 * p['slots_allocated'] / p['slots_pool']:.0f}%"
        nonzero = " ".join(f"{n}={c}" for n, c in p["drops"].items() if c) or "0"
        lines.append(
            f"{p['data_plane']:<20.20} {p['jobs']:>4} {used + ' ' + share:>15} "
            f"{_num(p['drops_per_s'], 9)}  {nonzero}"
        )
    for name in v.get("unavailable", []):
        lines.append(f"{name:<20.20}    - {'-':>15} {'-':>9}  unavailable")
    return "\n".join(line[:WIDTH] for line in lines)
