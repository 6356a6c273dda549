"""The controller's Prometheus metrics: `switchagg-ctl serve --metrics-port`.

Built at scrape time, like the aggregator's (switchagg.metrics): the data planes' counters (the
P4 switches' counter arrays read over P4Runtime; the C counters of every software node: the
software aggregator, embedded or remote, the two-level spine and leaves, the P4 plane's software
spines) under the same names and labels as `switchagg-aggregator --metrics-port`, plus what only the
controller knows: jobs by state, join latency, and each switch's supervisor counters.

A scrape never waits long: each switch and each remote software node is read with a bound
(``read_timeout``), all in parallel; one that is away or slow is `switchagg_switch_up 0` and its
counters are left out (not zeros, which would read as a counter reset).

prometheus_client serves the scrape from a thread of its own; that thread is the one place that
meets the controller's event loop: it asks the loop for one snapshot (``_snapshot``, every read
of the controller's state and of the switches made there) and builds the families from it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from switchagg import aggregator, metrics, protocol
from switchagg.aggregator import AggregatorHandle
from switchagg.aggregator_control import RemoteAggregator
from switchagg_controller import allocation, p4_program
from switchagg_controller.jobs import JobManager, JobView
from switchagg_controller.model import Job
from switchagg_controller.planes import P4DataPlane, SoftwareDataPlane
from switchagg_controller.supervisor import Counters, SwitchFleet
from switchagg_controller.two_level_plane import TwoLevelDataPlane
from switchagg_controller.two_level_spec import SPINE

JOB_STATES = ("pending", "active")
SWITCH = ("switch", "data_plane")
_P4_COUNTERS = [
    p4_program.DROP_COUNTER,
    *p4_program.JOB_COUNTER_NAMES.values(),
    *p4_program.LEAF_COUNTER_NAMES.values(),
]

# (attribute of SwitchSupervisor, metric name, help)
_SUPERVISOR_COUNTERS = (
    ("pushes", "switchagg_switch_state_lost", "Times the switch was found without our state and programmed"),
    ("reconnects", "switchagg_switch_reconnects", "P4Runtime streams opened to the switch"),
    ("write_errors", "switchagg_p4runtime_write_errors", "Failed P4Runtime programming writes"),
    ("programmed", "switchagg_switch_programmed", "Times the whole desired state was written on connect"),
)


@dataclass(frozen=True)
class _Snapshot:
    """What one scrape shows, taken on the event loop."""

    samples: list[metrics.DataPlaneSample]
    up: list[tuple[str, str, int]]  # (switch, data plane, 1 or 0)
    supervisors: list[tuple[str, bool, dict[str, int]]]  # (switch, primary, counter attributes)
    views: list[JobView]


class ControllerMetrics:
    def __init__(
        self,
        manager: JobManager,
        fleet: SwitchFleet | None,
        loop: asyncio.AbstractEventLoop,
        read_timeout: float = 2.0,
    ) -> None:
        """``loop``: the controller's, where the manager and the fleet live."""
        self.manager, self.fleet, self.loop, self.read_timeout = manager, fleet, loop, read_timeout
        self.join_seconds = Histogram(
            "switchagg_join_seconds",
            "Time a worker's Join waited, call to answer (the job's other workers included)",
            ["outcome"],
            registry=None,
            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(metrics.SnapshotCollector(self.families))
        self.registry.register(self.join_seconds)

    def observe_join(self, seconds: float, outcome: str) -> None:
        self.join_seconds.labels(outcome).observe(seconds)

    def serve(self, port: int, host: str = metrics.DEFAULT_HOST) -> tuple[str, int]:
        return metrics.serve(self.registry, port, host)

    # -- one scrape ----------------------------------------------------------------------------

    def families(self) -> list[Metric]:
        """In prometheus_client's thread: one snapshot from the loop, then the families."""
        snap = asyncio.run_coroutine_threadsafe(self._snapshot(), self.loop).result(self.read_timeout + 10)
        up = GaugeMetricFamily(
            "switchagg_switch_up", "1 if the data plane answered this scrape's reads", labels=list(SWITCH)
        )
        for switch, plane, value in snap.up:
            up.add_metric([switch, plane], value)
        out: list[Metric] = [up]
        if self.fleet is not None:
            out += self._supervisor_families(snap.supervisors)
        out += metrics.data_plane_families(snap.samples)
        out.append(self._jobs_by_state(snap.views))
        return out

    async def _snapshot(self) -> _Snapshot:
        samples: list[metrics.DataPlaneSample] = []
        up: list[tuple[str, str, int]] = []
        for node in await asyncio.gather(*(self._read_node(*n) for n in self._software_nodes())):
            if isinstance(node, metrics.DataPlaneSample):
                samples.append(node)
                up.append((node.switch, node.data_plane, 1))
            else:
                up.append((*node, 0))
        p4 = self.manager.planes.get(allocation.P4)
        supervisors = []
        if isinstance(p4, P4DataPlane) and self.fleet is not None:
            read = await self.fleet.read_counters(_P4_COUNTERS, self.read_timeout)
            free = self.manager.allocator.free_slots(allocation.P4)  # one pool for all switches
            for switch, values in read.items():
                if isinstance(values, Exception):
                    up.append((switch, allocation.P4, 0))
                    continue
                up.append((switch, allocation.P4, 1))
                samples.append(self._p4_sample(p4, switch, values, free))
            supervisors = [
                (s.name, s.primary, {a: getattr(s, a) for a, _, _ in _SUPERVISOR_COUNTERS})
                for s in self.fleet.supervisors
            ]
        return _Snapshot(samples, up, supervisors, self.manager.list())

    def _software_nodes(self) -> list[tuple[str, str, AggregatorHandle]]:
        """(switch label, data plane, aggregator) of every software node: the software plane's
        (labelled by its address, as `switchagg-aggregator --metrics-port` labels itself), the
        two-level plane's spine and leaves, the P4 plane's software spines."""
        nodes: list[tuple[str, str, AggregatorHandle]] = []
        software = self.manager.planes.get(allocation.SOFTWARE)
        if isinstance(software, SoftwareDataPlane):
            host, port = software.agg.address
            nodes.append((f"{host}:{port}", allocation.SOFTWARE, software.agg))
        two = self.manager.planes.get(allocation.TWO_LEVEL)
        if isinstance(two, TwoLevelDataPlane):
            nodes.append((SPINE, allocation.TWO_LEVEL, two.spine))
            nodes += [
                (s.name, allocation.TWO_LEVEL, a) for s, a in zip(two.spec.leaves, two.leaves, strict=True)
            ]
        p4 = self.manager.planes.get(allocation.P4)
        if isinstance(p4, P4DataPlane):
            nodes += [(name, allocation.P4, plane.agg) for name, plane in p4.spine_planes.items()]
        return nodes

    async def _read_node(
        self, switch: str, plane: str, agg: AggregatorHandle
    ) -> metrics.DataPlaneSample | tuple[str, str]:
        """A sample, or (switch, data plane) of a node that did not answer within the bound. An
        embedded aggregator is read right here (C calls of about 0.1 ms); a remote one is two
        blocking gRPC calls, made in a worker thread."""
        if not isinstance(agg, RemoteAggregator):
            return aggregator.metrics_sample(agg, switch, plane)
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(aggregator.metrics_sample, agg, switch, plane), self.read_timeout
            )
        except Exception:  # away or slow: up 0, its counters left out
            return switch, plane

    @staticmethod
    def _p4_sample(p4: P4DataPlane, switch: str, values: Counters, free: int) -> metrics.DataPlaneSample:
        drops = values[p4_program.DROP_COUNTER]

        def job_sample(job: Job) -> metrics.JobSample:
            # A job this switch is a leaf of counts the leaf counters too (as in software).
            names = p4_program.JOB_COUNTER_NAMES | (
                p4_program.LEAF_COUNTER_NAMES if p4.is_leaf_of(job, switch) else {}
            )
            read = {name: values[counter].get(job.counter_index, (0, 0)) for name, counter in names.items()}
            return metrics.JobSample(
                job.job_id,
                {name: packets for name, (_, packets) in read.items()},
                job.slot_count,
                job.n,
                job.name,
                bytes={name: nbytes for name, (nbytes, _) in read.items()},
            )

        jobs = [job_sample(job) for job in p4.jobs_on(switch)]
        return metrics.DataPlaneSample(
            switch=switch,
            data_plane=allocation.P4,
            drops={name: drops.get(i, (0, 0))[1] for i, name in enumerate(protocol.DROP_REASONS)},
            jobs=jobs,
            # Slot ranges are unique across switches: what a new job could get here is the pool's free.
            pool_slots=sum(j.slots for j in jobs) + free,
        )

    @staticmethod
    def _supervisor_families(supervisors: list[tuple[str, bool, dict[str, int]]]) -> list[Metric]:
        primary = GaugeMetricFamily(
            "switchagg_switch_primary", "1 if this controller is the switch's primary", labels=list(SWITCH)
        )
        counters = {
            name: CounterMetricFamily(name, doc, labels=list(SWITCH)) for _, name, doc in _SUPERVISOR_COUNTERS
        }
        for switch, is_primary, values in supervisors:
            where = [switch, allocation.P4]
            primary.add_metric(where, int(is_primary))
            for attribute, name, _ in _SUPERVISOR_COUNTERS:
                counters[name].add_metric(where, values[attribute])
        return [primary, *counters.values()]

    @staticmethod
    def _jobs_by_state(views: list[JobView]) -> Metric:
        family = GaugeMetricFamily(
            "switchagg_service_jobs", "Jobs of the job service by state", labels=["state"]
        )
        for state in JOB_STATES:
            family.add_metric([state], sum(v.state == state for v in views))
        return family
