"""A hostile neighbour: ``python -m switchagg_lab.testing.flood CONFIG_JSON`` sends a bounded flood of
foreign datagrams at an aggregator (and forged results at its workers) from its own sockets.

Config keys: aggregator=[ip, port], workers=[[ip, port], ...], job, n, slot_base, slots, k,
count (datagrams, the bound), seconds (time bound), seed, bind (source ip, default 127.0.0.1).
Prints one JSON line: how many datagrams of each kind it sent.

The kinds: random bytes; headers with a wrong version, type, job, rank, slot or length; and
well-formed DATA for the job, with a valid rank, slot and set, any offset and a random payload
(what a learnt-address data plane would have summed); plus well-formed RESULTs sent straight to
the workers. None may change a sum.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections import Counter

import numpy as np

from switchagg import protocol
from switchagg.protocol import Header


def _packet(rng: np.random.Generator, cfg: dict, kind: str) -> bytes:
    k, n = cfg["k"], cfg["n"]
    values = rng.integers(-(2**31), 2**31, k, dtype=np.int64).tolist()
    h = Header(
        job=cfg["job"],
        rank=int(rng.integers(0, n)),
        slot=cfg["slot_base"] + int(rng.integers(0, cfg["slots"])),
        shadow=int(rng.integers(0, 2)),
        offset=int(rng.integers(0, 2**32)),
        exp=int(rng.integers(-128, 128)),
        values=values,
    )
    if kind == "random":
        return rng.bytes(int(rng.integers(0, 2 * k + 64)))
    if kind == "bad_version":
        h.version = (protocol.VERSION + int(rng.integers(1, 256))) % 256  # any but the real one
    elif kind == "bad_type":
        h.type = int(rng.choice([0, protocol.MSG_RESULT, 3, 255]))
    elif kind == "unknown_job":
        h.job = (cfg["job"] + 1 + int(rng.integers(0, 1000))) & 0xFFFF
    elif kind == "bad_rank":
        h.rank = int(rng.integers(n, 0x10000))
    elif kind == "bad_pool":
        h.slot = (cfg["slot_base"] + cfg["slots"] + int(rng.integers(0, 100))) & protocol.POOL_SLOT_MASK
    elif kind == "truncated":
        return h.pack()[: int(rng.integers(protocol.HEADER_LEN, protocol.HEADER_LEN + 4 * k))]
    elif kind == "result":
        h.type = protocol.MSG_RESULT
    return h.pack()  # "data": well-formed, only the source address is wrong


KINDS = ["random", "bad_version", "bad_type", "unknown_job", "bad_rank", "bad_pool", "truncated", "data"]


def main() -> int:
    cfg = json.loads(sys.argv[1])
    rng = np.random.default_rng(cfg.get("seed", 1))
    agg = tuple(cfg["aggregator"])
    workers = [tuple(w) for w in cfg.get("workers", [])]
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(4)]
    for s in socks:
        s.bind((cfg.get("bind", "127.0.0.1"), 0))
        s.setblocking(False)
    sent: Counter[str] = Counter()
    kinds = KINDS + (["result"] if workers else [])
    # Half of the flood is well-formed DATA: the kind that a learnt-address data plane would sum.
    weights = np.array([0.5 / (len(kinds) - 1)] * len(kinds))
    weights[kinds.index("data")] = 0.5
    weights /= weights.sum()
    end = time.monotonic() + cfg["seconds"]
    for i in range(cfg["count"]):
        if time.monotonic() > end:
            break
        kind = str(rng.choice(kinds, p=weights))
        target = workers[int(rng.integers(0, len(workers)))] if kind == "result" else agg
        try:
            socks[i % len(socks)].sendto(_packet(rng, cfg, kind), target)
            sent[kind] += 1
        except BlockingIOError:
            sent["would_block"] += 1
            time.sleep(0.001)
        if i % 64 == 63:
            time.sleep(0.0005)  # a neighbour, not a denial of service: leave the cores to the job
    print(json.dumps(dict(sent)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
