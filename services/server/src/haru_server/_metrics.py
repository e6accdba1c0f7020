"""The control server's Prometheus metrics: their definitions and the hooks that move them.

Every metric lives in the app's own registry (``app[metrics_key].registry``) and is updated
from what the server already has in hand (a tick's snapshot, a proxied request's route): the
``/metrics`` route never touches the state store. Names follow Prometheus' conventions
(``haru_`` prefix, ``_total`` counters, ``_seconds``, base units); the server README lists them.

``_metrics_standby`` counts the standby duty cycle. Several workers (``HARU_WORKERS``):
``_metrics_workers`` merges their values (each gauge declares how, ``multiprocess_mode``);
``_access_log`` counts and logs each proxied answer.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Final

from aiohttp import web
from haru_core import is_viable_standby
from haru_protocol import DomainSnapshot, DomainState, FleetSnapshot, SupervisorStatus
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
)

from haru_server._metrics_standby import StandbyDutyCycle
from haru_server._metrics_workers import MetricsExposition

_LATENCY_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_STEP_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_GC_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class ServerMetrics(MetricsExposition):
    """The server's metrics and the hooks that move them (one instance per app).

    ``exposition`` is what ``/metrics`` serves: ``registry`` itself in a single process; with
    ``PROMETHEUS_MULTIPROC_DIR`` set (``HARU_WORKERS``), every worker's files merged (and the
    build info), without prometheus_client's process metrics.

    Args:
        registry: Where the metrics live; a new private registry when None (which also gets
            the process, platform and garbage-collector metrics of prometheus_client in a
            single process).
        version: The ``haru_build_info`` version label (the installed haru-server's).
        monotonic: Monotonic seconds (injected by tests).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        version: str | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(registry, monotonic=monotonic)
        r = self.registry
        Info("haru_build", "The running haru-server's version.", registry=self.exposition).info(
            {"version": version if version is not None else _installed_version()}
        )
        self.domain_state = Gauge(
            "haru_domain_state",
            "1 for the domain's current state as this process last saw it (0 for the others).",
            ["fleet", "domain", "state"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.standby_ready = Gauge(
            "haru_fleet_standby_ready",
            "Standbys that could take the traffic now (ready, answering, no failed inference "
            "slot), as this process's last tick judged them.",
            ["fleet"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self._register_ages()
        self.gc_pause = Histogram(
            "haru_gc_pause_seconds",
            "Pauses of the cyclic garbage collector (the event loop stops for each), by "
            "generation; recorded while the server runs (haru serve).",
            ["generation"],
            buckets=_GC_BUCKETS,
            registry=r,
        )
        self._watch(
            Gauge(
                "haru_gc_frozen_objects",
                "Objects moved to the permanent generation at start-up (gc.freeze): never "
                "scanned (the largest worker's count with several workers).",
                registry=r,
                multiprocess_mode="livemax",
            ),
            gc.get_freeze_count,
        )
        self.reconcile_ticks = Counter(
            "haru_reconcile_ticks", "Reconcile ticks run, by result.", ["result"], registry=r
        )
        self.reconcile_tick_seconds = Histogram(
            "haru_reconcile_tick_duration_seconds",
            "Wall time of one reconcile tick.",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.heartbeat_failures = Counter(
            "haru_heartbeat_failures",
            "Heartbeat polls a supervisor did not answer (unreachable) or refused (unauthorized).",
            ["fleet", "domain", "reason"],
            registry=r,
        )
        self.reconcile_partitioned = Gauge(
            "haru_reconcile_partitioned",
            "1 while this process's latest heartbeat round reached no supervisor of the fleet.",
            ["fleet"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.dead_suspected = Counter(
            "haru_reconcile_dead_suspected",
            "Runs of strong evidence that the active is dead, by evidence and outcome "
            "(suspected: first proof; confirmed: failed after deadConfirmMs; cleared: it "
            "answered again first).",
            ["fleet", "evidence", "outcome"],
            registry=r,
        )
        self.weak_evidence = Counter(
            "haru_reconcile_weak_evidence",
            "Heartbeat rounds in which the active showed only weak evidence (no fast failover).",
            ["fleet", "kind"],
            registry=r,
        )
        self.connect_failed_stamps = Counter(
            "haru_proxy_connect_failed_stamps",
            "Refused or unroutable upstream connects this process recorded in the store.",
            ["fleet"],
            registry=r,
        )
        self.operations_started = Counter(
            "haru_operations_started",
            "Operations claimed (first step started).",
            ["kind"],
            registry=r,
        )
        self.operations_succeeded = Counter(
            "haru_operations_succeeded", "Operations completed.", ["kind"], registry=r
        )
        self.operations_failed = Counter(
            "haru_operations_failed",
            "Operations failed, by error code.",
            ["kind", "code"],
            registry=r,
        )
        self.operations_requested = Counter(
            "haru_operations_requested",
            "Operations created, by kind and trigger: manual (the API), automatic (a failover "
            "the reconciler started) or restore (a demote putting a standby back in posture). "
            "Counted once, by the process whose write created it.",
            ["kind", "trigger"],
            registry=r,
        )
        self.operation_seconds = Histogram(
            "haru_operation_duration_seconds",
            "Time from an operation's creation to its end (application clock), by outcome; "
            "observed once, by the process whose write ended it.",
            ["kind", "outcome"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.proxy_holding = Gauge(
            "haru_proxy_held_requests_in_flight",
            "Inference requests this process holds now, waiting for a failover.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.step_seconds = Histogram(
            "haru_operation_step_duration_seconds",
            "Time from a step's start to the CAS that resolved it (application clock).",
            ["kind", "step", "outcome"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.route_revision = Gauge(
            "haru_fleet_route_revision",
            "Last route revision this process saw.",
            ["fleet"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.active_domain = Gauge(
            "haru_fleet_active_domain",
            "1 for the fleet's active domain as this process last saw it.",
            ["fleet", "domain"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.proxy_requests = Counter(
            "haru_proxy_requests",
            "Inference requests answered, by fleet, model, route and HTTP status.",
            ["fleet", "model", "route", "status"],
            registry=r,
        )
        self.proxy_key_requests = Counter(
            "haru_proxy_key_requests",
            "Inference requests answered, by client key id (admin: the admin token; none: no "
            "key checked) and HTTP status.",
            ["key", "status"],
            registry=r,
        )
        self.upstream_headers_seconds = Histogram(
            "haru_proxy_upstream_time_to_headers_seconds",
            "Time from sending a request upstream to its response headers.",
            ["fleet"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "haru_proxy_time_to_first_token_seconds",
            "Time from a streamed inference request's arrival to the first chunk of its "
            "answer relayed to the client (successful event streams only), by fleet and model.",
            ["fleet", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.proxy_stale = Counter(
            "haru_proxy_stale_requests",
            "Inference requests routed from the cache while the store was unavailable.",
            ["fleet"],
            registry=r,
        )
        self.proxy_held = Counter(
            "haru_proxy_held_requests",
            "Inference requests held while a failover moved the route.",
            ["fleet"],
            registry=r,
        )
        self.proxy_hold_refused = Counter(
            "haru_proxy_hold_refused",
            "Inference requests failed at once with 503 because HARU_FAILOVER_HOLD_MAX "
            "requests were held already.",
            ["fleet"],
            registry=r,
        )
        self.proxy_retried = Counter(
            "haru_proxy_retried_requests",
            "Held inference requests sent to the new active after the first upstream went "
            "away without answering.",
            ["fleet"],
            registry=r,
        )
        self.store_errors = Counter(
            "haru_state_store_errors",
            "State-store failures seen by requests and by reconcile ticks.",
            ["where"],
            registry=r,
        )
        self.pruned_rows = Counter(
            "haru_pruned_rows",
            "Rows the periodic retention prune deleted, by table.",
            ["table"],
            registry=r,
        )
        self.standby_seconds = Counter(
            "haru_standby_seconds",
            "Seconds a domain spent in standby posture (between answered heartbeats).",
            ["fleet", "domain"],
            registry=r,
        )
        self.standby_training_seconds = Counter(
            "haru_standby_training_seconds",
            "Standby seconds during which every training slot of the domain was running.",
            ["fleet", "domain"],
            registry=r,
        )
        self.standby_duty_cycle = Gauge(
            "haru_standby_duty_cycle_ratio",
            "standby_training_seconds / standby_seconds per domain (1 = no idle standby GPU).",
            ["fleet", "domain"],
            registry=r,
            # Several workers: computed at scrape time from the merged counters instead.
            multiprocess_mode="livemax",
        )
        self._standby = StandbyDutyCycle(
            self.standby_seconds,
            self.standby_training_seconds,
            None if self.shared_dir is not None else self.standby_duty_cycle,
        )
        self.clock_skew = Gauge(
            "haru_clock_skew_seconds",
            "This host's wall clock minus the database's (0 before the first reading); "
            "beyond HARU_MAX_CLOCK_SKEW_MS the process stops reconciling.",
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self._active: dict[str, str] = {}
        self._seen: dict[str, FleetSnapshot] = {}
        # Label children of the per-request metrics, looked up once per label set (the
        # cardinality is prometheus_client's own: routed fleets x models x paths x statuses).
        self._answered: dict[tuple[str, str, str, int], Counter] = {}
        self._headers_by_fleet: dict[str, Histogram] = {}
        # Per (fleet, domain) slug, the state ``haru_domain_state`` was last set to.
        self._domain_states: dict[tuple[str, str], DomainState] = {}

    @contextlib.contextmanager
    def watching_gc(self) -> Iterator[None]:
        """Time every collection of the cyclic garbage collector while the block runs."""
        by_generation = [self.gc_pause.labels(str(g)) for g in range(3)]
        started = [0.0]

        def callback(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                by_generation[info["generation"]].observe(time.perf_counter() - started[0])

        gc.callbacks.append(callback)
        try:
            yield
        finally:
            gc.callbacks.remove(callback)

    # -- reconciler ----------------------------------------------------------------------------

    def tick_finished(self, *, ok: bool, seconds: float) -> None:
        self.reconcile_ticks.labels("ok" if ok else "error").inc()
        self.reconcile_tick_seconds.observe(seconds)

    def heartbeat_failed(self, fleet: str, domain: str, *, reason: str) -> None:
        self.heartbeat_failures.labels(fleet, domain, reason).inc()

    def partitioned(self, fleet: str, *, cut_off: bool) -> None:
        self.reconcile_partitioned.labels(fleet).set(1 if cut_off else 0)

    def dead_evidence(self, fleet: str, evidence: str, outcome: str) -> None:
        self.dead_suspected.labels(fleet, evidence, outcome).inc()

    def weak(self, fleet: str, kind: str) -> None:
        self.weak_evidence.labels(fleet, kind).inc()

    def connect_failed_stamped(self, fleet: str) -> None:
        self.connect_failed_stamps.labels(fleet).inc()

    def operation_started(self, kind: str) -> None:
        self.operations_started.labels(kind).inc()

    def step_resolved(self, kind: str, step: str, *, outcome: str, seconds: float) -> None:
        self.step_seconds.labels(kind, step, outcome).observe(max(seconds, 0.0))

    def operation_requested(self, kind: str, trigger: str) -> None:
        """An operation was created (``trigger``: manual, automatic or restore)."""
        self.operations_requested.labels(kind, trigger).inc()

    def operation_ended(self, kind: str, *, outcome: str, seconds: float) -> None:
        """An operation succeeded or failed ``seconds`` after it was created."""
        self.operation_seconds.labels(kind, outcome).observe(max(seconds, 0.0))

    def watch_holding(self, holding: Callable[[], int]) -> None:
        """Read the number of requests held now at each scrape."""
        self._watch(self.proxy_holding, lambda: float(holding()))

    def operation_succeeded(self, kind: str) -> None:
        self.operations_succeeded.labels(kind).inc()

    def operation_failed(self, kind: str, code: str) -> None:
        self.operations_failed.labels(kind, code).inc()

    def store_error(self, where: str) -> None:
        self.store_errors.labels(where).inc()

    def fleet_judged(self, fleet: FleetSnapshot, now: datetime) -> None:
        """Record a tick's view of every domain: its state and the fleet's ready standbys."""
        self.fleet_seen(fleet)
        for domain in fleet.domains:
            key = (fleet.slug, domain.slug)
            if self._domain_states.get(key) is domain.state:
                continue  # the gauges already say so: no label lookups per tick and domain
            if len(self._domain_states) >= 65536:
                self._domain_states.clear()
            self._domain_states[key] = domain.state
            for state in DomainState:
                self.domain_state.labels(fleet.slug, domain.slug, state.value).set(
                    1 if domain.state is state else 0
                )
        ready = sum(1 for d in fleet.domains if is_viable_standby(fleet, d, now=now))
        self.standby_ready.labels(fleet.slug).set(ready)

    def watch_clock_skew(self, skew: Callable[[], timedelta | None]) -> None:
        """Report ``skew()`` (read at each scrape) as ``haru_clock_skew_seconds``."""

        def seconds() -> float:
            value = skew()
            return 0.0 if value is None else value.total_seconds()

        self._watch(self.clock_skew, seconds)

    def pruned(self, *, events: int, operations: int) -> None:
        self.pruned_rows.labels("events").inc(events)
        self.pruned_rows.labels("operations").inc(operations)

    def fleet_seen(self, fleet: FleetSnapshot) -> None:
        """Record a snapshot's route revision and active domain."""
        if self._seen.get(fleet.slug) is fleet:
            return  # the same cached snapshot as the previous request: nothing changed
        if len(self._seen) >= 1024:
            self._seen.clear()
        self._seen[fleet.slug] = fleet
        self.route_revision.labels(fleet.slug).set(fleet.route_revision)
        active = fleet.active_domain
        slug = active.slug if active is not None else ""
        previous = self._active.get(fleet.slug)
        if previous == slug:
            return
        if previous is not None:
            if self.shared_dir is None:
                self.active_domain.remove(fleet.slug, previous)
            else:  # a worker's files keep every series: 0 here, left out of the scrape
                self.active_domain.labels(fleet.slug, previous).set(0)
        self._active[fleet.slug] = slug
        self.active_domain.labels(fleet.slug, slug).set(1)

    def heartbeat_answered(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        status: SupervisorStatus,
        at: datetime,
        *,
        replaced: datetime | None = None,
    ) -> None:
        """Note the heartbeat ``status`` answered at ``at``; count its standby interval.

        ``replaced``: see :meth:`StandbyDutyCycle.answered`.
        """
        self._heartbeat_age.answered[(fleet.slug, domain.slug)] = self._monotonic()
        self._standby.answered(fleet, domain, status, at, replaced)

    # -- proxy ---------------------------------------------------------------------------------

    def proxy_answered(
        self, fleet: str, model: str, path: str, status: int, headers_s: float | None
    ) -> None:
        """Count one proxied answer (and its upstream's time to headers, when it had one)."""
        key = (fleet, model, path, status)
        child = self._answered.get(key)
        if child is None:
            child = self._answered[key] = self.proxy_requests.labels(
                fleet, model, path, str(status)
            )
        child.inc()
        if headers_s is not None:
            histogram = self._headers_by_fleet.get(fleet)
            if histogram is None:
                histogram = self._headers_by_fleet[fleet] = self.upstream_headers_seconds.labels(
                    fleet
                )
            histogram.observe(headers_s)

    def watch_lease_ages(self, ages: Callable[[], dict[str, float]]) -> None:
        """Read the route lease age of every leased fleet (by slug) at each scrape."""
        self._lease_age.ages = ages

    def first_token(self, fleet: str, model: str, seconds: float) -> None:
        """A streamed answer's first chunk reached the client ``seconds`` after the request."""
        self.time_to_first_token.labels(fleet, model).observe(max(seconds, 0.0))

    def request_held(self, fleet: str, *, retried: bool) -> None:
        """A request waited for a failover to move the route (the data path calls this).

        ``retried``: it had reached an upstream that went away without answering, and was
        sent again to the new active.
        """
        self.proxy_held.labels(fleet).inc()
        if retried:
            self.proxy_retried.labels(fleet).inc()

    def hold_refused(self, fleet: str) -> None:
        """A request that would have been held was failed at once: the hold was full."""
        self.proxy_hold_refused.labels(fleet).inc()


def _installed_version() -> str:
    try:
        return importlib.metadata.version("haru-server")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "unknown"


metrics_key: Final = web.AppKey("haru_metrics", ServerMetrics)
