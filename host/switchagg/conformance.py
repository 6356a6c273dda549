"""Conformance vectors: packets in, packets expected out, kept as JSON in tests/vectors.

The same vectors run against the software aggregator (tests/test_conformance_software.py) and the
P4 switch on bmv2 (bmv2_tests/); docs/CONFORMANCE.md defines the format. This module only loads
and validates them and builds the UDP payloads; how packets are sent and jobs installed is the
runner's business.

Two-level vectors (tests/vectors/two_level) test the leaf role: a job with ``upstream`` (the
endpoint that plays the spine) and ``leaf_index``; its ``endpoints`` name the local ranks and
null for the ranks behind other leaves. The spine role is the one-level algorithm, which the
one-level vectors cover.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from switchagg.protocol import (
    DROP_REASONS,
    EXP_NONE,
    HEADER_LEN,
    JOB_COUNTERS,
    LANE_BITS,
    LANE_FLAGS,
    LEAF_COUNTERS,
    MAX_K,
    MAX_WORKERS,
    MSG_DATA,
    MSG_RESULT,
    P4_NUM_SLOTS,
    VERSION,
    Header,
    lanes_per_packet,
    scale_words,
)

INT32_MIN = -(2**31)
_ELEMS_OFFSET = 10  # byte offset of the elems field in the header (docs/PROTOCOL.md)
INT32_MAX = 2**31 - 1
DEFAULT_CALL = 1  # a send's or expected result's call when the vector does not say
DEFAULT_TOTAL = 4096  # ... and its call's length
DEFAULT_KEY_BASE = 0x5A5A0000  # a job's result key when the vector does not say: this plus its id

_VECTOR_KEYS = {"name", "description", "k", "endpoints", "jobs", "steps", "counters"}
_JOB_KEYS = {"id", "n", "slot_base", "slot_count", "generation", "endpoints", "upstream", "leaf_index", "key"}
_SEND_KEYS = {
    "from",
    "job",
    "rank",
    "slot",
    "set",
    "offset",
    "exp",
    "flags",
    "values",
    "call",
    "total",
    "key",
    "inc",
}
_OVERRIDE_KEYS = {"version", "type", "elems", "truncate", "extra"}
_LANE_KEYS = {"lanes16": 16, "lanes8": 8}  # a narrow-lane payload's key -> its lane width
_EXPECT_KEYS = {"to", "job", "slot", "set", "offset", "exp", "flags", "values", "call", "total", "inc"}


class VectorError(ValueError):
    """A vector file that does not follow docs/CONFORMANCE.md."""


@dataclass(frozen=True)
class JobSpec:
    """A job as the control plane installs it; rank r lives on endpoint ``endpoints[r]`` (None: a
    rank behind another leaf). A leaf's job has ``upstream``, the endpoint of its spine."""

    id: int
    n: int
    slot_base: int
    slot_count: int
    generation: int
    endpoints: tuple[int | None, ...]
    upstream: int | None = None
    leaf_index: int = 0
    key: int = 0  # the result key every RESULT of the job carries

    def rank_of(self, endpoint: int) -> int | None:
        return self.endpoints.index(endpoint) if endpoint in self.endpoints else None

    @property
    def leaf(self) -> bool:
        return self.upstream is not None

    @property
    def used_endpoints(self) -> list[int]:
        local = [e for e in self.endpoints if e is not None]
        return local + ([self.upstream] if self.upstream is not None else [])

    @property
    def counter_names(self) -> tuple[str, ...]:
        return JOB_COUNTERS + LEAF_COUNTERS if self.leaf else JOB_COUNTERS


@dataclass(frozen=True)
class Install:
    """Install a job (in addition to the ones installed; its slots must not overlap theirs)."""

    job: JobSpec


@dataclass(frozen=True)
class Remove:
    """Uninstall a job (its slot registers keep their contents, as on a switch)."""

    job_id: int


