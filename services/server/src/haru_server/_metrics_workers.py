"""Values read at scrape time, and several workers' metrics merged into one exposition.

In a single process, ages and other values kept in memory are read when ``/metrics`` is
scraped. With several workers (``HARU_WORKERS``) the parent sets ``PROMETHEUS_MULTIPROC_DIR``:
every value lives in the worker's files, each worker writes its in-memory values there every
:data:`REFRESH_INTERVAL_S` and before its own scrapes, and the scrape merges all the workers'
files; each gauge declares how (``multiprocess_mode``). The ``process_*`` series are read
from every worker's ``/proc`` entry at scrape time and merged.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Final, Literal

from haru_web import service_registry
from prometheus_client import CollectorRegistry, Gauge, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

MULTIPROC_DIR_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
"""Set (by the ``HARU_WORKERS`` parent) before prometheus_client is imported: every metric
value of the process then lives in a file of that folder, and ``/metrics`` merges them all."""

REFRESH_INTERVAL_S: Final = 1.0
"""With several workers, how often each writes the values read from its memory (ages, held
requests, clock skew) for the others' scrapes."""

ABSENT: Final = -math.inf
"""A shared lease age a worker no longer has (``max`` over workers ignores it; never exported)."""


class HeartbeatAge(Collector):
    """``haru_domain_heartbeat_age_seconds``: time since this process's last answered heartbeat.

    Measured on this process's monotonic clock at scrape time (never a stored time compared
    with another process's clock), so it keeps growing while a supervisor stops answering even
    when no tick runs. Each replica polls every domain, so the freshest view is the minimum
    over replicas.
    """

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self.answered: dict[tuple[str, str], float] = {}
        self._monotonic = monotonic

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "haru_domain_heartbeat_age_seconds",
            "Seconds since this process last got an answered heartbeat from the domain.",
            labels=["fleet", "domain"],
        )
        now = self._monotonic()
        for (fleet, domain), at in sorted(self.answered.items()):
            family.add_metric([fleet, domain], max(now - at, 0.0))
        yield family


class LeaseAge(Collector):
    """``haru_route_lease_age_seconds``: age of the route pointer this process routes on.

    Read from the proxy's route cache at scrape time (``lease_ages``): seconds since the read
    that last confirmed each leased fleet's pointer started. It stays under the lease plus the
    read bound while the store answers; beyond that, requests read before routing (or fail open
    while the store does not answer, which is when it keeps growing).
    """

    def __init__(self) -> None:
        self.ages: Callable[[], dict[str, float]] = dict

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "haru_route_lease_age_seconds",
            "Seconds since the route pointer this process routes the fleet on was confirmed "
            "by a read (fleets with a kept route lease only).",
            labels=["fleet"],
        )
        for fleet, age in sorted(self.ages().items()):
            family.add_metric([fleet], age)
        yield family


class SharedCollector(Collector):
    """Every worker's files merged (prometheus_client's multiprocess mode), made exportable.

    Counters and histograms are summed; each gauge is merged by its ``multiprocess_mode``.
    The series no worker has any more are left out (a former active domain's 0, a lease age
    a worker dropped), and the duty-cycle ratio is computed from the merged counters.
    """

    def __init__(self, path: str) -> None:
        self._merged = MultiProcessCollector(None, path)  # type: ignore[no-untyped-call]

    def collect(self) -> Iterator[Metric]:
        seconds: dict[tuple[str, str], list[float]] = {}
        for metric in self._merged.collect():  # type: ignore[no-untyped-call]
            if metric.name == "haru_fleet_active_domain":
                metric.samples = [s for s in metric.samples if s.value != 0]
            elif metric.name == "haru_route_lease_age_seconds":
                metric.samples = [s for s in metric.samples if s.value != ABSENT]
            elif metric.name == "haru_standby_duty_cycle_ratio":
                continue
            elif metric.name in ("haru_standby_seconds", "haru_standby_training_seconds"):
                index = 0 if metric.name == "haru_standby_seconds" else 1
                for sample in (s for s in metric.samples if s.name.endswith("_total")):
                    key = (sample.labels["fleet"], sample.labels["domain"])
                    seconds.setdefault(key, [0.0, 0.0])[index] += sample.value
            yield metric
        ratio = GaugeMetricFamily(
            "haru_standby_duty_cycle_ratio",
            "standby_training_seconds / standby_seconds per domain (1 = no idle standby GPU).",
            labels=["fleet", "domain"],
        )
        for (fleet, domain), (standby, trained) in sorted(seconds.items()):
            if standby > 0:
                ratio.add_metric([fleet, domain], trained / standby)
        yield ratio


_WORKER_PROCESS_SERIES: Final[
    tuple[tuple[str, Literal["gauge", "counter"], Callable[[Iterable[float]], float], str], ...]
] = (
    ("process_resident_memory_bytes", "gauge", sum, "Resident memory size in bytes"),
    ("process_virtual_memory_bytes", "gauge", sum, "Virtual memory size in bytes"),
    ("process_cpu_seconds", "counter", sum, "Total user and system CPU time spent in seconds"),
    ("process_open_fds", "gauge", sum, "Number of open file descriptors"),
    ("process_start_time_seconds", "gauge", min, "Start time of the process since unix epoch"),
)
"""The ``process_*`` series of a worker set: name (a counter's without ``_total``), type, how
the workers' values merge, and help. ``process_max_fds`` is a per-process limit: not merged."""


