"""The controller's composition root: one ControllerConfig in, a running Controller out.

Everything `switchagg-ctl serve` runs, on one event loop: the job service (grpc.aio), the job
manager and its reaper, every P4 switch's supervisor, the watchers of remote software nodes and
the metrics endpoint; the embedded software aggregators are C threads. The CLI only turns flags
into a ControllerConfig (cli.py); tests and embedders can build one directly.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from switchagg import protocol
from switchagg_controller import allocation

if TYPE_CHECKING:
    import grpc.aio

    from switchagg.aggregator import AggregatorHandle, SoftwareAggregator
    from switchagg_controller.jobs import JobManager
    from switchagg_controller.planes import DataPlane
    from switchagg_controller.service import JoinObserver
    from switchagg_controller.software_nodes import NodeSupervisor
    from switchagg_controller.store import Store
    from switchagg_controller.supervisor import SwitchFleet


class ConfigError(Exception):
    """The configuration cannot make a controller (said in the words of the CLI's flags)."""


@dataclass(frozen=True)
class ControllerConfig:
    secret: str  # the join secret, every worker's
    # ListJobs, Counters and Teardown; "": the one in admin_secret_path(state), made if missing
    admin_secret: str = ""
    state: str = "switchagg-ctl.db"
    listen: str = "127.0.0.1:50051"
    topology: str | None = None  # P4 switches (and software spines), YAML
    two_level: str | None = None  # software leaves and spine, YAML
    reducers: str | None = None  # the reducer pool striped jobs run on, YAML
    software: bool = False  # an embedded software aggregator
    fallback: bool = False  # the embedded software aggregator beside the switches
    software_listen: str = f"127.0.0.1:{protocol.UDP_PORT}"
    software_advertise: str | None = None
    p4_json: Path | None = None
    p4info: Path | None = None
    p4_slots: int = 64
    sw_k: int = protocol.DEFAULT_SW_K
    sw_slots: int = protocol.DEFAULT_SW_SLOTS
    switch_wait: float = 30.0
    join_timeout: float = 60.0
    reap_timeout: float = 30.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # Quotas (jobs.Limits; 0: none): per client, i.e. per address the Joins come from.
    max_jobs_per_client: int = 64
    max_slots_per_client: int = 8192  # a quarter of the software pool
    max_pending_joins: int = 4096

    def check(self) -> None:
        if not self.software and not self.topology and not self.two_level and not self.reducers:
            raise ConfigError(
                "serve needs --topology (the P4 switch), --two-level (software leaves and spine), "
                "--reducers (a reducer pool for striped jobs) or --software (an embedded software aggregator)"
            )


def p4_artifacts(p4_json: Path | None, p4info: Path | None) -> tuple[Path, Path]:
    """The bmv2 JSON and P4Info to push: the given ones, else the installed program's."""
    from switchagg_controller import p4_program

    json_path = p4_json or p4_program.BMV2_JSON
    info = p4info or p4_program.P4INFO
    for path in (json_path, info):
        if not Path(path).is_file():
            raise ConfigError(
                f"{path} does not exist (build the P4 program first, or pass --p4-json/--p4info)"
            )
    return Path(json_path), Path(info)


def admin_secret_path(state: str) -> Path:
    """Where serve keeps its admin secret when given none: beside its state file."""
    return Path(f"{state}.admin-secret")


def load_or_make_secret(path: Path) -> str:
    """The secret in ``path``; a new random one written there (mode 0600) if the file is missing."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        secret = path.read_text().strip()
        if not secret:
            raise ConfigError(f"the admin secret file {path} is empty") from None
        if path.stat().st_mode & 0o077:
            _warn(f"{path} can be read by other users: chmod 600 it")
        return secret
    secret = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def _warn(message: str) -> None:
    print(f"switchagg-ctl: warning: {message}", file=sys.stderr, flush=True)


def _say(message: str) -> None:
    print(f"switchagg-ctl: {message}", file=sys.stderr, flush=True)


class Controller:
    """Built from a ControllerConfig; ``start()`` returns the banner line, ``stop()`` undoes all."""

    def __init__(self, config: ControllerConfig) -> None:
        config.check()
        self.config = config
        self.planes: list[DataPlane] = []
        self.fleet: SwitchFleet | None = None
        self.aggregator: SoftwareAggregator | None = None
        self.manager: JobManager | None = None
        self.nodes: list[AggregatorHandle] = []  # the software aggregators opened here (to close)
        self.node_supervisors: list[NodeSupervisor] = []  # watch the remote ones
        self.two_level_nodes: list[AggregatorHandle] = []
        self.reducer_nodes: list[AggregatorHandle] = []
        self.rails: list[str] = []  # the reducer pool's rails, "name=switch"
        self.max_counter_index = 0
        self.store: Store | None = None
        self.server: grpc.aio.Server | None = None
        self.admin_secret_file: Path | None = None  # where the admin secret is, if serve chose it
        self.reaper: asyncio.Task[None] | None = None

    # -- the data planes ----------------------------------------------------------------------

    def _build_p4(self, topology: str) -> None:
        from switchagg_controller import p4_program
        from switchagg_controller.planes import P4DataPlane
        from switchagg_controller.software_nodes import NodeSupervisor, NodeWatch, open_all
        from switchagg_controller.supervisor import SwitchFleet, SwitchSupervisor
        from switchagg_controller.topology import load_network

        network = load_network(topology)
        json_path, p4info = p4_artifacts(self.config.p4_json, self.config.p4info)
        spines = network.software_spines
        spine_aggs, unreachable = open_all([(s.name, s.listen, s.remote) for s in spines])
        self.nodes += spine_aggs
        for warning in unreachable:
            _warn(warning)
        plane = P4DataPlane(
            network.switches,
            default_slots=self.config.p4_slots,
            software_spines=list(zip(spines, spine_aggs, strict=True)),
        )

        async def on_spine_restart(node: int) -> None:  # a remote software spine restarted or is back
            if self.manager is not None:
                jobs = self.manager.jobs(allocation.P4)  # read on the loop; the spine's calls block
                spine = spines[node].name
                installed, removed = await asyncio.to_thread(plane.reconcile_software_spine, spine, jobs)
                _say(f"software spine {spine} reconciled: {installed} job(s) installed, {removed} removed")

        if spine_aggs:
            self.node_supervisors.append(NodeSupervisor(NodeWatch(spine_aggs), on_spine_restart))

        def on_restart(switch: str) -> None:  # the switch lost its state: new generations for its jobs
            if self.manager is not None:
                bumped = self.manager.bump_generations(
                    allocation.P4, lambda job: plane.bumped_by_restart(job, switch)
                )
                plane.set_jobs(bumped)

        supervisors = [
            SwitchSupervisor(
                t,
                json_path,
                p4info,
                desired=functools.partial(plane.desired, t.name),
                on_restart=functools.partial(on_restart, t.name),
            )
            for t in network.switches
        ]
        for s in supervisors:
            plane.attach(s)
        self.fleet = SwitchFleet(supervisors)
        self.planes.append(plane)
        self.max_counter_index = p4_program.MAX_JOBS

    def _build_two_level(self, path: str) -> None:
        from switchagg_controller.software_nodes import NodeSupervisor, NodeWatch, open_nodes
        from switchagg_controller.two_level_plane import TwoLevelDataPlane
        from switchagg_controller.two_level_spec import load_two_level

        spec = load_two_level(path)
        nodes, unreachable = open_nodes(spec)
        self.nodes += nodes
        self.two_level_nodes = nodes
        for warning in unreachable:
            _warn(warning)
        plane = TwoLevelDataPlane(
            spec, nodes[0], nodes[1:], k=self.config.sw_k, default_slots=self.config.sw_slots
        )
        self.planes.append(plane)

        async def on_node_restart(node: int) -> None:  # a remote node restarted or is back: its jobs again
            if self.manager is not None:
                jobs = self.manager.jobs(allocation.TWO_LEVEL)  # read on the loop; the node's calls block
                installed, removed = await asyncio.to_thread(plane.reconcile, node, jobs)
                _say(f"two-level node {node} reconciled: {installed} job(s) installed, {removed} removed")

        self.node_supervisors.append(NodeSupervisor(NodeWatch(nodes), on_node_restart))

    def _build_reducers(self, path: str) -> None:
        from switchagg_controller.planes import P4DataPlane
        from switchagg_controller.reducers import StripedDataPlane, load_reducers
        from switchagg_controller.software_nodes import NodeSupervisor, NodeWatch, open_all

        specs = load_reducers(path)
        software = [i for i, s in enumerate(specs) if not s.switch]  # the others are rails: P4 switches
        p4 = next((p for p in self.planes if isinstance(p, P4DataPlane)), None)
        rails = [s for s in specs if s.switch]
        if rails and p4 is None:
            raise ConfigError(f"{path}: rail {rails[0].name} names a switch: serve needs --topology with it")
        if rails and p4 is not None:
            if missing := [s.switch for s in rails if s.switch not in p4.topologies]:
                raise ConfigError(
                    f"{path}: no switch {missing[0]!r} in the topology ({', '.join(p4.topologies)})"
                )
        opened, unreachable = open_all(
            [(f"reducer {specs[i].name}", specs[i].listen, specs[i].remote) for i in software]
        )
        self.nodes += opened
        self.reducer_nodes = opened
        for warning in unreachable:
            _warn(warning)
        nodes: list[AggregatorHandle | None] = [None] * len(specs)
        for i, agg in zip(software, opened, strict=True):
            nodes[i] = agg
        plane = StripedDataPlane(
            specs,
            nodes,
            # A rail runs the P4 program's K (and window): so does every shard of a pool with rails.
            k=protocol.P4_K if rails else self.config.sw_k,
            default_slots=self.config.p4_slots if rails else self.config.sw_slots,
            p4=p4,
        )
        self.planes.append(plane)
        self.rails = [f"{s.name}={s.switch}" for s in rails]

        async def on_node_restart(node: int) -> None:  # a remote reducer restarted or is back: its shards
            if self.manager is not None:
                jobs = self.manager.jobs(plane.name)  # read on the loop; the node's calls block
                installed, removed = await asyncio.to_thread(plane.reconcile, software[node], jobs)
                name = specs[software[node]].name
                _say(f"reducer {name} reconciled: {installed} shard(s) installed, {removed} removed")

        if opened:
            self.node_supervisors.append(NodeSupervisor(NodeWatch(opened), on_node_restart))

    def _build_software(self) -> None:
        from switchagg.aggregator import SoftwareAggregator
        from switchagg_controller.planes import SoftwareDataPlane

        host, _, port = self.config.software_listen.rpartition(":")
        self.aggregator = SoftwareAggregator(host, int(port)).start()
        self.planes.append(
            SoftwareDataPlane(
                self.aggregator,
                k=self.config.sw_k,
                default_slots=self.config.sw_slots,
                advertised_ip=self.config.software_advertise,
            )
        )

    # -- start and stop -----------------------------------------------------------------------

    async def _wait_for_switches(self) -> None:
        """Joins that arrive before the switches are programmed would fail: wait for them (bounded)."""
        if self.fleet is None:
            return
        self.fleet.start()
        if not await self.fleet.wait_ready(self.config.switch_wait):
            for s in self.fleet.supervisors:
                if not s.ready:
                    _warn(f"the switch {s.name} is not ready yet ({s.last_error})")

    def _start_metrics(self, manager: JobManager) -> tuple[str, JoinObserver | None]:
        """'' and None without --metrics-port; else the banner's part and the join observer."""
        if self.config.metrics_port is None:
            return "", None
        try:
            from switchagg_controller.controller_metrics import ControllerMetrics
        except ImportError as e:
            raise ConfigError(f"{e}: --metrics-port needs pip install 'switchagg[metrics]'") from None
        metrics = ControllerMetrics(manager, self.fleet, asyncio.get_running_loop())
        host, port = metrics.serve(self.config.metrics_port, self.config.metrics_host)
        return f"; metrics on http://{host}:{port}/metrics", metrics.observe_join

    def _banner(self, port: int, reloaded: int, metrics: str) -> str:
        listen = self.config.listen
        if not listen.startswith("unix:"):
            listen = f"{listen.rpartition(':')[0]}:{port}"
        agg = ""
        if self.aggregator is not None:
            agg = f" software aggregator {self.aggregator.address[0]}:{self.aggregator.address[1]}"
        if self.two_level_nodes:
            spine, *leaves = (f"{a.address[0]}:{a.address[1]}" for a in self.two_level_nodes)
            agg += f" two-level spine {spine} leaves {','.join(leaves)}"
        if self.reducer_nodes:
            agg += " reducers " + ",".join(f"{a.address[0]}:{a.address[1]}" for a in self.reducer_nodes)
        if self.rails:
            agg += " rails " + ",".join(self.rails)
        admin = f"; admin secret in {self.admin_secret_file}" if self.admin_secret_file else ""
        return f"switchagg-ctl: job service on {listen};{agg} {reloaded} job(s) reloaded{metrics}{admin}"

    def _admin_secret(self) -> str:
        admin = self.config.admin_secret
        if not admin:
            self.admin_secret_file = admin_secret_path(self.config.state)
            admin = load_or_make_secret(self.admin_secret_file)
        if admin == self.config.secret:
            raise ConfigError("the admin secret must differ from the join secret, which every worker holds")
        return admin

    async def start(self) -> str:
        """Builds the data planes, reloads the jobs, starts serving; returns the banner line."""
        from switchagg_controller.jobs import JobManager, Limits
        from switchagg_controller.service import make_server, reap_forever
        from switchagg_controller.store import Store

        admin_secret = self._admin_secret()
        self.store = Store(self.config.state)
        if self.config.topology:
            self._build_p4(self.config.topology)
        if self.config.two_level:
            self._build_two_level(self.config.two_level)
        if self.config.reducers:
            self._build_reducers(self.config.reducers)
        if self.config.software or self.config.fallback:
            self._build_software()
        self.manager = manager = JobManager(
            self.store,
            self.planes,
            join_timeout=self.config.join_timeout,
            reap_timeout=self.config.reap_timeout,
            max_counter_index=self.max_counter_index,
            limits=Limits(
                jobs_per_client=self.config.max_jobs_per_client,
                slots_per_client=self.config.max_slots_per_client,
                pending_joins=self.config.max_pending_joins,
            ),
        )
        reloaded = await manager.reload()
        await self._wait_for_switches()
        metrics, on_join = self._start_metrics(manager)
        self.server, port = make_server(
            manager, self.config.secret, self.config.listen, on_join=on_join, admin_secret=admin_secret
        )
        await self.server.start()
        self.reaper = asyncio.create_task(reap_forever(manager), name="reaper")
        for node_supervisor in self.node_supervisors:
            node_supervisor.start()
        return self._banner(port, len(reloaded), metrics)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.reaper is not None:
            self.reaper.cancel()
            await asyncio.gather(self.reaper, return_exceptions=True)
        if self.fleet is not None:
            await self.fleet.stop()
        for node_supervisor in self.node_supervisors:
            await node_supervisor.stop()
        if self.aggregator is not None:
            self.aggregator.stop()
        if self.nodes:
            from switchagg_controller.software_nodes import close_nodes

            close_nodes(self.nodes)
        if self.store is not None:
            self.store.close()