@dataclass(frozen=True)
class Send:
    """Endpoint ``endpoint`` sends ``payload`` (a UDP payload) to the aggregator; then ``expect``."""

    endpoint: int
    payload: bytes
    expect: tuple[tuple[int, bytes], ...]  # (endpoint, UDP payload), in order per endpoint
    note: str

    def expected_by_endpoint(self) -> dict[int, list[bytes]]:
        out: dict[int, list[bytes]] = {}
        for endpoint, payload in self.expect:
            out.setdefault(endpoint, []).append(payload)
        return out


Step = Install | Remove | Send


@dataclass(frozen=True)
class Vector:
    name: str
    description: str
    path: Path
    k: int
    endpoints: int  # endpoints are numbered 0..endpoints-1
    jobs: tuple[JobSpec, ...]  # installed before the first step
    steps: tuple[Step, ...]
    drops: dict[str, int]  # every drop reason, at the end of the vector
    job_counters: dict[int, dict[str, int]] = field(default_factory=dict)  # per listed job, every counter

    @property
    def sends(self) -> list[Send]:
        return [s for s in self.steps if isinstance(s, Send)]


def _int(obj: Mapping[str, Any], key: str, where: str, lo: int, hi: int, default: int | None = None) -> int:
    if key not in obj:
        if default is None:
            raise VectorError(f"{where}: missing {key!r}")
        return default
    value = obj[key]
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise VectorError(f"{where}: {key!r} must be an integer in {lo}..{hi}, got {value!r}")
    return value


def _check_keys(obj: Any, allowed: set[str], where: str) -> Mapping[str, Any]:
    if not isinstance(obj, dict):
        raise VectorError(f"{where}: expected an object, got {type(obj).__name__}")
    unknown = set(obj) - allowed
    if unknown:
        raise VectorError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")
    return obj


def _sequence(
    spec: Any, n: int, where: str, what: str, lo: int, hi: int, short_ok: bool = False
) -> list[int]:
    """``{"fill": v}``, ``{"ramp": [start, step]}`` or an explicit list: n integers in lo..hi (a list
    that is ``short_ok`` may have fewer, the rest being 0)."""
    if isinstance(spec, list):
        values = list(spec)
        if len(values) > n or (len(values) < n and not short_ok):
            need = f"at most {n}" if short_ok else f"k={n}"
            raise VectorError(f"{where}: an explicit {what} list needs {need} entries, got {len(values)}")
        values += [0] * (n - len(values))
    elif isinstance(spec, dict) and set(spec) == {"fill"}:
        values = [spec["fill"]] * n
    elif isinstance(spec, dict) and set(spec) == {"ramp"}:
        ramp = spec["ramp"]
        if not (isinstance(ramp, list) and len(ramp) == 2 and all(isinstance(x, int) for x in ramp)):
            raise VectorError(f"{where}: ramp must be [start, step], got {ramp!r}")
        values = [ramp[0] + i * ramp[1] for i in range(n)]
    else:
        raise VectorError(
            f"{where}: {what}s must be {{'fill': v}}, {{'ramp': [start, step]}} or a list, got {spec!r}"
        )
    for i, v in enumerate(values):
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            kind = "an int32" if (lo, hi) == (INT32_MIN, INT32_MAX) else f"in {lo}..{hi}"
            raise VectorError(f"{where}: {what} {i} = {v!r} is not {kind}")
    return values


def pack_lanes(lanes: list[int], scales: list[int], k: int, bits: int) -> list[int]:
    """A narrow-lane payload (docs/PROTOCOL.md, Narrow lanes) as its k int32 words: scale byte b at
    payload byte b, lane i (big-endian two's complement) at byte 4X + i*bits/8, the rest 0."""
    x, width = scale_words(k, bits), bits // 8
    buf = bytearray(4 * k)
    buf[: len(scales)] = bytes(scales)
    for i, lane in enumerate(lanes):
        at = 4 * x + i * width
        buf[at : at + width] = lane.to_bytes(width, "big", signed=True)
    return list(struct.unpack(f"!{k}i", buf))