class WorkerProcesses(Collector):
    """``process_*`` of every live worker, read at scrape time and merged.

    prometheus_client's process collector reads the one process that answers; this one reads
    each worker whose pid names a file of the shared folder (``/proc/PID``, with that
    collector's own reader; a pid that is gone reads as nothing). Memory, CPU seconds and open
    files are summed over the workers; the start time is the earliest.
    """

    def __init__(self, path: str, proc: str = "/proc") -> None:
        self._path = path
        self._proc = proc
        self._readers: dict[int, ProcessCollector] = {}

    def pids(self) -> set[int]:
        """The pids that name a file of the shared folder (``counter_PID.db``, ...)."""
        found = set()
        for name in os.listdir(self._path):
            kind, _, pid = name.removesuffix(".db").rpartition("_")
            if kind and pid.isdigit():
                found.add(int(pid))
        return found

    def _reader(self, pid: int) -> ProcessCollector:
        def the_pid() -> int:
            return pid

        return ProcessCollector(pid=the_pid, proc=self._proc, registry=None)

    def collect(self) -> Iterator[Metric]:
        pids = self.pids()
        self._readers = {pid: self._readers.get(pid) or self._reader(pid) for pid in sorted(pids)}
        values: dict[str, list[float]] = {}
        for reader in self._readers.values():
            for family in reader.collect():
                for sample in family.samples:
                    values.setdefault(family.name, []).append(sample.value)
        for name, kind, merge, help_text in _WORKER_PROCESS_SERIES:
            if name not in values:
                continue
            documentation = f"{help_text} ({merge.__name__} over the workers)."
            value = merge(values[name])
            if kind == "counter":
                yield CounterMetricFamily(name, documentation, value=value)
            else:
                yield GaugeMetricFamily(name, documentation, value=value)


class MetricsExposition:
    """What ``/metrics`` serves and the values it reads from this process's memory.

    ``exposition`` is ``registry`` itself in a single process; with
    ``PROMETHEUS_MULTIPROC_DIR`` set, every worker's files merged.
    """

    def __init__(
        self, registry: CollectorRegistry | None, *, monotonic: Callable[[], float]
    ) -> None:
        self.shared_dir = os.environ.get(MULTIPROC_DIR_ENV) or None
        if self.shared_dir is None:
            self.registry = registry if registry is not None else service_registry()
            self.exposition = self.registry
        else:
            # Every value is written to this process's files; the scrape merges every worker's.
            self.registry = registry if registry is not None else CollectorRegistry()
            self.exposition = CollectorRegistry()
            self.exposition.register(SharedCollector(self.shared_dir))
            self.exposition.register(WorkerProcesses(self.shared_dir))
        self._monotonic = monotonic
        # Read at scrape time from this process's memory (single process), or written by each
        # worker every REFRESH_INTERVAL_S and before its own scrapes (several workers).
        self._watched: list[tuple[Gauge, Callable[[], float]]] = []
        self._lease_fleets: set[str] = set()

    def _register_ages(self) -> None:
        """Register the heartbeat and route-lease ages (read from memory at scrape time)."""
        r = self.registry
        monotonic = self._monotonic
        self._heartbeat_age = HeartbeatAge(monotonic)
        self._lease_age = LeaseAge()
        if self.shared_dir is None:
            r.register(self._heartbeat_age)
            r.register(self._lease_age)
        else:
            self._shared_heartbeat_age = Gauge(
                "haru_domain_heartbeat_age_seconds",
                "Seconds since a worker last got an answered heartbeat from the domain (the "
                "freshest worker's).",
                ["fleet", "domain"],
                registry=r,
                multiprocess_mode="livemin",
            )
            self._shared_lease_age = Gauge(
                "haru_route_lease_age_seconds",
                "Seconds since the route pointer a worker routes the fleet on was confirmed by "
                "a read (the oldest worker's; fleets with a kept route lease only).",
                ["fleet"],
                registry=r,
                multiprocess_mode="livemax",
            )

    def _watch(self, gauge: Gauge, read: Callable[[], float]) -> None:
        if self.shared_dir is None:
            gauge.set_function(read)
        else:
            self._watched.append((gauge, read))

    def refresh(self) -> None:
        """With several workers: write this worker's values read from memory to its files.

        Ages, held requests, clock skew and frozen objects are read at scrape time in a single
        process; a worker cannot read another's memory, so each writes them every
        :data:`REFRESH_INTERVAL_S` and just before it answers a scrape. No-op otherwise.
        """
        if self.shared_dir is None:
            return
        for gauge, read in self._watched:
            gauge.set(read())
        now = self._monotonic()
        for (fleet, domain), at in self._heartbeat_age.answered.items():
            self._shared_heartbeat_age.labels(fleet, domain).set(max(now - at, 0.0))
        ages = self._lease_age.ages()
        for fleet in self._lease_fleets - ages.keys():
            self._shared_lease_age.labels(fleet).set(ABSENT)
        for fleet, age in ages.items():
            self._shared_lease_age.labels(fleet).set(age)
        self._lease_fleets = set(ages)

    async def before_scrape(self) -> None:
        """Refresh this worker's scrape-time values (``add_metrics_route``'s hook)."""
        self.refresh()

    @contextlib.contextmanager
    def refreshing(self) -> Iterator[None]:
        """With several workers, :meth:`refresh` every :data:`REFRESH_INTERVAL_S` in the block.

        Runs inside the event loop (timer callbacks); a no-op in a single process.
        """
        if self.shared_dir is None:
            yield
            return
        loop = asyncio.get_running_loop()
        timer: list[asyncio.TimerHandle] = []

        def tick() -> None:
            try:
                self.refresh()
            finally:
                timer[:] = [loop.call_later(REFRESH_INTERVAL_S, tick)]

        tick()
        try:
            yield
        finally:
            for handle in timer:
                handle.cancel()
