"""A worker's view of one aggregation job: open a session, allreduce tensors in place."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from switchagg import _core, protocol
from switchagg.keys import UNKEYED, digest32, warn_unkeyed
from switchagg.striping import Shard, Stripes, shard_bounds

_METRICS_PORT_ENV = "SWITCHAGG_METRICS_PORT"
_METRICS_HOST_ENV = "SWITCHAGG_METRICS_HOST"
_KINDS = {np.dtype(np.float32): "f", np.dtype(np.int32): "i"}
_IP_MTU = getattr(socket, "IP_MTU", 14)  # Linux's value; the socket module names it on Linux only
# The retransmission timer's floor: a data-centre round trip is well under a millisecond, and the
# timer follows the measured one above this (TCP's 200 ms or the former 50 ms would idle a slot for
# hundreds of round trips per loss).
DEFAULT_RTO = 0.005
_PER_CALL = ("call", "allreduces")  # stats that count calls, not packets: one per call on every shard


def _as_array(tensor: Any) -> np.ndarray:
    """A writable, contiguous numpy view of a numpy array or CPU torch tensor (no copy)."""
    if type(tensor).__module__.startswith("torch"):
        if tensor.device.type != "cpu":
            raise TypeError(f"switchagg reduces CPU tensors; got a tensor on {tensor.device}")
        if not tensor.is_contiguous():
            raise TypeError("switchagg needs a contiguous tensor (call .contiguous() first)")
        tensor = tensor.detach().numpy()
    if not isinstance(tensor, np.ndarray):
        raise TypeError(f"expected a numpy array or a CPU torch tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _KINDS:
        raise TypeError(f"switchagg sums float32 and int32 tensors; got {tensor.dtype}")
    if not tensor.flags.c_contiguous:
        raise TypeError("switchagg needs a C-contiguous array")
    if not tensor.flags.writeable:
        raise TypeError("the array is read-only; allreduce works in place")
    return tensor


def _as_wire_array(tensor: Any, bits: int) -> np.ndarray:
    """``_as_array``, and a lane width the dtype can travel in."""
    array = _as_array(tensor)
    if bits not in protocol.WIRE_BITS or (bits != 32 and array.dtype != np.float32):
        raise TypeError(
            f"lanes of {bits} bits are not for {array.dtype} (32 for int32; 32, 16 or 8 for float32)"
        )
    return array


def _configure(
    w: _core.Worker,
    shard: Shard,
    job: int,
    rank: int,
    n: int,
    k: int,
    rto: float,
    rto_max: float,
    timeout: float,
) -> None:
    w.configure(
        shard.aggregator[0], shard.aggregator[1], job if shard.job is None else shard.job,
        rank, n, shard.slot_base, shard.slot_count, k,
        rto=rto, rto_max=rto_max, timeout=timeout, key=shard.key,
    )  # fmt: skip


def path_mtu(local_ip: str, aggregator: tuple[str, int]) -> int:
    """The MTU of the route from ``local_ip`` to ``aggregator`` (IP_MTU of a connected UDP socket:
    the interface's, or a smaller one the kernel learnt by path MTU discovery; connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        if local_ip not in ("", "0.0.0.0"):
            s.bind((local_ip, 0))
        s.connect((aggregator[0], int(aggregator[1])))
        return int(s.getsockopt(socket.IPPROTO_IP, _IP_MTU))


def _warn_small_window(w: _core.Worker, slot_count: int, k: int, window: int) -> None:
    warnings.warn(
        f"switchagg: the socket's receive buffer is {w.rcvbuf} bytes (the rcvbuf asked "
        f"for, or net.core.rmem_max), too small for the results of {slot_count} slots of K={k}; "
        f"sending {window} at a time instead. Raise net.core.rmem_max to at least "
        f"{w.rcvbuf_needed // 2} for the full window (the kernel doubles it).",
        RuntimeWarning,
        stacklevel=3,
    )


def _shards_of(
    job: int,
    aggregator: tuple[str, int] | Sequence[tuple[str, int]],
    slot_base: int,
    slot_count: int,
    key: int | None,
    shards: Sequence[Shard] | None,
) -> list[Shard]:
    """The session's shards: as given, or one per aggregator address with the job's slots and key."""
    if shards is None:
        if key is None:
            raise ValueError(
                f"job {job}: Session needs key=, the job's result key as installed on its aggregator "
                "(add_job's return value, or what switchagg-aggregator printed); key=switchagg.UNKEYED "
                "runs without one"
            )
        many = [aggregator] if isinstance(aggregator[0], str) else list(aggregator)
        shards = [Shard((str(a[0]), int(a[1])), slot_base, slot_count, key) for a in many]  # type: ignore[index]
    if not shards:
        raise ValueError("a session needs at least one aggregator")
    if any(s.key == UNKEYED for s in shards):
        warn_unkeyed(f"job {job}")
    return list(shards)


def _bound_workers(
    shards: Sequence[Shard],
    bind: tuple[str, int],
    rcvbuf: int,
    worker: _core.Worker | None,
    workers: Sequence[_core.Worker] | None,
) -> list[_core.Worker]:
    """One socket per shard: those given, else shard 0 on ``bind``'s port and the others on free ones."""
    bound = list(workers) if workers is not None else []
    if worker is not None and not bound:
        bound = [worker]
    while len(bound) < len(shards):
        bound.append(_core.Worker(bind[0], 0 if bound else bind[1], rcvbuf))
    return bound


def _path_k(shards: Sequence[Shard], workers: Sequence[_core.Worker]) -> int:
    """The most values one IP packet carries on every shard's path (nothing is ever fragmented)."""
    mtus = [path_mtu(w.address[0], s.aggregator) for s, w in zip(shards, workers, strict=True)]
    return protocol.k_for_mtu(min(mtus))


class Session:
    """One rank of one job on a data plane (the P4 switch or the software aggregator).

    ``allreduce`` sums in place over all ranks; ``allreduce_async`` returns a future and runs
    the C packet path on the session's own thread, one allreduce at a time in call order.

    The ranks' sessions open together: the first call runs the session's hello with every other rank
    (docs/PROTOCOL.md, Sessions), which agrees on an incarnation no earlier session of the job had, so
    a job installed once serves run after run and a sum always belongs to the run that asked for it.
    A rank restarted alone cannot rejoin its peers' session: its first call and theirs fail.
    """

    def __init__(
        self,
        job: int,
        rank: int,
        world_size: int,
        aggregator: tuple[str, int] | Sequence[tuple[str, int]] = ("127.0.0.1", protocol.UDP_PORT),
        slot_base: int = 0,
        slot_count: int = protocol.DEFAULT_SW_SLOTS,
        k: int | None = None,
        timeout: float = 10.0,
        bind: tuple[str, int] = ("127.0.0.1", 0),
        rto: float = DEFAULT_RTO,
        rto_max: float = 1.0,
        rcvbuf: int = 0,
        metrics_port: int | None = None,
        key: int | None = None,
        _worker: _core.Worker | None = None,
        shards: Sequence[Shard] | None = None,
        _workers: Sequence[_core.Worker] | None = None,
    ) -> None:
        """``rcvbuf``: the socket's receive buffer in bytes (0: as large as the system allows); a
        buffer too small for the job's window shrinks the window, with a warning.

        ``metrics_port``: serve this process's worker metrics for Prometheus on this port (0: a
        free one, see ``metrics_address``); None: the port $SWITCHAGG_METRICS_PORT names (plus
        $LOCAL_RANK, so that torchrun's ranks on one host do not collide), if set. Bound to
        $SWITCHAGG_METRICS_HOST, default 127.0.0.1. Needs ``pip install switchagg[metrics]``.

        ``k``: values per packet, as installed on the aggregator; None: the most that fits one IP
        packet on the path to the aggregator (``protocol.k_for_mtu`` of the route's MTU, the least
        over the shards; DEFAULT_SW_K on loopback), so that nothing is ever fragmented. A K whose
        packets exceed the path MTU fails here, naming the MTU.

        ``rto``: the retransmission timer's floor, seconds; the timer follows the measured round
        trip above it (docs/PROTOCOL.md, The worker side).

        ``key``: the job's 32-bit result key, as installed on its aggregator (the job service and the
        torch backend hand it out; ``SoftwareAggregator.add_job`` returns it; switchagg-aggregator
        prints it): only RESULTs that carry it are used. Required unless ``shards`` carry it;
        ``switchagg.UNKEYED`` on both sides runs a job without one, with a warning
        (docs/PROTOCOL.md, Security).

        Striping (docs/PROTOCOL.md, Striping): ``aggregator`` may be a list of addresses, one
        aggregator per shard, each with this job, slot range and key installed; or ``shards`` gives
        each shard its own (what the job service hands out). Every tensor is then cut into that many
        contiguous shards, each summed on its own aggregator through a socket of its own, all at
        once; ``_workers``: the sockets, one per shard (bound already), else bound here."""
        shards = _shards_of(job, aggregator, slot_base, slot_count, key, shards)
        workers = _bound_workers(shards, bind, rcvbuf, _worker, _workers)
        k = k if k is not None else _path_k(shards, workers)
        for shard, w in zip(shards, workers, strict=True):
            _configure(w, shard, job, rank, world_size, k, rto, rto_max, timeout)
        self._worker = workers[0]
        self._workers = workers
        self.shards = tuple(shards)
        self._stripes = (
            Stripes(workers, [s.node or "{}:{}".format(*s.aggregator) for s in shards])
            if len(shards) > 1
            else None
        )
        aggregator = shards[0].aggregator
        slot_base, slot_count, key = shards[0].slot_base, shards[0].slot_count, shards[0].key
        if self.window < slot_count:
            _warn_small_window(self._worker, slot_count, k, self.window)
        self.job, self.rank, self.world_size, self.k = job, rank, world_size, k
        self.aggregator = aggregator
        self.slot_base, self.slot_count = slot_base, slot_count
        self.data_plane = "software"
        self.assignment: Any = None  # the job service's answer, when joined through it
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._membership: Any = None  # jobclient.Membership when joined through the job service
        self.job_name = ""  # the job service's name for the job, when joined through it
        # The torch layer's calls per op and path (switchagg.torch.calls.CallLog), for the metrics.
        self.torch_calls: Any = None
        self.metrics_address: tuple[str, int] | None = None  # where this process serves worker metrics
        self._metrics: Any = None  # switchagg.metrics.WORKERS while this session exports
        self._export_metrics(metrics_port)

    def _export_metrics(self, port: int | None) -> None:
        from_env = port is None
        if from_env:
            text = os.environ.get(_METRICS_PORT_ENV, "").strip()
            if not text:
                return
            try:
                port = int(text) + int(os.environ.get("LOCAL_RANK", "0"))
            except ValueError:
                warnings.warn(
                    f"switchagg: {_METRICS_PORT_ENV}={text!r} is not a port", RuntimeWarning, stacklevel=3
                )
                return
        assert port is not None
        host = os.environ.get(_METRICS_HOST_ENV, "127.0.0.1")
        try:
            from switchagg import metrics

            self.metrics_address = metrics.WORKERS.serve(port, host)
        except (ImportError, OSError) as exc:
            hint = " (pip install switchagg[metrics])" if isinstance(exc, ImportError) else ""
            if not from_env:
                raise type(exc)(f"switchagg: cannot serve metrics on {host}:{port}: {exc}{hint}") from exc
            # Metrics asked for by the environment never stop a job.
            warnings.warn(
                f"switchagg: no metrics on {host}:{port}: {exc}{hint}", RuntimeWarning, stacklevel=3
            )
            return
        self._metrics = metrics.WORKERS
        self._metrics.attach(self)

    @classmethod
    def from_job_service(
        cls,
        service: str,
        secret: str,
        job_name: str,
        world_size: int,
        rank: int | None = None,
        bind: tuple[str, int] | Sequence[tuple[str, int]] = ("127.0.0.1", 0),
        timeout: float = 10.0,
        join_timeout: float = 60.0,
        heartbeat_interval: float = 2.0,
        metrics_port: int | None = None,
        shards: int | None = None,
    ) -> Session:
        """Join ``job_name`` through the controller's job service and open its session; the session
        heartbeats every ``heartbeat_interval`` seconds while it lives and leaves the job on close.

        ``shards``: stripe the job across that many reducers of the service's pool (0: not
        striped); None: $SWITCHAGG_SHARDS if set, else the pool's size (0 where it has none).

        ``bind`` may list one address per shard: a worker with one interface per rail (P4 switches
        as rails, docs/CONTROLLER.md) binds shard s to its address on rail s, and joins with them;
        ``shards`` is then the list's length."""
        from switchagg import jobclient

        binds: list[tuple[str, int]] = (
            [bind] if isinstance(bind[0], str) else list(bind)  # type: ignore[list-item, arg-type]
        )
        per_rail = len(binds) > 1
        if per_rail and shards is not None and shards != len(binds):
            raise ValueError(f"{len(binds)} addresses to bind, one per shard, but shards={shards}")
        host, bind_port = binds[0]
        worker = _core.Worker(str(host), int(bind_port))
        ip, port = worker.address
        if ip in ("0.0.0.0", ""):  # the controller pins the address it is told: it must be a real one
            ip = _source_address(service)
        if shards is None:
            shards = len(binds) if per_rail else _shards_wanted(service, secret)
        # One socket per shard: on its rail's address, or beside the first.
        extra = [
            _core.Worker(str(binds[s][0]), int(binds[s][1])) if per_rail else _core.Worker(str(host), 0)
            for s in range(1, max(1, shards))
        ]
        ports = (port, *(w.address[1] for w in extra)) if shards > 0 else ()
        ips = (ip, *(str(w.address[0]) for w in extra)) if per_rail else ()
        a = jobclient.join(service, secret, job_name, world_size, ip, port, rank, join_timeout, ports, ips,
                           mtu=_service_mtu(ip, service))  # fmt: skip
        session = cls(
            a.job_id,
            a.rank,
            a.world_size,
            (a.aggregator_ip, a.aggregator_port),
            a.slot_base,
            a.slot_count,
            a.k,
            timeout=timeout,
            metrics_port=metrics_port,
            key=a.key,
            _worker=worker,
            shards=[
                Shard((s.aggregator_ip, s.aggregator_port), s.slot_base, s.slot_count, s.key, node=s.node)
                for s in a.shards
            ]
            or None,
            _workers=[worker, *extra] if a.shards else None,
        )
        session.job_name = job_name
        session.data_plane = a.data_plane
        session.assignment = a

        # The membership lives as long as the session: heartbeats keep idle phases from being
        # reaped, and close() leaves the job. When the job service says the job is over (torn
        # down, reaped), the call in progress ends with its reason within a heartbeat interval.
        def job_over(error: jobclient.JobServiceError) -> None:
            why = f"the job service ended job {a.job_id} ({job_name!r}): {error}"
            session.cancel(why, _core.SwitchaggTeardown)

        session._membership = jobclient.Membership(service, secret, a, heartbeat_interval, job_over).start()
        return session

    @property
    def window(self) -> int:
        """Packets in flight at most: the job's slot count, or fewer if the receive buffer is small
        (per shard, the least of them, on a striped job)."""
        return min(int(w.window) for w in self._workers)

    @property
    def local_addresses(self) -> list[tuple[str, int]]:
        """Each shard's socket address, in shard order (one entry unless striped)."""
        return [w.address for w in self._workers]

    @property
    def local_address(self) -> tuple[str, int]:
        address: tuple[str, int] = self._worker.address
        return address

    def values_per_packet(self, bits: int = 32) -> int:
        """Values one packet carries in lanes of ``bits`` (a call's chunk): K, or more for narrow lanes."""
        return protocol.lanes_per_packet(self.k, bits)

    def open(self) -> Session:
        """Run the session's hello with every other rank now (docs/PROTOCOL.md, Sessions), on every
        shard; the first allreduce runs it otherwise. Blocks until every rank has opened, or fails
        after the timeout (a rank restarted alone cannot rejoin its peers' session). Returns self."""
        if self._closed:
            raise _core.SwitchaggError("the session is closed")
        with self._lock:
            if self._stripes is None:
                self._worker.open_session()
            else:
                self._stripes.run(lambda s, w: w.open_session())
        return self

    def allreduce(self, tensor: Any, tag: int = 0, bits: int = 32, residual: Any = None) -> None:
        """Sum ``tensor`` over all ranks, in place (float32 within protocol.error_bound, int32 exactly).

        Every call is numbered; the aggregator sums only contributions of the same call (number,
        length, dtype). A call that differs from its peers', or that this rank cannot make (a bad
        argument), fails on every rank with an error that says what differed (SwitchaggMismatch,
        SwitchaggAborted), and the job's sessions cannot be used again (docs/PROTOCOL.md, Call identity).

        ``tag``: a 32-bit digest of the caller's own call (0: none), mixed into the call's identity, so a
        layer that cuts its calls into several (torch's staging) makes every piece carry its parent's
        identity: ranks whose tags differ fail the call as a mismatch.

        ``bits``: the lanes a float32 tensor travels in, 32, 16 or 8 (docs/PROTOCOL.md, Narrow lanes: one
        scale per 32 values, stochastic rounding, within ``protocol.lane_error_bound``); part of the call's
        identity. ``residual`` (narrow lanes only; float32 of the tensor's size, or None): error feedback,
        added to the tensor before it is quantized and left holding what rounding took from it, for the
        next call of the same tensor."""
        if self._closed:
            raise _core.SwitchaggError("the session is closed")
        array = self._checked(tensor, tag, bits)
        res = self._residual(residual, array, bits)
        with self._lock:
            self._reduce(array, tag, bits, res)

    def _checked(self, tensor: Any, tag: int = 0, bits: int = 32) -> np.ndarray:
        """``tensor`` as an array, or the call aborted on every rank and the argument error raised."""
        try:
            return _as_wire_array(tensor, bits)
        except TypeError as exc:
            with self._lock:
                self._abort(tensor, tag, bits if bits in protocol.WIRE_BITS else 32)
            raise TypeError(f"{exc} (this call was aborted on every rank of job {self.job})") from None

    @staticmethod
    def _residual(residual: Any, array: np.ndarray, bits: int) -> np.ndarray | None:
        """The error-feedback buffer as a flat float32 view (None for 32-bit lanes: they round to nearest)."""
        if residual is None or bits == 32:
            return None
        res = _as_array(residual)
        if res.dtype != np.float32 or res.size != array.size:
            raise ValueError(
                f"residual must be float32 of {array.size} elements, not {res.dtype} of {res.size}"
            )
        return res.reshape(-1)

    def _abort(self, tensor: Any, tag: int = 0, bits: int = 32) -> None:
        """Give up this call so that every peer fails it too, not pair with this rank's next call."""
        numel = getattr(tensor, "numel", None)  # torch; numpy has .size
        total = numel() if callable(numel) else getattr(tensor, "size", 0)
        kind = "i" if "int" in str(getattr(tensor, "dtype", "")) else "f"
        try:
            if self._stripes is None:
                self._worker.abort(int(total or 0), kind, tag, bits)
                return
            bounds = shard_bounds(int(total or 0), self.values_per_packet(bits), len(self._workers))
            # Every shard aborts its part, so that the peers fail the call on each node.
            self._stripes.run(lambda s, w: w.abort(max(1, bounds[s][1] - bounds[s][0]), kind, tag, bits))
        except _core.SwitchaggError:
            pass  # broken already: the peers failed an earlier call

    def _allreduce(self, flat: np.ndarray, kind: str, tag: int, bits: int, res: np.ndarray | None) -> None:
        if self._stripes is None:
            self._worker.allreduce(flat, kind, tag, bits, res)
            return
        bounds = shard_bounds(flat.size, self.values_per_packet(bits), len(self._workers))
        # Each shard is a call of its own on its node (an empty one too: call numbers stay in step); each
        # carries the whole call's length in its tag, so ranks whose tensors differ fail on every shard.
        whole = _stripe_tag(tag, flat.size, kind)
        what = f"{flat.size} {'float32' if kind == 'f' else 'int32'} elements"

        def shard(s: int, w: _core.Worker) -> None:
            lo, hi = bounds[s]
            w.allreduce(flat[lo:hi], kind, whole, bits, None if res is None else res[lo:hi])

        self._stripes.run(shard, what)

    def _reduce(self, array: np.ndarray, tag: int = 0, bits: int = 32, res: np.ndarray | None = None) -> None:
        if self._metrics is None:
            self._allreduce(array.reshape(-1), _KINDS[array.dtype], tag, bits, res)
            return
        t0 = time.perf_counter()
        try:
            self._allreduce(array.reshape(-1), _KINDS[array.dtype], tag, bits, res)
        except _core.SwitchaggTimeout:
            self._metrics.timed_out(self)
            raise
        self._metrics.observe(self, time.perf_counter() - t0, array.nbytes)

    def allreduce_async(
        self,
        tensor: Any,
        ready: Callable[[], object] | None = None,
        tag: int = 0,
        bits: int = 32,
        residual: Any = None,
    ) -> concurrent.futures.Future[None]:
        """``allreduce`` on the session's thread, after the calls queued before it. ``ready``, if given,
        runs on that thread just before the call (e.g. to wait for a device-to-host copy of ``tensor``);
        if it raises, this rank aborts the call on every rank and the future carries the error."""
        if self._closed:
            raise _core.SwitchaggError("the session is closed")
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="switchagg")
        try:
            array = _as_wire_array(tensor, bits)  # type errors surface now, not in the future
        except TypeError as exc:
            # The abort takes this call's place in line, after the calls queued before it.
            self._executor.submit(self._checked, tensor, tag, bits)
            raise TypeError(f"{exc} (this call is aborted on every rank of job {self.job})") from None
        res = self._residual(residual, array, bits)
        return self._executor.submit(self._locked_reduce, array, ready, tag, bits, res)

    def _locked_reduce(
        self,
        array: np.ndarray,
        ready: Callable[[], object] | None = None,
        tag: int = 0,
        bits: int = 32,
        res: np.ndarray | None = None,
    ) -> None:
        with self._lock:
            if ready is not None:
                try:
                    ready()
                except BaseException:
                    self._abort(array, tag, bits)
                    raise
            self._reduce(array, tag, bits, res)

    def cancel(self, reason: str, cause: type[_core.SwitchaggError] = _core.SwitchaggError) -> None:
        """From any thread: end the call in progress and refuse every later one; the call raises
        ``cause`` (SwitchaggError or a subclass: SwitchaggPeerGone when a watcher found a peer gone,
        SwitchaggTeardown when the job service ended the job) with ``reason``."""
        for w in self._workers:
            w.cancel(reason, cause)

    def stats(self) -> dict[str, int]:
        """The worker's packet counters (summed over the shards of a striped job; ``call`` and
        ``allreduces`` count the session's calls, the same on every shard)."""
        stats: dict[str, int] = self._worker.stats()
        for w in self._workers[1:]:
            for name, value in w.stats().items():
                stats[name] = max(stats[name], value) if name in _PER_CALL else stats[name] + value
        return stats

    def shard_stats(self) -> list[dict[str, int]]:
        """Each shard's worker counters, in shard order (one entry unless striped)."""
        return [w.stats() for w in self._workers]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        with self._lock:
            for w in self._workers:
                w.close()
        if self._stripes is not None:
            self._stripes.close()
        if self._metrics is not None:
            self._metrics.detach(self)
            self._metrics = None
        membership, self._membership = self._membership, None
        if membership is not None:
            membership.end()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stripe_tag(tag: int, length: int, kind: str) -> int:
    """The tag every shard of a striped call carries: the caller's, and the whole call's length and kind."""
    return digest32(f"{tag}:{length}:{kind}")


