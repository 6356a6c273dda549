"""Choosing and opening the switchagg data plane for a torch process group (env vars: docs/TORCH.md)."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from switchagg import protocol
from switchagg.lanes import MAX_LANES, Lanes, lane_slots

if TYPE_CHECKING:
    from switchagg.aggregator import SoftwareAggregator
    from switchagg.session import Session

# The job id an embedded aggregator gives its only job.
EMBEDDED_JOB = 1
# Published instead of an address when rank 0 failed to start the aggregator.
FAILED_MARK = "!"


class Exchange(Protocol):
    """How the ranks of a group swap small strings while the data plane opens: the backend uses
    the c10d store, the hook the process group's own collectives. Each call is collective."""

    def share(self, value: str | None) -> str:
        """Rank 0 passes the string to publish and gets it back; the others pass None and get it."""
        ...

    def gather(self, value: str) -> list[str]:
        """Every rank passes its string; every rank gets the list in rank order."""
        ...

    def settle(self) -> None:
        """Every rank calls it when the start-up failed (a failure is always seen by all ranks):
        rank 0 returns once the others have reached it, or after a bounded wait. Until then no rank
        may tear down what a slower rank is still building on (gloo's mesh, the store rank 0 serves)."""
        ...


# Lanes per group unless SWITCHAGG_LANES says (docs/TORCH.md).
DEFAULT_LANES = 1


@dataclass
class DataPlane:
    """One rank's lanes (``lanes``: one Session each; ``session`` is lane 0's, whose attributes
    describe the group's job), plus the aggregator this rank runs (embedded mode, rank 0). In job
    service mode each lane's session heartbeats and leaves its job when closed."""

    lanes: Lanes
    aggregator: SoftwareAggregator | None = None

    @property
    def session(self) -> Session:
        return self.lanes.sessions[0]

    def stats(self) -> dict[str, int]:
        """The lanes' counters, summed (``allreduces``: the group's network calls)."""
        return self.lanes.stats()

    def close(self) -> None:
        self.lanes.close()
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
    """SWITCHAGG_TIMEOUT: seconds without a heartbeat before a peer counts as gone (and, where no
    process group says otherwise, seconds without progress before a call fails)."""
    return _env_float("SWITCHAGG_TIMEOUT", 10.0)


def lanes_wanted() -> int:
    """SWITCHAGG_LANES: calls of a group on the wire at once (default DEFAULT_LANES)."""
    return _env_int("SWITCHAGG_LANES", DEFAULT_LANES, 1, MAX_LANES)


def lane_job_name(name: str, lane: int) -> str:
    """The job service's name for lane ``lane`` of job ``name``: lane 0 keeps the name."""
    return name if lane == 0 else f"{name}/lane{lane}"


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


def default_bind() -> str:
    """Where rank 0's embedded aggregator listens unless SWITCHAGG_BIND says: the local address the
    kernel routes toward MASTER_ADDR (where the other ranks reach this host's store), or loopback
    when MASTER_ADDR is (a UDP connect() sends nothing)."""
    master = os.environ.get("MASTER_ADDR", "").strip().strip("[]")
    if not master:
        return "127.0.0.1"
    try:
        ip = socket.gethostbyname(master)
        if ip.startswith("127."):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            local: str = s.getsockname()[0]
        return local
    except OSError as e:
        raise ValueError(
            f"switchagg cannot find the local address routed toward MASTER_ADDR={master!r} ({e}): set "
            "SWITCHAGG_BIND to the address of rank 0's host that every rank can reach"
        ) from e


