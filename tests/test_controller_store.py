"""The controller's SQLite store: jobs, workers and the generation counter survive reopening."""

from __future__ import annotations

from pathlib import Path

from switchagg_controller.model import Job, WorkerAddr
from switchagg_controller.store import MAX_GENERATION, JobRecord, Store


def _job(job_id: int, name: str, base: int) -> Job:
    workers = (WorkerAddr(0, "10.0.0.1", 4000, "02:00:00:00:00:01", 1), WorkerAddr(1, "10.0.0.2", 4001))
    return Job(job_id, name, 2, base, 16, 64, 9, workers, counter_index=3)


def test_jobs_round_trip_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "ctl.db"
    s = Store(path)
    s.save(JobRecord(_job(1, "a", 0), "p4"))
    s.save(JobRecord(_job(2, "b", 16), "software", {1}))
    s.mark_left(1, 0)
    s.close()
    s = Store(path)
    records = {r.job.job_id: r for r in s.load()}
    assert records[1].job == _job(1, "a", 0) and records[1].data_plane == "p4" and records[1].left == {0}
    assert (
        records[2].job == _job(2, "b", 16) and records[2].data_plane == "software" and records[2].left == {1}
    )
    s.delete(1)
    assert [r.job.job_id for r in s.load()] == [2]
    s.close()


def test_member_token_hashes_and_clients_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "ctl.db"
    s = Store(path)
    tokens, clients = {0: "ab" * 32, 1: "cd" * 32}, {0: "10.0.0.1", 1: "unix"}
    s.save(JobRecord(_job(1, "a", 0), "software", tokens=tokens, clients=clients))
    s.mark_left(1, 1)
    s.close()
    s = Store(path)
    (record,) = s.load()
    assert (record.tokens, record.clients, record.left) == (tokens, clients, {1})
    s.close()


def test_save_replaces_a_job(tmp_path: Path) -> None:
    s = Store(tmp_path / "ctl.db")
    s.save(JobRecord(_job(1, "a", 0), "p4"))
    newer = _job(1, "a", 0)
    newer = Job(
        newer.job_id, newer.name, newer.n, newer.slot_base, newer.slot_count, newer.k, 10, newer.workers, 3
    )
    s.save(JobRecord(newer, "p4"))
    assert [r.job.generation for r in s.load()] == [10]
    s.close()


def test_generations_are_non_zero_16_bit_and_persist(tmp_path: Path) -> None:
    path = tmp_path / "ctl.db"
    s = Store(path)
    assert [s.next_generation() for _ in range(3)] == [1, 2, 3]
    s.close()
    s = Store(path)
    assert s.next_generation() == 4  # a restarted controller never reuses a recent generation
    s._db.execute("UPDATE meta SET value = ? WHERE key = 'generation'", (MAX_GENERATION - 1,))
    assert [s.next_generation() for _ in range(3)] == [MAX_GENERATION, 1, 2]  # wraps, skipping 0
    s.close()