def unpack_lanes(values: list[int], bits: int) -> tuple[list[int], list[int]]:
    """(scale bytes, lanes) of a narrow-lane payload of len(values) words: pack_lanes undone."""
    k, width = len(values), bits // 8
    raw = struct.pack(f"!{k}i", *values)
    x = scale_words(k, bits)
    lanes = [
        int.from_bytes(raw[4 * x + i * width : 4 * x + (i + 1) * width], "big", signed=True)
        for i in range(lanes_per_packet(k, bits))
    ]
    return list(raw[: 4 * x]), lanes


def _expand_lanes(spec: Mapping[str, Any], k: int, where: str) -> list[int]:
    """``{"lanes16" | "lanes8": lanes, "scales": [bytes]}``: lanes as values are (a list may be short:
    the rest are 0), scales likewise, 4X bytes at most (default none), packed by pack_lanes."""
    (key,) = set(spec) & set(_LANE_KEYS)
    bits = _LANE_KEYS[key]
    unknown = set(spec) - {key, "scales"}
    if unknown:
        raise VectorError(f"{where}: unknown keys {sorted(unknown)} in a {key} payload (allowed: scales)")
    top = (1 << (bits - 1)) - 1
    lanes = _sequence(spec[key], lanes_per_packet(k, bits), where, "lane", -top - 1, top, short_ok=True)
    scale_bytes = 4 * scale_words(k, bits)
    scales = _sequence(spec.get("scales", []), scale_bytes, where, "scale", 0, 255, short_ok=True)
    return pack_lanes(lanes, scales, k, bits)


def expand_values(spec: Any, k: int, where: str) -> list[int]:
    """``{"fill": v}``, ``{"ramp": [start, step]}`` or an explicit list of k int32 values; or a
    narrow-lane payload, ``{"lanes16": ..., "scales": [...]}`` (or ``lanes8``)."""
    if isinstance(spec, dict) and len(set(spec) & set(_LANE_KEYS)) == 1:
        return _expand_lanes(spec, k, where)
    return _sequence(spec, k, where, "value", INT32_MIN, INT32_MAX)


def _parse_job(obj: Any, where: str) -> JobSpec:
    o = _check_keys(obj, _JOB_KEYS, where)
    n = _int(o, "n", where, 1, MAX_WORKERS)
    base = _int(o, "slot_base", where, 0, P4_NUM_SLOTS - 1)
    count = _int(o, "slot_count", where, 1, P4_NUM_SLOTS - base)
    endpoints = o.get("endpoints", list(range(n)))
    upstream = _int(o, "upstream", where, 0, 1023) if "upstream" in o else None
    local = [e for e in endpoints if e is not None] if isinstance(endpoints, list) else []
    if (
        not isinstance(endpoints, list)
        or len(endpoints) != n
        or len(set(local)) != len(local)
        or not local
        or (upstream is None and len(local) != n)
        or not all(isinstance(e, int) and e >= 0 for e in local)
    ):
        raise VectorError(
            f"{where}: endpoints must list {n} distinct endpoint numbers (null only for ranks behind "
            f"other leaves, in a job with an upstream), got {endpoints!r}"
        )
    if upstream in local:
        raise VectorError(f"{where}: the upstream endpoint {upstream} also holds a rank")
    if upstream is None and "leaf_index" in o:
        raise VectorError(f"{where}: leaf_index without an upstream")
    job_id = _int(o, "id", where, 0, 0xFFFF)
    return JobSpec(
        id=job_id,
        n=n,
        slot_base=base,
        slot_count=count,
        generation=_int(o, "generation", where, 1, 0xFFFF),
        endpoints=tuple(endpoints),
        upstream=upstream,
        leaf_index=_int(o, "leaf_index", where, 0, MAX_WORKERS - 1, 0),
        key=_int(o, "key", where, 0, 2**32 - 1, DEFAULT_KEY_BASE + job_id),
    )


