"""The control server's runtime: one object that owns every long-lived part (DESIGN 7.6).

:class:`ControlPlane` is built by :func:`haru_server.api.create_app` and started by one
``cleanup_ctx`` (:meth:`ControlPlane.run`), which opens, in this order, the state store, the
database-clock sampler, the retention pruner, the supervisor client with the provisioner and
the reconciler, the background reconcile loop and the inference proxy; cleanup closes them in
the reverse order. Routes reach it through ``app[control_plane_key]`` and call its methods:
:meth:`ControlPlane.operation_accepted` when a request created an operation (the proxy holds
for a promotion, the loop starts it at once) and :meth:`ControlPlane.kick` when a fleet wants
a reconcile now. A flip made by this process reaches its proxy through the reconciler
(:meth:`haru_server._proxy.InferenceProxy.note_route_move`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from uuid import UUID

import aiohttp
from aiohttp import web
from haru_core import lease_guard_ms
from haru_db import HaruDbError, StateStore
from haru_driver_skypilot import SkyPilotDriver
from haru_driver_skyserve import SkyServeDriver
from haru_protocol import OperationKind
from haru_supervisor_client import SupervisorClient, SupervisorLinks
from haru_web import current_request_id

from haru_server._clock import SAMPLE_INTERVAL_S, Clock, SkewGate, StoreClock
from haru_server._loop import LoopOptions, ReconcileLoop
from haru_server._metrics import ServerMetrics
from haru_server._pki import FleetPki
from haru_server._provisioning import Provisioner, ProvisionerOptions
from haru_server._proxy import InferenceProxy, ProxyTuning
from haru_server._reconciler import Accepted, Reconciler, ReconcilerOptions
from haru_server._retention import Pruner
from haru_server._schema_gate import SchemaGate
from haru_server._settings import Settings
from haru_server._startup_checks import (
    warn_auto_failover_outside_loop,
    warn_auto_failover_without_loop,
    warn_plaintext_domains,
    warn_plaintext_serving,
)

logger = logging.getLogger(__name__)

SUPERVISOR_CONNECTIONS = 64
"""Concurrent connections to supervisors (heartbeats of every fleet share them)."""


class ControlPlaneNotRunningError(RuntimeError):
    """A part that exists only between startup and cleanup was asked for outside them."""


class ControlPlane:
    """Everything one control server runs, and the one place that wires it.

    Args:
        settings: The parsed environment.
        store: The state store.
        owns_store: The store was opened for this app: ping it before listening, close it at
            cleanup, and prune it (``HARU_RETENTION_DAYS``). A store handed in is its owner's.
        clock: The application clock.
        store_clock: The database-clock sampler behind ``clock``; None when one was injected.
        metrics: The app's metrics.
        schema_gate: Refuses ticks while a newer release's schema is in the store.
        reconciler_options: Tuning of the reconcile tick.
        busy_interval_s: Loop pause between ticks of a fleet with an operation in flight.
        proxy_tuning: The proxy's non-environment knobs.
        links: How the supervisor client reaches supervisors.
    """

    def __init__(
        self,
        settings: Settings,
        store: StateStore,
        *,
        owns_store: bool,
        clock: Clock,
        store_clock: StoreClock | None,
        metrics: ServerMetrics,
        schema_gate: SchemaGate,
        reconciler_options: ReconcilerOptions,
        busy_interval_s: float,
        proxy_tuning: ProxyTuning,
        links: SupervisorLinks,
    ) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.store_clock = store_clock
        self.metrics = metrics
        self.schema_gate = schema_gate
        self.proxy = InferenceProxy(proxy_tuning, kicker=self)
        """The inference proxy; its resources are open while :meth:`run` is."""
        self._owns_store = owns_store
        self._reconciler_options = reconciler_options
        self._busy_interval_s = busy_interval_s
        self._links = links
        self._reconciler: Reconciler | None = None
        self._provisioner: Provisioner | None = None
        self._loop: ReconcileLoop | None = None

    # -- the parts that run between startup and cleanup -----------------------------------------

    @property
    def reconciler(self) -> Reconciler:
        """Runs reconcile ticks (the loop's, and ``POST /v1/fleets/{ref}/reconcile``'s)."""
        if self._reconciler is None:
            raise ControlPlaneNotRunningError("the reconciler runs only while the app does")
        return self._reconciler

    @property
    def provisioner(self) -> Provisioner:
        """Drives ``skypilot`` and ``skyserve`` domains (the domain routes read through it)."""
        if self._provisioner is None:
            raise ControlPlaneNotRunningError("the provisioner runs only while the app does")
        return self._provisioner

    @property
    def loop(self) -> ReconcileLoop | None:
        """The background loop; None when ``HARU_RECONCILE_INTERVAL_MS`` turns it off."""
        return self._loop

    # -- what the routes and the proxy tell it -------------------------------------------------

    def operation_accepted(self, accepted: Accepted) -> None:
        """A request of this process created ``accepted.operation``.

        A promotion's proxy holds for it at once (other processes learn it from their next
        pointer read, at most one lease later), and the loop starts the operation now from
        the snapshot the request validated it on.
        """
        if accepted.operation.kind is OperationKind.PROMOTE:
            self.proxy.note_promotion(accepted.fleet.id)
        self._kick(accepted.fleet.id, start=accepted)

    def kick(self, fleet_id: UUID) -> None:
        """Reconcile ``fleet_id`` now (never blocks; dropped when no loop runs)."""
        self._kick(fleet_id, start=None)

    def _kick(self, fleet_id: UUID, *, start: Accepted | None) -> None:
        if self._loop is None:
            logger.debug("kick of fleet %s dropped: no reconcile loop runs", fleet_id)
            return
        self._loop.kick(fleet_id, start=start)

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, app: web.Application) -> AsyncIterator[None]:
        """The app's ``cleanup_ctx``: open every part in order, close them in reverse."""
        async with contextlib.AsyncExitStack() as stack:
            await self._open_store(stack)
            await self._start_clock(stack)
            self._start_retention(stack)
            pki = await self._start_reconciler(stack)
            await self._start_loop(stack)
            await stack.enter_async_context(self.proxy.open(app, pki=pki))
            yield

    async def _open_store(self, stack: contextlib.AsyncExitStack) -> None:
        if not self._owns_store:
            return
        # Open a pooled connection before the socket is bound: the first request's route
        # read is bounded (250 ms), and a connection set up under load (TCP, auth, session
        # settings) could take longer than that, leaving a cold process nothing to answer
        # with but 503 (docs/FAULTS.md, finding 4).
        try:
            await self.store.ping()
        except HaruDbError as exc:
            logger.warning("state store not reachable before listening (requests retry): %s", exc)
        stack.push_async_callback(self.store.close)

    async def _start_clock(self, stack: contextlib.AsyncExitStack) -> None:
        clock = self.store_clock
        if clock is None:
            return
        # Read before listening, so the first requests and ticks already use the database's time.
        await clock.sample()
        task = asyncio.create_task(_sample_clock(clock), name="haru-clock-sample")
        stack.push_async_callback(_cancel, task)

    def _start_retention(self, stack: contextlib.AsyncExitStack) -> None:
        days = self.settings.retention_days
        if not self._owns_store:
            # A store handed in (embedding, tests) is pruned by its owner, never behind its back.
            return
        if days == 0:
            logger.info("retention off (HARU_RETENTION_DAYS=0): operations and events are kept")
            return
        pruner = Pruner(
            self.store, self.clock, retention=timedelta(days=days), metrics=self.metrics
        )
        logger.info(
            "retention: finished operations and events older than %d day(s) are pruned", days
        )
        pruner.start()
        stack.push_async_callback(pruner.stop)

    async def _start_reconciler(self, stack: contextlib.AsyncExitStack) -> FleetPki:
        settings = self.settings
        connector = aiohttp.TCPConnector(limit=SUPERVISOR_CONNECTIONS)
        session = await stack.enter_async_context(aiohttp.ClientSession(connector=connector))
        # `skypilot` domains get certificates from their fleet's CA; the client trusts that
        # CA (and each domain's name) at the addresses the provisioner records.
        pki = FleetPki(self.store, settings.store_key(), validity_days=settings.domain_cert_days)
        links = dataclasses.replace(self._links, issued=pki.trusts)
        # Asked per call: a rotated HARU_SUPERVISOR_TOKEN_FILE takes effect without a restart.
        supervisor_token = settings.supervisor_token_source()
        token = None if supervisor_token is None else supervisor_token.current
        client = SupervisorClient(
            session,
            token=token,
            request_id=current_request_id,
            links=links,
        )
        await warn_plaintext_domains(self.store, allowed=links.allow_plaintext)
        await warn_plaintext_serving(self.store, allowed=links.allow_plaintext)
        options = self._reconciler_options
        # The control path honours the route lease: the old active is drained only once every
        # process's lease has run out (a flip made here reaches this process's proxy at once).
        tuning = dataclasses.replace(
            options.tuning,
            route_guard_s=max(
                options.tuning.route_guard_s, lease_guard_ms(settings.route_lease_ms) / 1000
            ),
        )
        # `skypilot` and `skyserve` domains are launched through the `sky` CLI on PATH; a
        # fleet without them never runs it.
        provisioner = Provisioner(
            self.store,
            SkyPilotDriver(),
            clock=self.clock,
            supervisor_token=token,
            serving_token=settings.serving_token_value(),
            service_driver=SkyServeDriver(),
            pki=pki,
            options=ProvisionerOptions(status_interval_s=settings.sky_status_interval_ms / 1000),
        )
        stack.push_async_callback(provisioner.close)
        self._provisioner = provisioner
        reconciler = Reconciler(
            self.store,
            client,
            clock=self.clock,
            options=dataclasses.replace(options, tuning=tuning),
            metrics=self.metrics,
            provisioner=provisioner,
            gate=None if self.store_clock is None else SkewGate(self.store_clock, self.store),
            schema_gate=self.schema_gate,
            proxy=self.proxy,
        )
        stack.push_async_callback(reconciler.close)
        self._reconciler = reconciler
        # The proxy verifies a `skypilot` domain's gateway against the same CA.
        return pki

    async def _start_loop(self, stack: contextlib.AsyncExitStack) -> None:
        settings = self.settings
        interval_ms = settings.reconcile_interval_ms
        if interval_ms is None:
            await warn_auto_failover_without_loop(self.store)
            return
        loop = ReconcileLoop(
            self.reconciler,
            self.store,
            LoopOptions(
                interval_s=interval_ms / 1000,
                busy_interval_s=min(self._busy_interval_s, interval_ms / 1000),
                fleets=settings.reconcile_fleets,
            ),
        )
        fleets = "every fleet" if settings.reconcile_fleets is None else settings.reconcile_fleets
        logger.info("reconcile loop every %d ms for %s", interval_ms, fleets)
        await warn_auto_failover_outside_loop(self.store, loop)
        self._loop = loop
        loop.start()
        stack.push_async_callback(self._stop_loop, loop)

    async def _stop_loop(self, loop: ReconcileLoop) -> None:
        self._loop = None
        await loop.stop()


async def _sample_clock(clock: StoreClock) -> None:
    while True:
        await asyncio.sleep(SAMPLE_INTERVAL_S)
        await clock.sample()


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
