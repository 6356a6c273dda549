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
    from switchagg.torch.liveness import PeerWatch

# The job id an embedded aggregator gives its only job.
EMBEDDED_JOB = 1
# Published instead of an address or a confirmation when a rank failed to start.
FAILED_MARK = "!"


class Exchange(Protocol):
    """How the ranks of a group swap small strings while the data plane opens: the backend uses
    the c10d store, the hook the process group's own collectives. Each call is collective."""

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
    describe the group's job), plus the aggregator this rank runs (embedded mode: rank 0, and with
    SWITCHAGG_SHARDS the other hosting ranks). In job service mode each lane's session heartbeats
    and leaves its job when closed."""

    lanes: Lanes
    aggregator: SoftwareAggregator | None = None
    # SWITCHAGG_WIRE_BITS: the lanes of every float call, or None: each dtype's own (widths.py)
    wire_bits: int | None = None

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


def wire_bits_wanted() -> int | None:
    """SWITCHAGG_WIRE_BITS: the lanes every float tensor travels in, 32, 16 or 8; unset (None), float32
    travels in 32-bit lanes and bfloat16/float16 in 16-bit lanes (docs/TORCH.md, Lane widths)."""
    raw = os.environ.get("SWITCHAGG_WIRE_BITS", "").strip()
    if not raw:
        return None
    widths = ", ".join(map(str, protocol.WIRE_BITS))
    if not raw.isdigit() or int(raw) not in protocol.WIRE_BITS:
        raise ValueError(f"SWITCHAGG_WIRE_BITS={raw!r} is not one of {widths}")
    return int(raw)


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


def check_reachable(host: str, publisher: str, mine: str, hosting_rank: int = 0) -> None:
    """``hosting_rank``'s aggregator listens on ``host``; a loopback address is reachable from its own
    network stack only (``publisher`` and ``mine`` are network_identity()s; empty: unknown, not
    checked)."""
    if host.startswith("127.") and publisher and mine and publisher != mine:
        raise RuntimeError(
            f"rank {hosting_rank}'s embedded switchagg aggregator listens on {host}, a loopback address, "
            "and this rank runs on another host (or network namespace), so it could not reach it: set "
            f"SWITCHAGG_BIND to an address of rank {hosting_rank}'s host that every rank can reach (unset, "
            "it is the address routed "
            f"toward MASTER_ADDR={os.environ.get('MASTER_ADDR', '')!r}, loopback when that is local)"
        )


def _start_aggregator() -> SoftwareAggregator:
    from switchagg.aggregator import SoftwareAggregator

    return SoftwareAggregator(host=os.environ.get("SWITCHAGG_BIND") or default_bind(), port=0).start()


def _embedded_layout(lanes: int, mtu_k: int = protocol.DEFAULT_SW_K) -> tuple[int, int]:
    """(K, slots per lane) from SWITCHAGG_K and SWITCHAGG_SLOTS, the window split over the lanes;
    unset, K is ``mtu_k`` (what the ranks' path MTUs allow) and the window protocol.window_slots(K)."""
    k = _env_int("SWITCHAGG_K", mtu_k, 1, protocol.MAX_K)
    slots = _env_int("SWITCHAGG_SLOTS", protocol.window_slots(k), 1, protocol.POOL_SLOT_MASK + 1)
    per_lane = slots if lanes == 1 else lane_slots(slots, lanes)
    if per_lane * lanes > protocol.POOL_SLOT_MASK + 1:
        raise ValueError(
            f"SWITCHAGG_LANES={lanes} lanes of {per_lane} slots (SWITCHAGG_SLOTS={slots}) exceed the "
            f"aggregator's {protocol.POOL_SLOT_MASK + 1} slots"
        )
    return k, per_lane


def shards_wanted(world_size: int) -> int:
    """SWITCHAGG_SHARDS in embedded mode: the aggregators the group's ranks host, each summing its
    stripe of every tensor (default 1, rank 0's; 0 also means 1; at most one per rank)."""
    return max(1, _env_int("SWITCHAGG_SHARDS", 1, 0, world_size))


def shard_hosts(world_size: int, shards: int) -> list[int]:
    """The rank hosting each shard: evenly spaced from rank 0, so that under torchrun, which numbers
    each node's ranks consecutively, the shards fall on different nodes as long as there are as many."""
    return [s * world_size // shards for s in range(shards)]


def _embedded_key(key: int, lane: int, shard: int) -> int:
    """The result key of lane ``lane``'s job on shard ``shard``'s aggregator (lane 0 shard 0: the group's)."""
    from switchagg.striping import shard_key

    return shard_key(shard_key(key, lane), shard)


def _parse_host_entry(text: str, rank: int) -> tuple[tuple[str, int], str]:
    """A hosting rank's "HOST:PORT NETWORK": its aggregator's address and its network_identity()."""
    address, _, network = text.partition(" ")
    return parse_host_port(address, f"rank {rank}'s aggregator address"), network


def _agreed_k(exchange: Exchange, addresses: list[tuple[str, int]]) -> int:
    """The K every rank uses: the largest whose packets fit the MTU of every rank's route to every
    aggregator (a rank beside its aggregator goes through loopback, the others through the network)."""
    from switchagg.session import path_mtu

    try:
        bind = _worker_bind(addresses[0][0])[0]
        mine = str(min(protocol.k_for_mtu(path_mtu(bind, a)) for a in addresses))
    except (OSError, ValueError) as e:
        mine = f"{FAILED_MARK}rank {os.environ.get('RANK', '?')}: no path MTU toward the aggregator: {e}"
    return min(int(v) for v in _gathered(exchange, mine, "find the path MTU"))


def _gathered(exchange: Exchange, mine: str, what: str) -> list[str]:
    """Gathers every rank's string; if any rank failed (FAILED_MARK), every rank raises with why."""
    values = exchange.gather(mine)
    failed = [v[1:] for v in values if v.startswith(FAILED_MARK)]
    if failed:
        raise RuntimeError(f"switchagg ranks could not {what}: {'; '.join(failed)}")
    return values


def _host_aggregators(
    rank: int, exchange: Exchange, hosts: list[int]
) -> tuple[SoftwareAggregator | None, list[tuple[str, int]], list[str]]:
    """Each hosting rank starts its shard's aggregator; every rank returns (its own aggregator or
    None, the shards' addresses, the hosts' network_identity()s)."""
    aggregator, mine = None, "-"
    if rank in hosts:
        try:
            aggregator = _start_aggregator()
            host, port = aggregator.address
            mine = f"{host}:{port} {network_identity()}"
        except Exception as e:
            mine = f"{FAILED_MARK}rank {rank} could not start its switchagg aggregator: {e!r}"
    try:
        values = _gathered(exchange, mine, "start their aggregators")
        entries = [_parse_host_entry(values[h], h) for h in hosts]
    except BaseException:
        if aggregator is not None:
            aggregator.stop()
        raise
    return aggregator, [e[0] for e in entries], [e[1] for e in entries]


def _install_lanes(
    aggregator: SoftwareAggregator,
    shard: int,
    addresses: list[str],
    world_size: int,
    k: int,
    per_lane: int,
    key: int,
) -> None:
    """One job per lane on this rank's aggregator (shard ``shard``), each rank pinned to its socket
    of that lane and shard. ``addresses``: per rank, "A+B+...,A+B+..." (lanes, then shards)."""
    generation = random.randint(1, 0xFFFF)
    per_rank = [[lane.split("+") for lane in a.split(",")] for a in addresses]
    for lane in range(len(per_rank[0])):
        pinned = [
            parse_host_port(a[lane][shard], f"rank {r}'s address (lane {lane}, shard {shard})")
            for r, a in enumerate(per_rank)
        ]
        aggregator.add_job(
            EMBEDDED_JOB + lane, world_size, lane * per_lane, per_lane, k, generation, pinned,
            key=_embedded_key(key, lane, shard),
        )  # fmt: skip


def _open_embedded(
    rank: int, world_size: int, exchange: Exchange, timeout: float, group_tag: str, lanes: int, key: int
) -> DataPlane:
    """The group's ranks host the aggregators (SWITCHAGG_SHARDS: rank 0's alone by default); the
    jobs are installed only once every rank's address is known, so that each aggregator accepts
    each rank from its own socket alone (docs/PROTOCOL.md, Security).

    With several lanes every lane is a job of its own on each aggregator (job EMBEDDED_JOB + lane, a
    slot range of its own out of the window split over the lanes, a result key derived from the
    group's). With several shards every tensor is striped over the aggregators (switchagg.striping)
    and every rank opens one socket per lane and shard. ``key``: the group's result key, derived by
    every rank from the secret its liveness connections carried: it never passes through the store."""
    from switchagg.session import Session
    from switchagg.striping import Shard

    k, per_lane = _embedded_layout(lanes)
    hosts = shard_hosts(world_size, shards_wanted(world_size))
    aggregator = None
    sessions: list[Session] = []
    try:
        aggregator, addresses, networks = _host_aggregators(rank, exchange, hosts)
        if not os.environ.get("SWITCHAGG_K"):  # K by MTU: the least any rank's path to any aggregator allows
            k, per_lane = _embedded_layout(lanes, _agreed_k(exchange, addresses))
        try:
            mine_network = network_identity()
            for host, address, network in zip(hosts, addresses, networks, strict=True):
                check_reachable(address[0], network, mine_network, host)
            for lane in range(lanes):
                shards = [
                    Shard(a, lane * per_lane, per_lane, _embedded_key(key, lane, s))
                    for s, a in enumerate(addresses)
                ]
                session = Session(
                    EMBEDDED_JOB + lane, rank, world_size, shards=shards, k=k, timeout=timeout,
                    bind=_worker_bind(addresses[0][0]),
                )  # fmt: skip
                sessions.append(session)
                session.job_name = default_job_name(group_tag)  # tells the groups apart in the metrics
            mine = ",".join("+".join("{}:{}".format(*a) for a in s.local_addresses) for s in sessions)
        except Exception as e:
            mine = f"{FAILED_MARK}rank {rank}: {type(e).__name__}: {e}"
        gathered = _gathered(exchange, mine, "open their data plane")
        installed = "installed"
        if aggregator is not None:
            try:
                _install_lanes(aggregator, hosts.index(rank), gathered, world_size, k, per_lane, key)
            except Exception as e:
                installed = f"{FAILED_MARK}rank {rank} could not install the switchagg job: {e!r}"
        _gathered(exchange, installed, "install the switchagg job")
    except BaseException:
        for session in sessions:
            session.close()
        if aggregator is not None:
            aggregator.stop()
        exchange.settle()
        raise
    assert len(sessions) == lanes  # a rank without its sessions raised above
    return DataPlane(Lanes(sessions), aggregator)


def listen_address() -> str:
    """Where rank 0 listens for its peers' liveness connections: SWITCHAGG_BIND, else default_bind()."""
    return os.environ.get("SWITCHAGG_BIND") or default_bind()


def open_data_plane(
    rank: int,
    world_size: int,
    exchange: Exchange,
    group_tag: str,
    call_timeout: float | None = None,
    watch: PeerWatch | None = None,
) -> DataPlane:
    """Open this rank's data plane; collective: every rank of the group must call it. ``call_timeout``:
    seconds without progress before a call fails (the process group's timeout; default SWITCHAGG_TIMEOUT).
    ``watch``: the group's liveness.PeerWatch, not yet connected: it connects first (its secret gives
    the embedded job's key); None: one is made for the start-up and closed after it."""
    from switchagg.session import Session
    from switchagg.torch.liveness import PeerWatch, derive_key

    gone_after = session_timeout()  # checks the variables before anything is exchanged
    lanes = lanes_wanted()
    wire_bits = wire_bits_wanted()
    # The C worker takes finite timeouts below 1e9 s; a longer process group timeout means "wait".
    timeout = min(call_timeout, 1e8) if call_timeout is not None and call_timeout > 0 else gone_after
    service = os.environ.get("SWITCHAGG_JOB_SERVICE")
    if service:
        unix = service.startswith("unix:")
        service_host = "" if unix else parse_host_port(service, "SWITCHAGG_JOB_SERVICE")[0]
        secret = _read_secret()
    else:
        _embedded_layout(lanes)  # SWITCHAGG_K and SWITCHAGG_SLOTS
        shards_wanted(world_size)
    own_watch = watch is None
    if watch is None:
        watch = PeerWatch(rank, world_size, gone_after, lambda _: None)
    watch.connect(exchange, listen_address)
    try:
        if not service:
            key = derive_key(watch.secret, f"result key {group_tag}")
            plane = _open_embedded(rank, world_size, exchange, timeout, group_tag, lanes, key)
            plane.wire_bits = wire_bits
            return plane
    finally:
        if own_watch:
            watch.close()
    name = os.environ.get("SWITCHAGG_JOB_NAME") or default_job_name(group_tag)
    bind = _worker_bind(service_host)
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
    return DataPlane(Lanes(sessions), wire_bits=wire_bits)