def _build_send(o: Mapping[str, Any], k: int, jobs: Mapping[int, JobSpec], where: str) -> tuple[int, bytes]:
    endpoint = _int(o, "from", where, 0, 1023)
    job_id = _int(o, "job", where, 0, 0xFFFF)
    job = jobs.get(job_id)
    own_rank = job.rank_of(endpoint) if job else None
    if job is not None and endpoint == job.upstream:
        own_rank = job.leaf_index  # the spine addresses the leaf by its rank at the spine
    msg_type = _int(o, "type", where, 0, 255, MSG_DATA)
    # A DATA's key field is its session incarnation (`inc`, default 0); the spine's RESULT carries the
    # job's key (the same on every level) for that session, key ^ inc; anything else none.
    inc = _int(o, "inc", where, 0, 2**32 - 1, 0)
    from_spine = job is not None and endpoint == job.upstream and msg_type == MSG_RESULT
    spine_key = job.key ^ inc if from_spine and job is not None else inc if msg_type == MSG_DATA else 0
    header = Header(
        job=job_id,
        rank=_int(o, "rank", where, 0, 0xFFFF, endpoint if own_rank is None else own_rank),
        slot=_int(o, "slot", where, 0, 0x7FFF),
        shadow=_int(o, "set", where, 0, 1, 0),
        offset=_int(o, "offset", where, 0, 2**32 - 1, 0),
        exp=_int(o, "exp", where, -128, 127, EXP_NONE),
        flags=_int(o, "flags", where, 0, 255, 0),
        type=msg_type,
        version=_int(o, "version", where, 0, 255, VERSION),
        call=_int(o, "call", where, 0, 2**32 - 1, DEFAULT_CALL),
        total=_int(o, "total", where, 0, 2**32 - 1, DEFAULT_TOTAL),
        key=_int(o, "key", where, 0, 2**32 - 1, spine_key),
        values=expand_values(o.get("values", {"fill": 0}), k, where),
    )
    packed = bytearray(header.pack())
    # Patched after packing: Header.pack() reads elems=0 as "use len(values)".
    struct.pack_into("!H", packed, _ELEMS_OFFSET, _int(o, "elems", where, 0, 0xFFFF, k))
    payload = bytes(packed) + bytes(_int(o, "extra", where, 0, 4096, 0))
    if "truncate" in o:
        payload = payload[: _int(o, "truncate", where, 0, len(payload))]
    return endpoint, payload


def _build_expect(obj: Any, k: int, jobs: Mapping[int, JobSpec], where: str) -> list[tuple[int, bytes]]:
    o = _check_keys(obj, _EXPECT_KEYS, where)
    job_id = _int(o, "job", where, 0, 0xFFFF)
    job = jobs.get(job_id)
    if job is None:
        raise VectorError(f"{where}: a result of job {job_id}, which is not installed")
    to = o.get("to")
    if not isinstance(to, list) or not to:
        raise VectorError(f"{where}: 'to' must be a non-empty list of endpoints, got {to!r}")
    values = expand_values(o.get("values"), k, where)
    inc = _int(o, "inc", where, 0, 2**32 - 1, 0)  # the session incarnation of the round
    out = []
    for endpoint in to:
        # To the spine a leaf sends a DATA with its leaf index as the rank; to a worker a RESULT.
        up = isinstance(endpoint, int) and endpoint == job.upstream
        rank = job.leaf_index if up else job.rank_of(endpoint) if isinstance(endpoint, int) else None
        if rank is None:
            raise VectorError(f"{where}: endpoint {endpoint!r} holds no rank of job {job_id}")
        header = Header(
            job=job_id,
            rank=rank,
            slot=_int(o, "slot", where, 0, 0x7FFF),
            shadow=_int(o, "set", where, 0, 1, 0),
            offset=_int(o, "offset", where, 0, 2**32 - 1, 0),
            exp=_int(o, "exp", where, -128, 127, EXP_NONE),
            flags=_int(o, "flags", where, 0, 255, 0),
            type=MSG_DATA if up else MSG_RESULT,
            elems=k,
            call=_int(o, "call", where, 0, 2**32 - 1, DEFAULT_CALL),
            total=_int(o, "total", where, 0, 2**32 - 1, DEFAULT_TOTAL),
            key=inc if up else job.key ^ inc,  # a DATA carries its session, a RESULT the key for it
            values=values,
        )
        out.append((endpoint, header.pack()))
    return out