def network_identity() -> str:
    """Which network stack this process sees: the boot and the network namespace. Two processes
    reach each other's loopback addresses only if theirs are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""  # unknown: not checked


def check_reachable(host: str, publisher: str, mine: str) -> None:
    """Rank 0's aggregator listens on ``host``; a loopback address is reachable from its own network
    stack only (``publisher`` and ``mine`` are network_identity()s; empty: unknown, not checked)."""
    if host.startswith("127.") and publisher and mine and publisher != mine:
        raise RuntimeError(
            f"rank 0's embedded switchagg aggregator listens on {host}, a loopback address, and this rank "
            "runs on another host (or network namespace), so it could not reach it: set SWITCHAGG_BIND to "
            "an address of rank 0's host that every rank can reach (unset, it is the address routed "
            f"toward MASTER_ADDR={os.environ.get('MASTER_ADDR', '')!r}, loopback when that is local)"
        )


def _start_aggregator() -> SoftwareAggregator:
    from switchagg.aggregator import SoftwareAggregator

    return SoftwareAggregator(host=os.environ.get("SWITCHAGG_BIND") or default_bind(), port=0).start()


def _parse_published(text: str) -> tuple[tuple[str, int], int, str]:
    """Rank 0's "HOST:PORT KEY NETWORK": the embedded aggregator's address, the job's result key and
    rank 0's network_identity()."""
    address, _, rest = text.partition(" ")
    key, _, network = rest.partition(" ")
    if not key.isdigit() or not 0 < int(key) <= 0xFFFFFFFF:
        raise RuntimeError(f"rank 0 published {text!r}, not HOST:PORT KEY (a non-zero 32-bit key)")
    return parse_host_port(address, "published aggregator address"), int(key), network


def _published(text: str, what: str) -> str:
    if text.startswith(FAILED_MARK):
        raise RuntimeError(f"rank 0 could not {what}: {text[1:]}")
    return text


def _embedded_layout(lanes: int) -> tuple[int, int]:
    """(K, slots per lane) from SWITCHAGG_K and SWITCHAGG_SLOTS, the window split over the lanes."""
    k = _env_int("SWITCHAGG_K", protocol.DEFAULT_SW_K, 1, protocol.MAX_K)
    slots = _env_int("SWITCHAGG_SLOTS", protocol.DEFAULT_SW_SLOTS, 1, protocol.POOL_SLOT_MASK + 1)
    per_lane = slots if lanes == 1 else lane_slots(slots, lanes)
    if per_lane * lanes > protocol.POOL_SLOT_MASK + 1:
        raise ValueError(
            f"SWITCHAGG_LANES={lanes} lanes of {per_lane} slots (SWITCHAGG_SLOTS={slots}) exceed the "
            f"aggregator's {protocol.POOL_SLOT_MASK + 1} slots"
        )
    return k, per_lane


def _publish_aggregator(
    rank: int, exchange: Exchange
) -> tuple[SoftwareAggregator | None, tuple[str, int], int, str]:
    """Rank 0 starts the aggregator and shares its address, the job's key and its network; every
    rank returns (the aggregator on rank 0 else None, address, key, network)."""
    if rank != 0:
        published = _published(exchange.share(None), "start the switchagg aggregator")
        return (None, *_parse_published(published))
    try:
        from switchagg.aggregator import new_key

        aggregator = _start_aggregator()
        key = new_key()  # the job's result key: only the group's ranks and the aggregator know it
    except Exception as e:
        exchange.share(f"{FAILED_MARK}{e!r}")  # so that the other ranks fail too instead of waiting
        raise
    host, port = aggregator.address
    return (aggregator, *_parse_published(exchange.share(f"{host}:{port} {key} {network_identity()}")))


def _install_lanes(
    aggregator: SoftwareAggregator,
    addresses: list[str],
    world_size: int,
    k: int,
    per_lane: int,
    key: int,
    lanes: int,
) -> None:
    """One job per lane on rank 0's aggregator, each rank pinned to its socket of that lane."""
    from switchagg.striping import shard_key

    per_rank = [a.split(",") for a in addresses]
    generation = random.randint(1, 0xFFFF)
    for lane in range(lanes):
        pinned = [
            parse_host_port(a[lane], f"rank {r}'s address (lane {lane})") for r, a in enumerate(per_rank)
        ]
        aggregator.add_job(
            EMBEDDED_JOB + lane, world_size, lane * per_lane, per_lane, k, generation, pinned,
            key=shard_key(key, lane),
        )  # fmt: skip


