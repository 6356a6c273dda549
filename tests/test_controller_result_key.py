"""The per-job result key (issue 23, "only the real aggregator can answer"): the controller gives
every job a random non-zero 32-bit key when it creates it, installs it on the data plane with the
job, tells the workers in Join, keeps it across reinstalls (new generations) and controller
restarts (the store), and a worker uses only RESULTs that carry it."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
from pathlib import Path

import grpc
import numpy as np
import pytest

from switchagg import Session, SwitchaggTimeout, jobclient
from switchagg._proto import jobs_pb2_grpc
from switchagg.aggregator import MAX_KEY, SoftwareAggregator, new_key
from switchagg.aggregator_control import RemoteAggregator
from switchagg_controller import allocation
from switchagg_controller.jobs import JobManager
from switchagg_controller.model import Job, WorkerAddr
from switchagg_controller.planes import SoftwareDataPlane, reconcile_jobs
from switchagg_controller.service import make_server
from switchagg_controller.store import JobRecord, Store
from switchagg_lab.testing.checks import check_results
from switchagg_lab.testing.control import ControlledAggregator
from switchagg_lab.testing.controller import SECRET, Controller, aio_join
from switchagg_lab.testing.kit import free_port
from switchagg_lab.testing.local import run_job


def test_new_keys_are_random_non_zero_32_bit() -> None:
    keys = {new_key() for _ in range(1000)}
    assert 0 not in keys and all(0 < k <= MAX_KEY for k in keys)
    assert len(keys) > 990  # random, not a counter or a constant
    assert max(keys) > 2**31  # all 32 bits used


# ---- the store ----------------------------------------------------------------------------


def _job(job_id: int, key: int) -> Job:
    workers = (WorkerAddr(0, "10.0.0.1", 4000), WorkerAddr(1, "10.0.0.2", 4001))
    return Job(job_id, f"j{job_id}", 2, 16 * job_id, 16, 64, 9, workers, counter_index=1, key=key)


def test_the_key_is_stored_with_the_job(tmp_path: Path) -> None:
    s = Store(tmp_path / "ctl.db")
    s.save(JobRecord(_job(1, 0xFFFFFFFF), "software"))
    s.save(JobRecord(_job(2, 0x12345678), "p4"))
    s.close()
    s = Store(tmp_path / "ctl.db")
    assert {r.job.job_id: r.job.key for r in s.load()} == {1: 0xFFFFFFFF, 2: 0x12345678}
    s.close()


def test_a_store_from_before_keys_opens_and_its_jobs_stay_unkeyed(tmp_path: Path) -> None:
    """A state file written by a controller without keys: the column is added on open, and its
    jobs keep key 0 (their workers were told no key), while new jobs get theirs."""
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
        CREATE TABLE jobs (
            job_id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, data_plane TEXT NOT NULL,
            n INTEGER NOT NULL, slot_base INTEGER NOT NULL, slot_count INTEGER NOT NULL, k INTEGER NOT NULL,
            generation INTEGER NOT NULL, counter_index INTEGER NOT NULL);
        CREATE TABLE workers (
            job_id INTEGER NOT NULL REFERENCES jobs(job_id) ON DELETE CASCADE, rank INTEGER NOT NULL,
            ip TEXT NOT NULL, udp_port INTEGER NOT NULL, mac TEXT NOT NULL, switch_port INTEGER NOT NULL,
            left_job INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (job_id, rank));
        INSERT INTO meta VALUES ('generation', 41);
        INSERT INTO jobs VALUES (3, 'legacy', 'software', 1, 0, 8, 64, 41, 0);
        INSERT INTO workers VALUES (3, 0, '127.0.0.1', 4000, '', -1, 0);
        """
    )
    old.commit()
    old.close()
    s = Store(path)
    (record,) = s.load()
    assert record.job.name == "legacy" and record.job.key == 0 and record.job.generation == 41
    assert record.tokens == {0: ""} and record.clients == {0: ""}  # told no member token: none checked
    assert s.next_generation() == 42
    s.save(JobRecord(_job(4, 0xABCDEF01), "software"))
    assert {r.job.job_id: r.job.key for r in s.load()} == {3: 0, 4: 0xABCDEF01}
    s.close()
    s = Store(path)  # opening a migrated file again changes nothing
    assert {r.job.job_id: r.job.key for r in s.load()} == {3: 0, 4: 0xABCDEF01}
    s.close()


# ---- the job manager: Join, reinstall, reload ------------------------------------------------