def _check_no_overlap(jobs: Mapping[int, JobSpec], new: JobSpec, where: str) -> None:
    if new.id in jobs:
        raise VectorError(f"{where}: job {new.id} is already installed")
    for j in jobs.values():
        if new.slot_base < j.slot_base + j.slot_count and j.slot_base < new.slot_base + new.slot_count:
            raise VectorError(f"{where}: slots of job {new.id} overlap those of job {j.id}")


def parse_vector(data: Any, path: Path) -> Vector:
    """Validate one decoded vector file and build its packets."""
    where = path.name
    top = _check_keys(data, _VECTOR_KEYS, where)
    name = top.get("name")
    if not isinstance(name, str) or not name:
        raise VectorError(f"{where}: 'name' must be a non-empty string")
    k = _int(top, "k", where, 1, MAX_K)
    installed: dict[int, JobSpec] = {}
    initial = []
    for i, obj in enumerate(top.get("jobs", [])):
        job = _parse_job(obj, f"{where} jobs[{i}]")
        _check_no_overlap(installed, job, f"{where} jobs[{i}]")
        installed[job.id] = job
        initial.append(job)
    steps: list[Step] = []
    max_endpoint = max((e for j in initial for e in j.used_endpoints), default=0)
    for i, obj in enumerate(top.get("steps", [])):
        w = f"{where} steps[{i}]"
        if not isinstance(obj, dict) or len(set(obj) & {"send", "install", "remove"}) != 1:
            raise VectorError(f"{w}: a step is exactly one of send (with expect), install or remove")
        if "install" in obj:
            _check_keys(obj, {"install"}, w)
            job = _parse_job(obj["install"], w)
            _check_no_overlap(installed, job, w)
            installed[job.id] = job
            max_endpoint = max(max_endpoint, *job.used_endpoints)
            steps.append(Install(job))
        elif "remove" in obj:
            _check_keys(obj, {"remove"}, w)
            job_id = _int(obj, "remove", w, 0, 0xFFFF)
            if installed.pop(job_id, None) is None:
                raise VectorError(f"{w}: remove of job {job_id}, which is not installed")
            steps.append(Remove(job_id))
        else:
            o = _check_keys(obj, {"send", "expect", "note"}, w)
            send = _check_keys(o["send"], _SEND_KEYS | _OVERRIDE_KEYS, w + " send")
            endpoint, payload = _build_send(send, k, installed, w + " send")
            expect_list = o.get("expect")
            if not isinstance(expect_list, list):
                raise VectorError(f"{w}: 'expect' must be a list (empty: nothing is sent back)")
            expect: list[tuple[int, bytes]] = []
            for e_i, e in enumerate(expect_list):
                expect.extend(_build_expect(e, k, installed, f"{w} expect[{e_i}]"))
            max_endpoint = max(max_endpoint, endpoint, *(ep for ep, _ in expect))
            steps.append(Send(endpoint, payload, tuple(expect), str(o.get("note", ""))))
    endpoints = _int(top, "endpoints", where, max_endpoint + 1, 1024, max_endpoint + 1)
    counters = _check_keys(top.get("counters", {}), {"drops", "jobs"}, where + " counters")
    drops_in = _check_keys(counters.get("drops", {}), set(DROP_REASONS), where + " counters.drops")
    drops = {r: _int(drops_in, r, where + " counters.drops", 0, 2**63, 0) for r in DROP_REASONS}
    all_jobs = list(initial) + [s.job for s in steps if isinstance(s, Install)]
    installs = [j.id for j in all_jobs]
    job_counters: dict[int, dict[str, int]] = {}
    for key, value in _check_keys(
        counters.get("jobs", {}), set(map(str, installed)), where + " counters.jobs"
    ).items():
        if installs.count(int(key)) != 1:
            raise VectorError(f"{where}: counters of job {key}, which is installed more than once")
        names = next(j for j in all_jobs if j.id == int(key)).counter_names
        c = _check_keys(value, set(names), f"{where} counters.jobs.{key}")
        job_counters[int(key)] = {n: _int(c, n, f"{where} counters.jobs.{key}", 0, 2**63, 0) for n in names}
    return Vector(
        name=name,
        description=str(top.get("description", "")),
        path=path,
        k=k,
        endpoints=endpoints,
        jobs=tuple(initial),
        steps=tuple(steps),
        drops=drops,
        job_counters=job_counters,
    )


