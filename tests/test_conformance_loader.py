"""switchagg.conformance: the vector format of docs/CONFORMANCE.md, its packets and its errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from switchagg.conformance import (
    Install,
    Remove,
    Send,
    VectorError,
    describe,
    load_vector,
    load_vectors,
    parse_vector,
)
from switchagg.protocol import HEADER_LEN, MSG_RESULT, Header

K = 4


def job(id: int, base: int, count: int, gen: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "id": id,
        "n": extra.pop("n", 2),
        "slot_base": base,
        "slot_count": count,
        "generation": gen,
        **extra,
    }


def send(expect: list[Any] | None = None, **fields: Any) -> dict[str, Any]:
    return {"send": {"from": 0, "job": 7, "slot": 16, **fields}, "expect": expect or []}


def vec(steps: list[Any], **top: Any) -> dict[str, Any]:
    return {"name": "t", "k": K, "jobs": [job(7, 16, 4)], "steps": steps, **top}


def parse(data: dict[str, Any]) -> Any:
    return parse_vector(data, Path("t.json"))


def test_packets_are_built_from_the_spec() -> None:
    result = {
        "to": [1, 0],
        "job": 7,
        "slot": 17,
        "set": 1,
        "offset": 8,
        "exp": 2,
        "flags": 1,
        "values": [1, 2, 3, 4],
    }
    steps = [
        send([result], **{"from": 1}, slot=17, set=1, offset=8, exp=-3, values={"ramp": [5, -2]}),
        {"remove": 7},
        {"install": job(9, 0, 1, 3, n=1, endpoints=[3])},
    ]
    v = parse(vec(steps))
    sent, remove, install = v.steps
    assert isinstance(sent, Send) and isinstance(remove, Remove) and isinstance(install, Install)
    h = Header.unpack(sent.payload)
    assert (h.call, h.total, h.key) == (1, 4096, 0)  # the defaults: one call, a DATA carries no key
    assert (h.version, h.type, h.job, h.rank, h.slot, h.shadow, h.offset, h.exp, h.elems) == (
        2,
        1,
        7,
        1,
        17,
        1,
        8,
        -3,
        K,
    )
    assert h.values == [5, 3, 1, -1]
    by_ep = sent.expected_by_endpoint()
    assert list(by_ep) == [1, 0]
    r0 = Header.unpack(by_ep[0][0])
    assert (r0.type, r0.rank, r0.flags, r0.exp, r0.values) == (MSG_RESULT, 0, 1, 2, [1, 2, 3, 4])
    assert (r0.call, r0.total, r0.key) == (1, 4096, 0x5A5A0000 + 7)  # a RESULT carries the job's key
    assert Header.unpack(by_ep[1][0]).rank == 1
    assert v.endpoints == 4 and install.job.endpoints == (3,)
    assert remove.job_id == 7
    assert v.drops["truncated"] == 0


def test_narrow_lanes_are_packed_big_endian_after_the_scale_words() -> None:
    """K = 4: 16-bit lanes, one scale word and 6 lanes; 8-bit lanes, one scale word and 12 lanes."""
    v16 = {"lanes16": [0x7FFF, -1, 2], "scales": [0x80, 0xFF]}
    v8 = {"lanes8": {"fill": -2}, "scales": {"fill": 1}}
    steps = [send(values=v16, flags=0x12), send(values=v8, flags=0x22)]
    p16, p8 = (s.payload[HEADER_LEN:] for s in parse(vec(steps)).sends)
    assert p16 == bytes.fromhex("80ff0000 7fffffff 00020000 00000000")
    assert p8 == bytes.fromhex("01010101") + b"\xfe" * 12
    assert describe(parse(vec(steps)).sends[0].payload).endswith(
        "scales=[128, 255, 0, 0] lanes16=[32767, -1, 2, 0, 0, 0]"
    )


def test_overrides_make_malformed_packets() -> None:
    steps = [send(elems=0), send(truncate=10), send(extra=3, version=1, type=2), send(job=8), send(rank=1)]
    p = [s.payload for s in parse(vec(steps)).sends]
    assert p[0][10:12] == b"\x00\x00" and len(p[0]) == HEADER_LEN + 4 * K
    assert len(p[1]) == 10
    assert (p[2][0], p[2][1], len(p[2])) == (1, 2, HEADER_LEN + 4 * K + 3)
    assert Header.unpack(p[3]).rank == 0  # unknown job: the rank defaults to the endpoint
    assert Header.unpack(p[4]).rank == 1


NO_RANK = {"to": [5], "job": 7, "slot": 16, "values": {"fill": 0}}
REINSTALL = [{"remove": 7}, {"install": job(7, 16, 4, 2)}]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (vec([send(values={"fill": 2**31})]), "not an int32"),
        (vec([send(values=[1, 2])]), "needs k=4 entries"),
        (vec([send(values={"lanes16": [2**15]})]), "lane 0 = 32768 is not in -32768..32767"),
        (vec([send(values={"lanes8": [0] * 13})]), "lane list needs at most 12 entries"),
        (vec([send(values={"lanes8": [], "scales": [256]})]), "scale 0 = 256 is not in 0..255"),
        (vec([send(values={"lanes8": [], "scales": [0] * 5})]), "scale list needs at most 4 entries"),
        (vec([send(values={"lanes8": [], "exp": 1})]), "unknown keys"),
        (vec([send(values={"lanes8": [], "lanes16": []})]), "values must be"),
        (vec([send(colour=1)]), "unknown keys"),
        (vec([{"send": {"from": 0, "job": 7, "slot": 16}}]), "'expect' must be a list"),
        (vec([{"send": {"from": 0, "job": 7}, "expect": []}]), "missing 'slot'"),
        (vec([send([NO_RANK])]), "endpoint 5 holds no rank of job 7"),
        (vec([{"remove": 8}]), "not installed"),
        (vec([{"install": job(8, 19, 2)}]), "overlap"),
        (vec([{"install": job(8, 1020, 8)}]), "slot_count"),
        (vec([{"install": job(8, 0, 1, 0)}]), "generation"),
        (vec([{"install": job(8, 0, 1, endpoints=[1, 1])}]), "distinct"),
        (vec(REINSTALL, counters={"jobs": {"7": {"aggregated": 0}}}), "installed more than once"),
        (vec([], counters={"drops": {"bad_luck": 1}}), "unknown keys"),
        (vec([{**send(), "remove": 7}]), "exactly one of"),
    ],
)
def test_bad_vectors_get_clear_errors(data: dict[str, Any], message: str) -> None:
    with pytest.raises(VectorError, match=message):
        parse(data)


def test_files(tmp_path: Path) -> None:
    with pytest.raises(VectorError, match="no \\*.json"):
        load_vectors(tmp_path)
    (tmp_path / "a.json").write_text(json.dumps(vec([])))
    (tmp_path / "b.json").write_text(json.dumps(vec([])))
    with pytest.raises(VectorError, match="duplicate vector names"):
        load_vectors(tmp_path)
    (tmp_path / "c.json").write_text("{")
    with pytest.raises(VectorError, match="c.json: not valid JSON"):
        load_vector(tmp_path / "c.json")
