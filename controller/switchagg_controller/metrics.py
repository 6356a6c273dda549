"""The controller's Prometheus metrics: `switchagg-ctl serve --metrics-port`.

Built at scrape time, like the aggregator's (switchagg.metrics): the data planes' counters (the
P4 switches' counter arrays read over P4Runtime, the embedded software aggregator's C counters)
under the same names and labels as `switchagg-aggregator --metrics-port`, plus what only the
controller knows: jobs by state, join latency, and each switch's supervisor counters.

A scrape never waits long: each switch is read with a bound (``read_timeout``), all switches in
parallel; a switch that is away or slow is `switchagg_switch_up 0` and its counters are left out
(not zeros, which would read as a counter reset). The job list is taken with a bounded wait for
the job manager's lock (held while a job is installed); a busy manager gives the last list.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from switchagg import metrics, protocol
from switchagg_controller import allocation, p4_program
from switchagg_controller.dataplane import P4DataPlane, SoftwareDataPlane
from switchagg_controller.jobs import JobManager, JobView
from switchagg_controller.supervisor import Counters, SwitchFleet

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


class ControllerMetrics:
    def __init__(self, manager: JobManager, fleet: SwitchFleet | None, read_timeout: float = 2.0) -> None:
        self.manager, self.fleet, self.read_timeout = manager, fleet, read_timeout
        self._views: list[JobView] = []
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
        samples: list[metrics.DataPlaneSample] = []
        up = GaugeMetricFamily(
            "switchagg_switch_up", "1 if the data plane answered this scrape's reads", labels=list(SWITCH)
        )
        software = self.manager.planes.get(allocation.SOFTWARE)
        if isinstance(software, SoftwareDataPlane):
            sample = software.agg.metrics_sample()
            samples.append(sample)
            up.add_metric([sample.switch, sample.data_plane], 1)
        out: list[Metric] = [up]
        p4 = self.manager.planes.get(allocation.P4)
        if isinstance(p4, P4DataPlane) and self.fleet is not None:
            read = self.fleet.read_counters(_P4_COUNTERS, self.read_timeout)
            free = self.manager.allocator.free_slots(allocation.P4)  # one pool for all switches
            for switch, values in read.items():
                if isinstance(values, Exception):
                    up.add_metric([switch, allocation.P4], 0)
                    continue
                up.add_metric([switch, allocation.P4], 1)
                samples.append(self._p4_sample(p4, switch, values, free))
            out += self._supervisor_families()
        out += metrics.data_plane_families(samples)
        out.append(self._jobs_by_state())
        return out

    @staticmethod
    def _p4_sample(p4: P4DataPlane, switch: str, values: Counters, free: int) -> metrics.DataPlaneSample:
        drops = values[p4_program.DROP_COUNTER]
        jobs = [
            metrics.JobSample(
                job.job_id,
                {  # a job this switch is a leaf of counts the leaf counters too (as in software)
                    name: values[counter].get(job.counter_index, (0, 0))[1]
                    for name, counter in (
                        p4_program.JOB_COUNTER_NAMES
                        | (p4_program.LEAF_COUNTER_NAMES if p4.is_leaf_of(job, switch) else {})
                    ).items()
                },
                job.slot_count,
                job.n,
                job.name,
            )
            for job in p4.jobs_on(switch)
        ]
        return metrics.DataPlaneSample(
            switch=switch,
            data_plane=allocation.P4,
            drops={name: drops.get(i, (0, 0))[1] for i, name in enumerate(protocol.DROP_REASONS)},
            jobs=jobs,
            # Slot ranges are unique across switches: what a new job could get here is the pool's free.
            pool_slots=sum(j.slots for j in jobs) + free,
        )

    def _supervisor_families(self) -> list[Metric]:
        assert self.fleet is not None
        primary = GaugeMetricFamily(
            "switchagg_switch_primary", "1 if this controller is the switch's primary", labels=list(SWITCH)
        )
        counters = {
            name: CounterMetricFamily(name, doc, labels=list(SWITCH)) for _, name, doc in _SUPERVISOR_COUNTERS
        }
        for s in self.fleet.supervisors:
            where = [s.name, allocation.P4]
            primary.add_metric(where, int(s.primary))
            for attribute, name, _ in _SUPERVISOR_COUNTERS:
                counters[name].add_metric(where, getattr(s, attribute))
        return [primary, *counters.values()]

    def _jobs_by_state(self) -> Metric:
        try:
            self._views = self.manager.list(timeout=self.read_timeout)
        except TimeoutError:
            pass  # installing a job on a slow switch: the last list
        family = GaugeMetricFamily(
            "switchagg_service_jobs", "Jobs of the job service by state", labels=["state"]
        )
        for state in JOB_STATES:
            family.add_metric([state], sum(v.state == state for v in self._views))
        return family
