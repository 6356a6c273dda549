"""Software aggregation nodes the controller uses: embedded ones it starts, remote ones
(`switchagg-aggregator --control` elsewhere) it reaches through their control service, and the
watch that reinstalls a remote node's jobs when it restarts or comes back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from switchagg_controller.model import Remote
from switchagg_controller.topology import TopologyError
from switchagg_controller.two_level_spec import SPINE, Address, TwoLevelSpec

if TYPE_CHECKING:
    from switchagg.aggregator import AggregatorHandle

log = logging.getLogger(__name__)


def _secret(remote: Remote) -> str:
    try:
        secret = remote.secret_file.read_text().strip()
    except OSError as e:
        raise TopologyError(
            f"{remote.secret_file}: cannot read the secret of {remote.control}: {e.strerror}"
        ) from None
    if not secret:
        raise TopologyError(f"{remote.secret_file}: the secret of {remote.control} is empty")
    return secret


def open_node(name: str, listen: Address, remote: Remote | None) -> tuple[AggregatorHandle, str | None]:
    """One software aggregator: embedded (started here), or remote (reached through its control
    service), with a warning when that one is not reachable yet (its jobs install once it is:
    NodeWatch). A remote one serving elsewhere than its ``listen`` is an error."""
    from switchagg.aggregator import SoftwareAggregator
    from switchagg.aggregator_control import ControlError, RemoteAggregator

    if remote is None:
        return SoftwareAggregator(*listen).start(), None
    agg = RemoteAggregator(remote.control, _secret(remote), timeout=2.0, address=listen)
    try:
        info = agg.info()
    except ControlError as e:
        return agg, f"the {name} aggregator is not reachable yet: {e}"
    if (info.ip, info.udp_port) != listen:
        agg.close()
        raise TopologyError(
            f"the {name} aggregator at {remote.control} serves on {info.ip}:{info.udp_port}, "
            f"not on its listen address {listen[0]}:{listen[1]}"
        )
    return agg, None


def open_all(roles: list[tuple[str, Address, Remote | None]]) -> tuple[list[AggregatorHandle], list[str]]:
    """``open_node`` for each (name, listen, remote), in order; on an error none stays open."""
    nodes: list[AggregatorHandle] = []
    warnings: list[str] = []
    try:
        for name, listen, remote in roles:
            agg, warning = open_node(name, listen, remote)
            nodes.append(agg)
            if warning:
                warnings.append(warning)
    except Exception:
        close_nodes(nodes)
        raise
    return nodes, warnings


def open_nodes(spec: TwoLevelSpec) -> tuple[list[AggregatorHandle], list[str]]:
    """The spine's and each leaf's aggregator, in that order (``open_node``), and the warnings."""
    return open_all(
        [(SPINE, spec.spine, spec.spine_remote), *((f.name, f.listen, f.remote) for f in spec.leaves)]
    )


def close_nodes(nodes: list[AggregatorHandle]) -> None:
    from switchagg.aggregator import SoftwareAggregator
    from switchagg.aggregator_control import RemoteAggregator

    for agg in nodes:
        if isinstance(agg, SoftwareAggregator):
            agg.stop()  # embedded: the controller's own
        elif isinstance(agg, RemoteAggregator):
            agg.close()  # remote: only our channel to it


class NodeWatch:
    """Watches the remote aggregators through their Info call: ``poll()`` returns the indices (0
    the spine, l+1 leaf l) of those that restarted (a new boot id: their jobs are gone) or are
    reachable again since the last poll (they may hold jobs removed meanwhile)."""

    def __init__(self, nodes: list[AggregatorHandle]) -> None:
        from switchagg.aggregator_control import RemoteAggregator

        self._remote = {i: a for i, a in enumerate(nodes) if isinstance(a, RemoteAggregator)}
        self._boot: dict[int, str] = {}
        self.up: dict[int, bool] = {i: False for i in self._remote}
        for i in self._remote:  # the ones reachable now are as open_nodes found them
            boot = self._boot_id(i)
            if boot is not None:
                self._boot[i] = boot

    def _boot_id(self, i: int) -> str | None:
        from switchagg.aggregator_control import ControlError

        try:
            boot = self._remote[i].info().boot_id
        except ControlError:
            self.up[i] = False
            return None
        self.up[i] = True
        return boot

    def poll(self) -> list[int]:
        """The remote nodes to reconcile: restarted (a new boot id), or reachable again."""
        changed = []
        for i in self._remote:
            was_up = self.up[i]
            boot = self._boot_id(i)
            if boot is None:
                continue
            if self._boot.get(i) != boot or not was_up:
                changed.append(i)
                self._boot[i] = boot
        return changed


WATCH_INTERVAL_S = 1.0


class NodeSupervisor:
    """Polls the remote aggregators (NodeWatch) and hands each one that restarted or came back
    to ``on_restart(node)``, which reconciles its jobs (TwoLevelDataPlane.reconcile). A task on the
    controller's loop; each poll is blocking gRPC, so it runs in a worker thread."""

    def __init__(
        self,
        watch: NodeWatch,
        on_restart: Callable[[int], Awaitable[None]],
        interval: float = WATCH_INTERVAL_S,
    ):
        self.watch, self.on_restart, self.interval = watch, on_restart, interval
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            for node in await asyncio.to_thread(self.watch.poll):
                try:
                    await self.on_restart(node)
                except Exception:  # keep watching: the next restart must still be handled
                    log.exception("reinstalling the jobs of two-level node %d failed", node)

    def start(self) -> NodeSupervisor:
        """Call it on the loop."""
        self._task = asyncio.create_task(self._run(), name="switchagg-node-watch")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