def load_vector(path: str | Path) -> Vector:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise VectorError(f"{p.name}: not valid JSON: {exc}") from exc
    return parse_vector(data, p)


def load_vectors(directory: str | Path) -> list[Vector]:
    """Every ``*.json`` vector in ``directory``, sorted by file name."""
    d = Path(directory)
    files = sorted(d.glob("*.json"))
    if not files:
        raise VectorError(f"no *.json conformance vectors in {d}")
    vectors = [load_vector(f) for f in files]
    names = [v.name for v in vectors]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise VectorError(f"duplicate vector names in {d}: {dupes}")
    return vectors


def default_vector_dir() -> Path:
    """tests/vectors of the source tree this package is installed from (editable install)."""
    return Path(__file__).resolve().parents[2] / "tests" / "vectors"


def two_level_vector_dir() -> Path:
    """tests/vectors/two_level: the leaf role of docs/PROTOCOL.md, Two levels."""
    return default_vector_dir() / "two_level"


def describe(payload: bytes) -> str:
    """A one-line readable form of a UDP payload, for assertion messages."""
    if len(payload) < HEADER_LEN:
        return f"<{len(payload)} bytes: {payload.hex()}>"
    h = Header.unpack(payload)
    vals = h.values
    shown = vals if len(vals) <= 4 else [*vals[:3], "...", vals[-1]]
    text = (
        f"v{h.version} type={h.type} flags={h.flags} exp={h.exp} job={h.job} rank={h.rank} slot={h.slot} "
        f"set={h.shadow} elems={h.elems} offset={h.offset} call={h.call} total={h.total} key={h.key:#x} "
        f"len={len(payload)} values={shown}"
    )
    bits = LANE_BITS.get(h.flags & LANE_FLAGS, 32)
    if bits != 32 and vals:  # the same words as scale bytes and lanes, which a vector names
        scales, lanes = unpack_lanes(vals, bits)
        shown_lanes = lanes if len(lanes) <= 12 else [*lanes[:11], "...", lanes[-1]]
        text += f" scales={scales} lanes{bits}={shown_lanes}"
    return text


def check_counters(
    vector: Vector, drops: Mapping[str, int], jobs: Mapping[int, Mapping[str, int]]
) -> list[str]:
    """Differences between a runner's counters and the vector's expectation (empty: they agree)."""
    problems = [
        f"drop {r}: expected {want}, got {drops.get(r)}"
        for r, want in vector.drops.items()
        if drops.get(r) != want
    ]
    for job_id, want_c in vector.job_counters.items():
        got_c = jobs.get(job_id, {})
        problems += [
            f"job {job_id} {n}: expected {want}, got {got_c.get(n)}"
            for n, want in want_c.items()
            if got_c.get(n) != want
        ]
    return problems