def _open_embedded(
    rank: int, world_size: int, exchange: Exchange, timeout: float, group_tag: str, lanes: int
) -> DataPlane:
    """Rank 0 runs the aggregator; the job is installed only once every rank's address is known, so
    that the aggregator accepts each rank from its own socket alone (docs/PROTOCOL.md, Security).

    With several lanes every lane is a job of its own on the aggregator (job EMBEDDED_JOB + lane, a
    slot range of its own out of the window split over the lanes, a result key derived from the
    group's), and every rank opens one socket per lane."""
    from switchagg.session import Session
    from switchagg.striping import shard_key

    k, per_lane = _embedded_layout(lanes)
    aggregator = None
    sessions: list[Session] = []
    try:
        aggregator, address, key, network = _publish_aggregator(rank, exchange)
        try:
            check_reachable(address[0], network, network_identity())
            for lane in range(lanes):
                session = Session(
                    EMBEDDED_JOB + lane, rank, world_size, address, slot_base=lane * per_lane,
                    slot_count=per_lane, k=k, timeout=timeout, bind=_worker_bind(address[0]),
                    key=shard_key(key, lane),
                )  # fmt: skip
                sessions.append(session)
                session.job_name = default_job_name(group_tag)  # tells the groups apart in the metrics
            mine = ",".join("{}:{}".format(*s.local_address) for s in sessions)
        except Exception as e:
            mine = f"{FAILED_MARK}rank {rank}: {type(e).__name__}: {e}"
        addresses = exchange.gather(mine)
        failed = [a[1:] for a in addresses if a.startswith(FAILED_MARK)]
        if failed:
            raise RuntimeError(f"switchagg ranks could not open their data plane: {'; '.join(failed)}")
        if aggregator is not None:
            try:
                _install_lanes(aggregator, addresses, world_size, k, per_lane, key, lanes)
            except Exception as e:
                exchange.share(f"{FAILED_MARK}{e!r}")
                raise
            exchange.share("installed")
        else:
            _published(exchange.share(None), "install the switchagg job")
    except BaseException:
        for session in sessions:
            session.close()
        if aggregator is not None:
            aggregator.stop()
        exchange.settle()
        raise
    assert len(sessions) == lanes  # a rank without its sessions raised above
    return DataPlane(Lanes(sessions), aggregator)


def open_data_plane(
    rank: int, world_size: int, exchange: Exchange, group_tag: str, call_timeout: float | None = None
) -> DataPlane:
    """Open this rank's data plane; collective: every rank of the group must call it. ``call_timeout``:
    seconds without progress before a call fails (the process group's timeout; default SWITCHAGG_TIMEOUT)."""
    from switchagg.session import Session

    gone_after = session_timeout()  # checks the variables before anything is exchanged
    lanes = lanes_wanted()
    # The C worker takes finite timeouts below 1e9 s; a longer process group timeout means "wait".
    timeout = min(call_timeout, 1e8) if call_timeout is not None and call_timeout > 0 else gone_after
    service = os.environ.get("SWITCHAGG_JOB_SERVICE")
    if not service:
        return _open_embedded(rank, world_size, exchange, timeout, group_tag, lanes)
    service_host = "" if service.startswith("unix:") else parse_host_port(service, "SWITCHAGG_JOB_SERVICE")[0]
    name = os.environ.get("SWITCHAGG_JOB_NAME") or default_job_name(group_tag)
    bind = _worker_bind(service_host)
    secret = _read_secret()
    # One job per lane, joined in lane order on every rank (each join waits for the whole group).
    sessions: list[Session] = []
    try:
        for lane in range(lanes):
            lane_name = lane_job_name(name, lane)
            sessions.append(
                Session.from_job_service(
                    service, secret, lane_name, world_size, rank=rank, bind=bind, timeout=timeout
                )
            )
    except BaseException:
        for session in sessions:
            session.close()
        raise
    return DataPlane(Lanes(sessions))
