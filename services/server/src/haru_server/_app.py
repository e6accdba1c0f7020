"""The control server's application factory and its lifecycles."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from aiohttp import web
from haru_db import StateStore
from haru_web import add_metrics_route, service_app

from haru_server._access_log import proxy_access_middleware
from haru_server._apply import apply_routes
from haru_server._clock import Clock, OffsetFileClock, StoreClock, utc_now
from haru_server._control_plane import ControlPlane
from haru_server._domain_routes import domain_routes
from haru_server._key_routes import key_routes
from haru_server._keys import (
    api_token_key,
    clock_key,
    control_plane_key,
    draining_key,
    schema_gate_key,
    settings_key,
    store_clock_key,
    store_key,
)
from haru_server._metrics import ServerMetrics, metrics_key
from haru_server._middleware import store_error_middleware
from haru_server._proxy import ProxyTuning, add_proxy_routes
from haru_server._proxy_routes import PROXIED_PATHS
from haru_server._ready import ready_routes
from haru_server._reconciler import ReconcilerOptions
from haru_server._routes import routes
from haru_server._schema_gate import SchemaGate
from haru_server._settings import Settings
from haru_server.openapi import api_table

logger = logging.getLogger(__name__)


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
    app = service_app(
        settings,
        api_token,
        api_table(),
        outer=[proxy_access_middleware(PROXIED_PATHS)],
        inner=[store_error_middleware],
        # The proxied routes check their own credential: a client key (_client_keys).
        unguarded=PROXIED_PATHS,
    )
    metrics = ServerMetrics()
    app[metrics_key] = metrics
    add_metrics_route(app, metrics.exposition, before_scrape=metrics.before_scrape)
    app[settings_key] = settings
    app[api_token_key] = api_token
    app[draining_key] = asyncio.Event()
    owns_store = store is None
    if store is None:
        store = StateStore.open(settings.database_url)
    app[store_key] = store
    app[schema_gate_key] = SchemaGate(store.url)
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
            store.database_now,
            local=local,
            max_skew=timedelta(milliseconds=settings.max_clock_skew_ms),
        )
        app_clock = store_clock
        metrics.watch_clock_skew(lambda: store_clock.skew)
    app[clock_key] = app_clock
    app[store_clock_key] = store_clock
    plane = ControlPlane(
        settings,
        store,
        owns_store=owns_store,
        clock=app_clock,
        store_clock=store_clock,
        metrics=metrics,
        schema_gate=app[schema_gate_key],
        reconciler_options=reconciler_options or ReconcilerOptions(),
        busy_interval_s=busy_interval_s,
        proxy_tuning=proxy_tuning if proxy_tuning is not None else ProxyTuning(),
        links=settings.supervisor_links(),
    )
    app[control_plane_key] = plane
    app.cleanup_ctx.append(plane.run)
    app.add_routes(routes)
    app.add_routes(domain_routes)
    app.add_routes(apply_routes)
    app.add_routes(key_routes)
    app.add_routes(ready_routes)
    add_proxy_routes(app, plane.proxy)
    return app