async def test_join_reinstall_and_reload_keep_one_key_per_job(tmp_path: Path) -> None:
    """In process, so the test can read what the aggregator holds: the job service on this
    loop, a real SoftwareAggregator behind the software data plane."""
    with SoftwareAggregator("127.0.0.1", 0) as agg:
        store = Store(tmp_path / "ctl.db")
        plane = SoftwareDataPlane(agg, k=64, default_slots=8)
        manager = JobManager(store, [plane], join_timeout=30)
        server, port = make_server(manager, SECRET, "127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = jobs_pb2_grpc.JobServiceStub(channel)
                a = await asyncio.gather(
                    *(aio_join(stub, SECRET, "a", 2, "127.0.0.1", 43000 + r) for r in range(2))
                )
                job_id, key = a[0].job_id, a[0].result_key
                assert 0 < key <= MAX_KEY
                assert [r.result_key for r in a] == [key, key]  # every rank hears the same key
                assert agg.jobs()[job_id].key == key  # the one the data plane holds

                # A reinstall with a new generation (the data plane restarted) keeps the key.
                (bumped,) = manager.bump_generations(allocation.SOFTWARE)
                await plane.install(bumped)
                assert bumped.generation != a[0].generation and bumped.key == key
                assert agg.jobs()[job_id].key == key
                rank0 = next(r for r in a if r.rank == 0)
                assert manager.heartbeat(job_id, 0, rank0.member_token) == bumped.generation

                # Another job gets a key of its own.
                (b,) = await asyncio.gather(aio_join(stub, SECRET, "b", 1, "127.0.0.1", 43010))
                assert b.job_id != job_id and 0 < b.result_key != key
                assert agg.jobs()[b.job_id].key == b.result_key
        finally:
            await server.stop(0)
            store.close()

    # A restarted controller: the same store, a fresh aggregator; every job comes back with a
    # new generation and its old key.
    with SoftwareAggregator("127.0.0.1", 0) as agg2:
        store = Store(tmp_path / "ctl.db")
        try:
            manager = JobManager(store, [SoftwareDataPlane(agg2, k=64, default_slots=8)])
            reloaded = {j.job_id: j for j in await manager.reload()}
            assert reloaded[job_id].key == key and reloaded[job_id].generation != bumped.generation
            assert reloaded[b.job_id].key == b.result_key
            assert {j: info.key for j, info in agg2.jobs().items()} == {job_id: key, b.job_id: b.result_key}
        finally:
            store.close()


# ---- the data planes --------------------------------------------------------------------------


def test_the_workers_sum_only_with_the_installed_key(tmp_path: Path) -> None:
    """The C path: workers given the job's key sum exactly; a rank given another key drops every
    RESULT (``bad_key``) and fails its call."""
    tensors = [("int32", 3000)]
    (tmp_path / "ok").mkdir()
    (tmp_path / "bad").mkdir()
    with SoftwareAggregator("127.0.0.1", 0) as agg:
        done = run_job(agg, 5, 2, tensors, tmp_path / "ok", slots=4, k=256, key=0x5EC2E7)
        assert all(p.returncode == 0 for p in done), [p.stderr[-800:] for p in done]
        check_results(5, 2, 256, tensors, tmp_path / "ok")
        assert agg.jobs()[5].key == 0x5EC2E7
        agg.remove_job(5)
        done = run_job(
            agg, 6, 2, tensors, tmp_path / "bad", slots=4, k=256, key=0x5EC2E7, timeout=2.0,
            per_rank={1: {"key": 0x5EC2E7 ^ 1}},
        )  # fmt: skip
        assert done[1].returncode == 3 and "Timeout" in done[1].stderr, done[1].stderr[-800:]


def test_the_control_service_installs_lists_and_reconciles_the_key(tmp_path: Path) -> None:
    addrs = [("127.0.0.1", 5000), ("127.0.0.1", 5001)]
    with ControlledAggregator(tmp_path, "agg", SECRET) as p, RemoteAggregator(p.target, SECRET) as remote:
        remote.add_job(7, 2, 0, 8, 64, 1, addrs, key=0xFEEDF00D)
        assert remote.jobs()[7].key == 0xFEEDF00D
        # The job the controller wants has another key (another job got the id meanwhile): the
        # remote one is stale and replaced; one with the same key is left alone.
        workers = tuple(WorkerAddr(r, *a) for r, a in enumerate(addrs))
        want = Job(7, "j", 2, 0, 8, 64, 1, workers, key=0xFEEDF00D)

        def add(job: Job) -> None:
            remote.add_job(
                job.job_id, job.n, job.slot_base, job.slot_count, job.k, job.generation, addrs, key=job.key
            )

        assert reconcile_jobs(remote, {7: want}, add) == (0, 0)
        other = Job(7, "j", 2, 0, 8, 64, 2, workers, key=0x0DDBA11)
        assert reconcile_jobs(remote, {7: other}, add) == (1, 1)
        assert remote.jobs()[7].key == 0x0DDBA11


# ---- a real switchagg-ctl serve -----------------------------------------------------------------


def test_sessions_from_the_job_service_use_the_key_and_a_wrong_one_gets_nothing(tmp_path: Path) -> None:
    c = Controller(tmp_path, ["--software", "--software-listen", "127.0.0.1:0"]).start()
    try:
        with Session.from_job_service(c.address, SECRET, "keyed", 1, timeout=5.0) as s:
            assert 0 < s.assignment.key <= MAX_KEY
            x = np.arange(5000, dtype=np.int32)
            s.allreduce(x)
            assert x.tolist() == list(range(5000)) and s.stats()["bad_key"] == 0
            key = s.assignment.key
        # A worker that joined but uses another key: the aggregator answers (with the job's key),
        # the worker drops each answer and fails the call.
        port = free_port(socket.SOCK_DGRAM)
        a = jobclient.join(c.address, SECRET, "wrong", 1, "127.0.0.1", port, timeout=10)
        assert 0 < a.key != key
        with Session(
            a.job_id, a.rank, a.world_size, (a.aggregator_ip, a.aggregator_port), a.slot_base, a.slot_count,
            a.k, timeout=2.0, bind=("127.0.0.1", port), key=a.key ^ 0x80000000,
        ) as wrong:  # fmt: skip
            with pytest.raises(SwitchaggTimeout):
                wrong.allreduce(np.ones(100, dtype=np.int32))
            assert wrong.stats()["bad_key"] > 0
    finally:
        c.stop()
