"""The control server's application factory and its lifecycles."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from uuid import UUID

import aiohttp
from aiohttp import web
from haru_core import inference_bindings, lease_guard_ms
from haru_db import HaruDbError, StateStore
from haru_driver_skypilot import SkyPilotDriver
from haru_driver_skyserve import SkyServeDriver
from haru_protocol import DomainSnapshot, Provider
from haru_supervisor_client import SupervisorClient, SupervisorLinks, is_loopback_url
from haru_web import (
    OPENAPI_PATH,
    add_metrics_route,
    bearer_middleware,
    browser_guard_middleware,
    current_request_id,
    error_middleware,
    install_request_ids,
    metrics_guarded,
    openapi_handler,
    request_id_middleware,
)
from yarl import URL

from haru_server._apply import apply_routes
from haru_server._clock import (
    SAMPLE_INTERVAL_S,
    Clock,
    OffsetFileClock,
    SkewGate,
    StoreClock,
    utc_now,
)
from haru_server._key_routes import key_routes
from haru_server._keys import (
    FleetKicker,
    api_token_key,
    clock_key,
    draining_key,
    kick_fleet_key,
    loop_key,
    promotion_accepted_key,
    provisioner_key,
    reconciler_key,
    schema_gate_key,
    settings_key,
    store_clock_key,
    store_key,
)
from haru_server._loop import FleetKickers, LoopOptions, ReconcileLoop
from haru_server._metrics import ServerMetrics, metrics_key, proxy_access_middleware
from haru_server._middleware import store_error_middleware
from haru_server._pki import FleetPki, pki_key
from haru_server._provisioning import Provisioner, ProvisionerOptions
from haru_server._proxy import ProxyTuning, install_proxy, observe_promotion, observe_route_move
from haru_server._proxy_routes import PROXIED_PATHS
from haru_server._ready import ready_routes
from haru_server._reconciler import Reconciler, ReconcilerOptions
from haru_server._retention import Pruner
from haru_server._routes import routes
from haru_server._schema_gate import SchemaGate
from haru_server._settings import Settings
from haru_server.openapi import api_table

logger = logging.getLogger(__name__)

_kickers_key = web.AppKey("kickers", FleetKickers)
_owns_store_key = web.AppKey("owns_store", bool)
_reconciler_options_key = web.AppKey("reconciler_options", ReconcilerOptions)
_busy_interval_key = web.AppKey("busy_interval_s", float)
_links_key = web.AppKey("supervisor_links", SupervisorLinks)

SUPERVISOR_CONNECTIONS = 64
"""Concurrent connections to supervisors (heartbeats of every fleet share them)."""


def create_app(
    settings: Settings,
    *,
    store: StateStore | None = None,
    clock: Clock | None = None,
    reconciler_options: ReconcilerOptions | None = None,
    busy_interval_s: float = 0.15,
    proxy_tuning: ProxyTuning | None = None,
) -> web.Application:
    """Build the control server: control API, reconciler, background loop and the proxy.

    Args:
        settings: The parsed environment.
        store: An open state store to use (the caller closes it); None opens one from
            ``settings.database_url`` and closes it at cleanup. Migrations are not applied
            here (see :func:`haru_server.serve`).
        clock: The application clock (tests inject one to drive budgets); None samples the
            database's clock (:class:`StoreClock`), compared with this host's (plus
            ``settings.clock_offset_file``'s offset when that is set) to refuse ticks beyond
            ``settings.max_clock_skew_ms``.
        reconciler_options: Tuning of the reconcile tick.
        busy_interval_s: Loop pause between ticks of a fleet with an operation in flight.
        proxy_tuning: The proxy's non-environment knobs (tests inject its monotonic clock).
    """
    # Asked per request: a rotated HARU_API_TOKEN_FILE takes effect without a restart.
    api_token = settings.api_token_source()
    app = web.Application(
        middlewares=[
            request_id_middleware,
            error_middleware,
            proxy_access_middleware(PROXIED_PATHS),
            browser_guard_middleware(
                open_api=settings.api_token is None, check_host=not settings.open_to_network
            ),
            # The proxied routes check their own credential: a client key (_client_keys).
            bearer_middleware(
                api_token,
                guarded=_admin_guarded(metrics_guarded(public=settings.metrics_public)),
            ),
            store_error_middleware,
        ]
    )
    install_request_ids(app)
    metrics = ServerMetrics()
    app[metrics_key] = metrics
    add_metrics_route(app, metrics.exposition, before_scrape=metrics.before_scrape)
    app[settings_key] = settings
    app[api_token_key] = api_token
    app[_links_key] = settings.supervisor_links()
    app[draining_key] = asyncio.Event()
    app[_owns_store_key] = store is None
    app[store_key] = store if store is not None else StateStore.open(settings.database_url)
    app[schema_gate_key] = SchemaGate(app[store_key].url)
    app_clock: Clock
    store_clock: StoreClock | None = None
    if clock is not None:
        app_clock = clock
    else:
        local: Clock = utc_now
        if settings.clock_offset_file is not None:
            local = OffsetFileClock(settings.clock_offset_file)
        # Stored times are the database's: wall clocks of different hosts never meet.
        store_clock = StoreClock(
            app[store_key].database_now,
            local=local,
            max_skew=timedelta(milliseconds=settings.max_clock_skew_ms),
        )
        app_clock = store_clock
        metrics.watch_clock_skew(lambda: store_clock.skew)
    app[clock_key] = app_clock
    app[store_clock_key] = store_clock
    kickers = FleetKickers()
    app[_kickers_key] = kickers
    kick: FleetKicker = kickers
    app[kick_fleet_key] = kick
    app[_reconciler_options_key] = reconciler_options or ReconcilerOptions()
    app[_busy_interval_key] = busy_interval_s
    app.cleanup_ctx.extend([_store_ctx, _clock_ctx, _retention_ctx, _reconciler_ctx, _loop_ctx])
    app.add_routes(routes)
    app.add_routes(apply_routes)
    app.add_routes(key_routes)
    app.add_routes(ready_routes)
    install_proxy(app, tuning=proxy_tuning)
    noted: Callable[[UUID], None] = functools.partial(observe_promotion, app)
    app[promotion_accepted_key] = noted
    app.router.add_get(OPENAPI_PATH, openapi_handler(api_table()))
    return app


def _admin_guarded(guarded: Callable[[str], bool]) -> Callable[[str], bool]:
    def check(path: str) -> bool:
        return path not in PROXIED_PATHS and guarded(path)

    return check


async def _store_ctx(app: web.Application) -> AsyncIterator[None]:
    if app[_owns_store_key]:
        # Open a pooled connection before the socket is bound: the first request's route
        # read is bounded (250 ms), and a connection set up under load (TCP, auth, session
        # settings) could take longer than that, leaving a cold process nothing to answer
        # with but 503 (docs/FAULTS.md, finding 4).
        try:
            await app[store_key].ping()
        except HaruDbError as exc:
            logger.warning("state store not reachable before listening (requests retry): %s", exc)
    yield
    if app[_owns_store_key]:
        await app[store_key].close()


async def _clock_ctx(app: web.Application) -> AsyncIterator[None]:
    clock = app[store_clock_key]
    if clock is None:
        yield
        return
    # Read before listening, so the first requests and ticks already use the database's time.
    await clock.sample()
    task = asyncio.create_task(_sample_clock(clock), name="haru-clock-sample")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _sample_clock(clock: StoreClock) -> None:
    while True:
        await asyncio.sleep(SAMPLE_INTERVAL_S)
        await clock.sample()


async def _retention_ctx(app: web.Application) -> AsyncIterator[None]:
    days = app[settings_key].retention_days
    if not app[_owns_store_key]:
        # A store handed in (embedding, tests) is pruned by its owner, never behind its back.
        yield
        return
    if days == 0:
        logger.info("retention off (HARU_RETENTION_DAYS=0): operations and events are kept")
        yield
        return
    pruner = Pruner(
        app[store_key], app[clock_key], retention=timedelta(days=days), metrics=app[metrics_key]
    )
    logger.info("retention: finished operations and events older than %d day(s) are pruned", days)
    pruner.start()
    try:
        yield
    finally:
        await pruner.stop()


async def _reconciler_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[settings_key]
    connector = aiohttp.TCPConnector(limit=SUPERVISOR_CONNECTIONS)
    async with aiohttp.ClientSession(connector=connector) as session:
        # `skypilot` domains get certificates from their fleet's CA; the client trusts that
        # CA (and each domain's name) at the addresses the provisioner records.
        pki = FleetPki(
            app[store_key], settings.store_key(), validity_days=settings.domain_cert_days
        )
        # The proxy verifies a `skypilot` domain's gateway against the same CA.
        app[pki_key] = pki
        links = dataclasses.replace(app[_links_key], issued=pki.trusts)
        # Asked per call: a rotated HARU_SUPERVISOR_TOKEN_FILE takes effect without a restart.
        supervisor_token = settings.supervisor_token_source()
        token = None if supervisor_token is None else supervisor_token.current
        client = SupervisorClient(
            session,
            token=token,
            request_id=current_request_id,
            links=links,
        )
        await _warn_plaintext_domains(app[store_key], allowed=links.allow_plaintext)
        await _warn_plaintext_serving(app[store_key], allowed=links.allow_plaintext)
        options = app[_reconciler_options_key]
        # The control path honours the route lease: the old active is drained only once every
        # process's lease has run out, and a flip made here reaches this process's proxy at once.
        tuning = dataclasses.replace(
            options.tuning,
            route_guard_s=max(
                options.tuning.route_guard_s, lease_guard_ms(settings.route_lease_ms) / 1000
            ),
            route_moved=functools.partial(observe_route_move, app),
        )
        # `skypilot` and `skyserve` domains are launched through the `sky` CLI on PATH; a
        # fleet without them never runs it.
        provisioner = Provisioner(
            app[store_key],
            SkyPilotDriver(),
            clock=app[clock_key],
            supervisor_token=token,
            serving_token=settings.serving_token_value(),
            service_driver=SkyServeDriver(),
            pki=pki,
            options=ProvisionerOptions(status_interval_s=settings.sky_status_interval_ms / 1000),
        )
        app[provisioner_key] = provisioner
        store_clock = app[store_clock_key]
        app[reconciler_key] = Reconciler(
            app[store_key],
            client,
            clock=app[clock_key],
            options=dataclasses.replace(options, tuning=tuning),
            metrics=app[metrics_key],
            provisioner=provisioner,
            gate=None if store_clock is None else SkewGate(store_clock, app[store_key]),
            schema_gate=app[schema_gate_key],
        )
        try:
            yield
        finally:
            await app[reconciler_key].close()
            await provisioner.close()


async def _loop_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[settings_key]
    interval_ms = settings.reconcile_interval_ms
    if interval_ms is None:
        app[loop_key] = None
        await _warn_auto_failover_without_loop(app[store_key])
        yield
        return
    loop = ReconcileLoop(
        app[reconciler_key],
        app[store_key],
        LoopOptions(
            interval_s=interval_ms / 1000,
            busy_interval_s=min(app[_busy_interval_key], interval_ms / 1000),
            fleets=settings.reconcile_fleets,
        ),
    )
    app[loop_key] = loop
    app[_kickers_key].attach(loop)
    fleets = "every fleet" if settings.reconcile_fleets is None else settings.reconcile_fleets
    logger.info("reconcile loop every %d ms for %s", interval_ms, fleets)
    await _warn_auto_failover_outside_loop(app[store_key], loop)
    loop.start()
    try:
        yield
    finally:
        app[_kickers_key].attach(None)
        await loop.stop()


async def _warn_auto_failover_without_loop(store: StateStore) -> None:
    try:
        pointers = await store.list_fleets()
        armed = []
        for pointer in pointers:
            fleet = await store.get_fleet_snapshot(str(pointer.id))
            if fleet is not None and fleet.policy.auto_failover:
                armed.append(fleet.slug)
    except HaruDbError as exc:
        logger.warning("could not check fleets for autoFailover at boot: %s", exc)
        return
    if armed:
        logger.warning(
            "!!! autoFailover is ON for fleet(s) %s but HARU_RECONCILE_INTERVAL_MS is off: "
            "no reconcile loop runs, so NOTHING will fail over automatically. Unset "
            "HARU_RECONCILE_INTERVAL_MS (the loop's default) or drive "
            "POST /v1/fleets/{ref}/reconcile.",
            ", ".join(armed),
        )


async def _warn_plaintext_domains(store: StateStore, *, allowed: bool) -> None:
    """Name every domain whose supervisor is reached over plain HTTP beyond loopback."""
    try:
        clear: list[tuple[str, str, str]] = []
        for pointer in await store.list_fleets():
            fleet = await store.get_fleet_snapshot(str(pointer.id))
            if fleet is None:
                continue
            for domain in fleet.domains:
                url = domain.supervisor_url
                if url is not None and url.startswith("http://") and not is_loopback_url(url):
                    clear.append((fleet.slug, domain.slug, url))
    except HaruDbError as exc:
        logger.warning("could not check domains for plain-HTTP supervisors at boot: %s", exc)
        return
    for fleet_slug, domain_slug, url in clear:
        if allowed:
            logger.warning(
                "domain %s of fleet %s: supervisor %s is reached in CLEAR TEXT (the supervisor "
                "token and every call readable on the network; HARU_ALLOW_PLAINTEXT is set)",
                domain_slug,
                fleet_slug,
                url,
            )
        else:
            logger.error(
                "domain %s of fleet %s: supervisor %s is plain HTTP on another host: every call "
                "to it is refused (its heartbeats fail) until it serves https:// or "
                "HARU_ALLOW_PLAINTEXT=1 allows clear text on a private network",
                domain_slug,
                fleet_slug,
                url,
            )


async def _warn_plaintext_serving(store: StateStore, *, allowed: bool) -> None:
    """Name every domain whose serving endpoint is reached over plain HTTP beyond loopback."""
    try:
        clear: list[tuple[str, DomainSnapshot, str]] = []
        for pointer in await store.list_fleets():
            fleet = await store.get_fleet_snapshot(str(pointer.id))
            if fleet is None:
                continue
            for domain in fleet.domains:
                urls = [str(b.serving_url) for b in inference_bindings(domain) if b.serving_url]
                plain = [u for u in urls if u.startswith("http://") and not is_loopback_url(u)]
                if plain:
                    clear.append((fleet.slug, domain, str(URL(plain[0]).origin())))
    except HaruDbError as exc:
        logger.warning("could not check domains for plain-HTTP serving endpoints at boot: %s", exc)
        return
    for fleet_slug, domain, origin in clear:
        if allowed or domain.provider is Provider.SKYSERVE:
            why = (
                "a skyserve endpoint has no certificate"
                if domain.provider is Provider.SKYSERVE and not allowed
                else "HARU_ALLOW_PLAINTEXT is set"
            )
            logger.warning(
                "domain %s of fleet %s: serving endpoint %s is reached in CLEAR TEXT (every "
                "prompt, completion and its serving credential readable on the network; %s)",
                domain.slug,
                fleet_slug,
                origin,
                why,
            )
        else:
            logger.error(
                "domain %s of fleet %s: serving endpoint %s is plain HTTP on another host: every "
                "request routed to it is refused (502) until it serves https:// or "
                "HARU_ALLOW_PLAINTEXT=1 allows clear text on a private network",
                domain.slug,
                fleet_slug,
                origin,
            )


async def _warn_auto_failover_outside_loop(store: StateStore, loop: ReconcileLoop) -> None:
    if loop.fleet_refs is None:
        return
    try:
        uncovered = []
        for pointer in await store.list_fleets():
            fleet = await store.get_fleet_snapshot(str(pointer.id))
            if fleet is not None and fleet.policy.auto_failover and not await loop.covers(fleet.id):
                uncovered.append(fleet.slug)
    except HaruDbError as exc:
        logger.warning("could not check fleets for autoFailover at boot: %s", exc)
        return
    if uncovered:
        logger.warning(
            "!!! autoFailover is ON for fleet(s) %s but HARU_RECONCILE_FLEETS (%s) does not name "
            "them: NOTHING will fail over there, and promote/demote are refused (409 "
            "fleet_not_reconciled). Add them, or unset HARU_RECONCILE_FLEETS (every fleet).",
            ", ".join(uncovered),
            ",".join(loop.fleet_refs),
        )
