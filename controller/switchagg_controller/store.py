"""SQLite persistence of the controller's own state, so a restarted controller picks up its jobs.

What is stored: every installed job (id, name, data plane, slot range, K, generation, counter
index, result key, a striped job's shards), its workers' addresses, whether each has left, the
hash of each one's member token and the client its Join came from, and the generation counter.
Pending joins are not stored: a worker still waiting in Join sees its call fail and joins again.

The schema only grows: a column added later is added to an older file when it is opened, with
a default that means what the older controller did (``result_key`` 0: the job is unkeyed, as its
workers, told no key, expect; ``token_hash`` '': the worker was told no member token, and its
heartbeats and leave are taken with the join secret alone).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from switchagg_controller.model import Job, JobShard, WorkerAddr

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, data_plane TEXT NOT NULL,
    n INTEGER NOT NULL, slot_base INTEGER NOT NULL, slot_count INTEGER NOT NULL, k INTEGER NOT NULL,
    generation INTEGER NOT NULL, counter_index INTEGER NOT NULL,
    result_key INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS workers (
    job_id INTEGER NOT NULL REFERENCES jobs(job_id) ON DELETE CASCADE, rank INTEGER NOT NULL,
    ip TEXT NOT NULL, udp_port INTEGER NOT NULL, mac TEXT NOT NULL, switch_port INTEGER NOT NULL,
    left_job INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (job_id, rank));
"""

MAX_GENERATION = 0xFFFF

# Columns added after the first schema: (table, column, definition), added to older files on open.
_ADDED_COLUMNS = (
    ("jobs", "result_key", "INTEGER NOT NULL DEFAULT 0"),
    ("jobs", "shards", "TEXT NOT NULL DEFAULT ''"),  # a striped job's shards as JSON; '': none
    ("workers", "token_hash", "TEXT NOT NULL DEFAULT ''"),  # jobs.token_hash of its member token
    ("workers", "client", "TEXT NOT NULL DEFAULT ''"),  # where its Join came from (quotas)
)
_WORKER_COLUMNS = "job_id, rank, ip, udp_port, mac, switch_port, left_job, token_hash, client"
_JOB_COLUMNS = (
    "job_id, name, data_plane, n, slot_base, slot_count, k, generation, counter_index, result_key, shards"
)


def _shards_json(shards: tuple[JobShard, ...]) -> str:
    return json.dumps([dataclasses.asdict(s) for s in shards]) if shards else ""


def _shards_from(text: str) -> tuple[JobShard, ...]:
    if not text:
        return ()
    return tuple(
        JobShard(
            d["node"], d["slot_base"], d["slot_count"], d["key"], tuple(d["ports"]), tuple(d.get("ips", ()))
        )
        for d in json.loads(text)
    )


@dataclass
class JobRecord:
    """A job as the controller keeps it: the installed Job plus bookkeeping."""

    job: Job
    data_plane: str  # allocation.P4 or allocation.SOFTWARE
    left: set[int] = field(default_factory=set)  # ranks that called Leave
    tokens: dict[int, str] = field(default_factory=dict)  # rank -> its member token's hash
    clients: dict[int, str] = field(default_factory=dict)  # rank -> where its Join came from


class Store:
    """One SQLite file; every method is a transaction. Used from the controller's event loop only
    (each call is one short local transaction), so it needs no lock."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.executescript(_SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            for table, column, definition in _ADDED_COLUMNS:
                have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
                if column not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")

    def close(self) -> None:
        self._db.close()

    def next_generation(self) -> int:
        """The next non-zero 16-bit generation; persisted so a restart never reuses a recent one."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            row = self._db.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()
            gen = (row[0] if row else 0) % MAX_GENERATION + 1
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('generation', ?)", (gen,))
            return int(gen)

    def save(self, record: JobRecord) -> None:
        """Inserts or replaces a job and its workers."""
        j = record.job
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM jobs WHERE job_id = ?", (j.job_id,))
            self._db.execute(
                f"INSERT INTO jobs ({_JOB_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    j.job_id,
                    j.name,
                    record.data_plane,
                    j.n,
                    j.slot_base,
                    j.slot_count,
                    j.k,
                    j.generation,
                    j.counter_index,
                    j.key,
                    _shards_json(j.shards),
                ),
            )
            self._db.executemany(
                f"INSERT INTO workers ({_WORKER_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        j.job_id,
                        w.rank,
                        w.ip,
                        w.udp_port,
                        w.mac,
                        w.switch_port,
                        int(w.rank in record.left),
                        record.tokens.get(w.rank, ""),
                        record.clients.get(w.rank, ""),
                    )  # fmt: skip
                    for w in j.workers
                ],
            )

    def mark_left(self, job_id: int, rank: int) -> None:
        with self._db:
            self._db.execute("UPDATE workers SET left_job = 1 WHERE job_id = ? AND rank = ?", (job_id, rank))

    def delete(self, job_id: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))

    def load(self) -> list[JobRecord]:
        jobs = self._db.execute(f"SELECT {_JOB_COLUMNS} FROM jobs ORDER BY job_id").fetchall()
        workers = self._db.execute(f"SELECT {_WORKER_COLUMNS} FROM workers ORDER BY job_id, rank").fetchall()
        by_job: dict[int, list[tuple[WorkerAddr, bool, str, str]]] = {}
        for job_id, rank, ip, port, mac, switch_port, left, token, client in workers:
            by_job.setdefault(job_id, []).append(
                (WorkerAddr(rank, ip, port, mac, switch_port), bool(left), token, client)
            )
        records = []
        for job_id, name, data_plane, n, base, count, k, gen, counter_index, key, shards in jobs:
            ws = by_job.get(job_id, [])
            job = Job(
                job_id,
                name,
                n,
                base,
                count,
                k,
                gen,
                tuple(w for w, *_ in ws),
                counter_index,
                key,
                _shards_from(shards),
            )
            records.append(
                JobRecord(
                    job,
                    data_plane,
                    {w.rank for w, left, *_ in ws if left},
                    {w.rank: token for w, _, token, _ in ws},
                    {w.rank: client for w, *_, client in ws},
                )
            )
        return records