def _shards_wanted(service: str, secret: str) -> int:
    """$SWITCHAGG_SHARDS, else the size of the service's reducer pool (0: not striped)."""
    text = os.environ.get("SWITCHAGG_SHARDS", "").strip()
    if text:
        if not text.isdigit():
            raise ValueError(f"SWITCHAGG_SHARDS={text!r} is not a number of shards")
        return int(text)
    from switchagg import jobclient

    return jobclient.describe(service, secret)


def _service_mtu(ip: str, service: str) -> int:
    """The MTU of the route from ``ip`` toward the job service's host (0: unknown, or a unix socket):
    what the service sizes the job's K by."""
    host, sep, port = service.rpartition(":")
    if service.startswith("unix:") or not sep or not port.isdigit():
        return 0
    try:
        return path_mtu(ip, (host.strip("[]"), int(port)))
    except OSError:
        return 0


def _source_address(service: str) -> str:
    """The local IP the kernel routes to the job service's host from (a UDP connect sends nothing)."""
    host, sep, _ = service.rpartition(":")
    if service.startswith("unix:") or not sep:
        raise ValueError(
            f"a worker bound to 0.0.0.0 cannot tell the job service {service!r} its address: "
            "bind it to the IP the aggregator should send to"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host.strip("[]"), 9))
        ip: str = s.getsockname()[0]
    return ip
