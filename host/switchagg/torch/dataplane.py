"""Choosing and opening the switchagg data plane for a torch process group (env vars: docs/TORCH.md)."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from switchagg import protocol

if TYPE_CHECKING:
    from switchagg import jobclient
    from switchagg.aggregator import SoftwareAggregator
    from switchagg.session import Session

# The job id an embedded aggregator gives its only job.
EMBEDDED_JOB = 1
# Published instead of an address when rank 0 failed to start the aggregator.
FAILED_MARK = "!"

# share(value): rank 0 passes the string to publish and gets it back; the other ranks pass None
# and get rank 0's string. The backend implements it with the c10d store, the hook with a broadcast.
Share = Callable[[str | None], str]


@dataclass
class DataPlane:
    """One rank's Session, plus what keeps its job alive: the aggregator this rank runs (embedded
    mode, rank 0), or the job service membership (heartbeats so idle phases are not reaped)."""

    session: Session
    aggregator: SoftwareAggregator | None = None
    heartbeat: jobclient.Heartbeat | None = None
    service: tuple[str, str] | None = None  # (address, secret) to leave the job on close

    def close(self) -> None:
        self.session.close()
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if self.service is not None:
            from switchagg import jobclient  # needs grpc: imported only in job service mode

            service, self.service = self.service, None
            try:
                jobclient.leave(service[0], service[1], self.session.assignment)
            except jobclient.JobServiceError:
                pass  # the job is gone already (torn down, reaped, service restarted): nothing to leave
        if self.aggregator is not None:
            self.aggregator.stop()
            self.aggregator = None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def _env_int(name: str, default: int, low: int, high: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if not low <= value <= high:
        raise ValueError(f"{name}={raw!r} must be within [{low}, {high}]")
    return value


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}={text!r} is not host:port")
    return host, int(port)


def session_timeout() -> float:
    return _env_float("SWITCHAGG_TIMEOUT", 10.0)


def _read_secret() -> str:
    secret = os.environ.get("SWITCHAGG_SECRET")
    if secret:
        return secret
    path = os.environ.get("SWITCHAGG_SECRET_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ValueError(f"SWITCHAGG_SECRET_FILE={path!r} cannot be read: {e}") from e
        if not secret:
            raise ValueError(f"SWITCHAGG_SECRET_FILE={path!r} is empty")
        return secret
    raise ValueError("SWITCHAGG_JOB_SERVICE is set but neither SWITCHAGG_SECRET nor SWITCHAGG_SECRET_FILE is")


def default_job_name(group_tag: str) -> str:
    """A name every rank of one torchrun derives alike, distinct per rendezvous and per group."""
    addr = os.environ.get("MASTER_ADDR", "localhost")
    port = os.environ.get("MASTER_PORT", "0")
    return f"torch-{addr}-{port}-{group_tag}"


def _worker_bind(aggregator_host: str) -> tuple[str, int]:
    host = os.environ.get("SWITCHAGG_WORKER_BIND")
    if host:
        return host, 0
    # Loopback aggregators answer loopback senders; anything else needs a routable source address.
    return ("127.0.0.1", 0) if aggregator_host.startswith("127.") else ("0.0.0.0", 0)


def _start_aggregator(world_size: int, slots: int, k: int) -> SoftwareAggregator:
    from switchagg.aggregator import SoftwareAggregator

    aggregator = SoftwareAggregator(host=os.environ.get("SWITCHAGG_BIND", "127.0.0.1"), port=0)
    aggregator.start()
    try:
        aggregator.add_job(EMBEDDED_JOB, world_size, 0, slots, k, random.randint(1, 0xFFFF))
    except BaseException:
        aggregator.stop()
        raise
    return aggregator


def open_data_plane(rank: int, world_size: int, share: Share, group_tag: str) -> DataPlane:
    """Open this rank's data plane; collective: every rank of the group must call it."""
    from switchagg.session import Session

    timeout = session_timeout()
    service = os.environ.get("SWITCHAGG_JOB_SERVICE")
    if service:
        service_host, _ = parse_host_port(service, "SWITCHAGG_JOB_SERVICE")
        name = os.environ.get("SWITCHAGG_JOB_NAME") or default_job_name(group_tag)
        bind = _worker_bind(service_host)
        from switchagg import jobclient

        secret = _read_secret()
        session = Session.from_job_service(
            service, secret, name, world_size, rank=rank, bind=bind, timeout=timeout
        )
        heartbeat = jobclient.Heartbeat(service, secret, session.assignment).start()
        return DataPlane(session, heartbeat=heartbeat, service=(service, secret))

    k = _env_int("SWITCHAGG_K", protocol.DEFAULT_SW_K, 1, protocol.MAX_K)
    slots = _env_int("SWITCHAGG_SLOTS", protocol.DEFAULT_SW_SLOTS, 1, protocol.POOL_SLOT_MASK + 1)
    aggregator = None
    if rank == 0:
        try:
            aggregator = _start_aggregator(world_size, slots, k)
        except Exception as e:
            share(f"{FAILED_MARK}{e!r}")  # so that the other ranks fail too instead of waiting
            raise
        host, port = aggregator.address
        share(f"{host}:{port}")
        address = (host, port)
    else:
        published = share(None)
        if published.startswith(FAILED_MARK):
            raise RuntimeError(f"rank 0 could not start the switchagg aggregator: {published[1:]}")
        address = parse_host_port(published, "published aggregator address")
    try:
        session = Session(
            EMBEDDED_JOB,
            rank,
            world_size,
            address,
            slot_base=0,
            slot_count=slots,
            k=k,
            timeout=timeout,
            bind=_worker_bind(address[0]),
        )
    except BaseException:
        if aggregator is not None:
            aggregator.stop()
        raise
    return DataPlane(session, aggregator)
