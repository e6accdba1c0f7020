"""The inference proxy: OpenAI-compatible requests streamed to the active domain (DESIGN 7.5).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings`` and
``GET /v1/models``. The fleet comes from ``X-Haru-Fleet`` (else ``HARU_DEFAULT_FLEET``); the
body is capped before it is buffered, parsed only to read ``model`` and forwarded
byte-identical to the binding's ``servingUrl`` joined with the same path (never any other
path). The client's headers are not forwarded (its ``Authorization`` above all): the upstream
gets ``content-type``, ``accept``, the request id and, when the upstream has one, its own
serving credential as ``Authorization: Bearer`` (a static binding's ``apiKeyEnv`` /
``apiKeyFile``, read on the server; ``HARU_SERVING_TOKEN`` for a provisioned domain's
gateway). An ``https://`` upstream is verified first (a ``skypilot`` domain's gateway against
its fleet's CA under the domain's name, any other against ``HARU_SERVING_CA_FILE`` or the
system store; a failure is a 502 saying why, never a retry in clear text), and ``http://`` to
another host is refused unless ``HARU_ALLOW_PLAINTEXT`` (``skyserve`` endpoints excepted: they
have no certificate). The answer streams back chunk by chunk with its status; only
``content-type`` is copied (and ``location`` on a 3xx: redirects are never followed, the
client gets them as sent).
The upstream gets ``HARU_CHAT_HEADER_TIMEOUT_MS`` to send its headers; afterwards only
silence is bounded: an upstream that sends nothing for ``HARU_UPSTREAM_IDLE_TIMEOUT_MS``
mid-answer is cut. A client that goes away aborts the upstream request; an upstream that dies
or goes silent mid-answer breaks the client's connection (never a clean end of a truncated
answer).

Routing comes from the route cache's lease (``HARU_ROUTE_LEASE_MS``), kept current by
PostgreSQL NOTIFY where available. During a failover a request that no server answered and of
which nothing went to the client (no routable active domain; the active's server refused or
timed out the connection; or it took the request and closed or reset the connection before
any byte of an answer) is held, when the fleet has ``autoFailover`` on or a promotion in flight
(the flag rides the leased pointer read), until the pointer moves. The bound is
``HARU_FAILOVER_HOLD_MS`` while no promotion is in flight, and the promotion's step budgets up
to the flip (from when this process first saw it) plus that while one is; at most
``HARU_FAILOVER_HOLD_MAX`` requests are held per process, never more than half the connection
cap (past it: 503 ``overloaded``). A request that reached an upstream is sent again at most
once, to the active of a newer revision; one the upstream answered (any HTTP status) or timed
out is never sent again. A request that fails for want of a route (503: no routable active
domain, a store that cannot serve routing, a full hold cap, or a hold that ran out) carries
``Retry-After``.

This module admits a request (client key, fleet) and wires the proxy into an app;
``_proxy_body`` reads the body under its cap and picks the headers sent upstream, ``_upstream``
opens the upstream request, ``_hold`` holds it through a failover, ``_relay`` streams the
answer back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Final
from uuid import UUID

import aiohttp
from aiohttp import web
from haru_db import RouteListener
from haru_protocol import ErrorCode, FleetRoutePointer
from haru_web import ApiError, connection_cap

from haru_server._access_log import note_key, note_route
from haru_server._async_utils import ClientGoneError, DisconnectWatch, FleetKicker, KickDebouncer
from haru_server._client_keys import Grant, KeyGate
from haru_server._fleet_aliases import ref_key
from haru_server._hold import FailoverHold, held_cap
from haru_server._keys import api_token_key, clock_key, settings_key, store_key
from haru_server._metrics import ServerMetrics, metrics_key
from haru_server._pki import FleetPki
from haru_server._proxy_body import expect_continue, read_body, upstream_headers
from haru_server._proxy_errors import routing_headers, unroutable
from haru_server._proxy_routes import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    EMBEDDINGS_PATH,
    MODELS_PATH,
    RouteTable,
    ServingCredentials,
    model_of,
)
from haru_server._relay import Relay
from haru_server._route_cache import (
    DEFAULT_LEASE_IDLE_MS,
    DEFAULT_MAX_FLEETS,
    DEFAULT_OUTAGE_MEMO_MS,
    DEFAULT_POINTER_TIMEOUT_MS,
    DEFAULT_SNAPSHOT_TIMEOUT_MS,
    RouteCache,
)
from haru_server._route_entries import RouteLookup
from haru_server._route_http import resolve_route
from haru_server._stamps import ConnectStamps
from haru_server._upstream import Upstreams

logger = logging.getLogger(__name__)

FLEET_HEADER: Final = "X-Haru-Fleet"

# uvicorn (vLLM's server) closes idle keep-alive connections after 5 s; reusing one it is about
# to close would fail a POST that cannot be retried, so the pool lets go of them first.
_UPSTREAM_KEEPALIVE_S: Final = 4.0
_MAX_CONNECT_S: Final = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyTuning:
    """Knobs of the proxy that are not environment settings (defaults suit production).

    Attributes:
        pointer_timeout_ms: Bound on the per-request route-pointer read.
        snapshot_timeout_ms: Bound on a snapshot load.
        outage_memo_ms: After a failed pointer read, serve stale without asking for this long.
        max_fleets: Route-cache entries kept (LRU beyond).
        kick_interval_ms: At most one passive-failure kick per fleet in this window.
        disconnect_poll_ms: How often an open request checks that its client is still there
            (aiohttp does not cancel handlers on disconnect unless told to).
        connect_timeout_ms: Bound on opening an upstream connection (also capped by
            ``HARU_CHAT_HEADER_TIMEOUT_MS``); a connect that takes longer is unreachable.
        lease_idle_ms: A fleet without requests for this long stops being refreshed.
        hold_poll_ms: A held request re-routes at least this often (a move it was not woken
            for, or an active domain that recovered without a move).
        listen: LISTEN for pointer moves on PostgreSQL (tests cut notifications with False).
        monotonic: Monotonic clock in seconds (injected by tests).
    """

    pointer_timeout_ms: int = DEFAULT_POINTER_TIMEOUT_MS
    snapshot_timeout_ms: int = DEFAULT_SNAPSHOT_TIMEOUT_MS
    outage_memo_ms: int = DEFAULT_OUTAGE_MEMO_MS
    max_fleets: int = DEFAULT_MAX_FLEETS
    kick_interval_ms: int = 1_000
    disconnect_poll_ms: int = 250
    connect_timeout_ms: int = int(_MAX_CONNECT_S * 1000)
    lease_idle_ms: int = DEFAULT_LEASE_IDLE_MS
    hold_poll_ms: int = 100
    listen: bool = True
    monotonic: Callable[[], float] = time.monotonic


class _Proxy:
    """One running app's proxy: route cache, key gate, upstreams, failover hold, relay."""

    def __init__(
        self,
        app: web.Application,
        session: aiohttp.ClientSession,
        tuning: ProxyTuning,
        kicker: FleetKicker | None,
        pki: FleetPki | None,
    ) -> None:
        settings = app[settings_key]
        self._clock = app[clock_key]
        self._default_fleet = settings.default_fleet
        self.max_body = settings.chat_max_body_bytes
        self._poll = tuning.disconnect_poll_ms / 1000
        hold_max = held_cap(settings.failover_hold_max, settings.http_max_connections)
        if hold_max < settings.failover_hold_max:
            logger.warning(
                "HARU_FAILOVER_HOLD_MAX %d lowered to %d: held requests may take at most half "
                "of the listener's %d connections, so health checks and the control API "
                "always find one",
                settings.failover_hold_max,
                hold_max,
                connection_cap(settings.http_max_connections),
            )
        self.listener: RouteListener | None = None
        self.cache: RouteCache[RouteTable] = RouteCache(
            app[store_key],
            build=functools.partial(
                RouteTable,
                credentials=ServingCredentials(settings.serving_token_value(), os.environ),
            ),
            ttl_ms=settings.snapshot_cache_ttl_ms,
            pointer_timeout_ms=tuning.pointer_timeout_ms,
            snapshot_timeout_ms=tuning.snapshot_timeout_ms,
            outage_memo_ms=tuning.outage_memo_ms,
            max_fleets=tuning.max_fleets,
            lease_ms=settings.route_lease_ms,
            idle_ms=tuning.lease_idle_ms,
            monotonic=tuning.monotonic,
        )
        self.gate = KeyGate(
            app[store_key],
            # The app's own source (one per process); an app built without create_app gets one.
            admin_token=app[api_token_key]
            if api_token_key in app
            else settings.api_token_source(monotonic=tuning.monotonic),
            accept_admin=settings.proxy_accept_admin_token,
            lease_ms=settings.route_lease_ms,
            monotonic=tuning.monotonic,
        )
        self.stamps = ConnectStamps(
            app[store_key], self._clock, metrics=app[metrics_key], monotonic=tuning.monotonic
        )
        self.upstream = Upstreams(
            session,
            self.cache,
            pki=pki,
            allow_plaintext=settings.allow_plaintext,
            serving_ssl=settings.serving_ssl(),
            header_timeout_s=settings.chat_header_timeout_ms / 1000,
            kick=KickDebouncer(
                kicker,
                interval_s=tuning.kick_interval_ms / 1000,
                clock=tuning.monotonic,
            ),
            stamps=self.stamps,
        )
        self.hold = FailoverHold(
            self.cache,
            hold_s=settings.failover_hold_ms / 1000,
            hold_max=hold_max,
            poll_s=tuning.hold_poll_ms / 1000,
            monotonic=tuning.monotonic,
        )
        self.relay = Relay()

    # -- request pieces ----------------------------------------------------------------------

    def fleet_ref(self, request: web.BaseRequest) -> str:
        raw = request.headers.get(FLEET_HEADER)
        ref = raw.strip() if raw is not None else ""
        if not ref:
            if self._default_fleet is None:
                raise ApiError(
                    ErrorCode.FLEET_NOT_FOUND,
                    f"no fleet selected: send {FLEET_HEADER} or set HARU_DEFAULT_FLEET",
                )
            ref = self._default_fleet
        if ref_key(ref) is None:
            # Neither an id nor a slug: no fleet can have it, so the store is not asked.
            raise ApiError(ErrorCode.FLEET_NOT_FOUND, f"fleet {ref[:100]!r} not found")
        return ref

    async def route(self, ref: str) -> RouteLookup[RouteTable]:
        lookup = await resolve_route(self.cache, ref)
        if not lookup.routes.routable:
            raise unroutable(lookup)
        return lookup

    # -- handlers ----------------------------------------------------------------------------

    async def admit(self, request: web.Request) -> tuple[Grant, str]:
        """The request's client key (401/403/429 when refused) and its checked fleet.

        The credential comes first: nothing is said about fleets to a caller without a key.
        """
        grant = await self.gate.admit(request)
        note_key(request, grant.label)
        self.gate.spend(grant)
        ref = self.fleet_ref(request)
        if grant.key is not None and grant.key.fleets is not None:
            lookup = await resolve_route(self.cache, ref)
            grant.check_fleet(lookup.fleet_id, lookup.snapshot.slug)
        return grant, ref

    async def forward(self, request: web.Request, path: str) -> web.StreamResponse:
        grant, ref = await self.admit(request)
        try:
            body = await read_body(request, self.max_body)
        except ConnectionResetError:
            return web.Response(status=499)  # gone while sending its body; logged as 499
        model = model_of(body)
        grant.check_model(model)
        headers = upstream_headers(request)
        try:
            async with DisconnectWatch(request, self._poll):
                attempt = functools.partial(
                    self.upstream.attempt, request, ref, model, path, body, headers
                )
                lookup, upstream, held_ms = await self.hold.dispatch(request, ref, model, attempt)
                try:
                    return await self.relay.stream(request, upstream, lookup, held_ms)
                finally:
                    # A fully read answer returns the connection to the pool; anything else
                    # (client gone, upstream broken, cancelled) closes it, which aborts the
                    # upstream request.
                    if upstream.content.is_eof() and upstream.content.exception() is None:
                        upstream.release()
                    else:
                        upstream.close()
        except ClientGoneError:
            # Nobody will read this; the app's error middleware logs it as 499.
            return web.Response(status=499)

    async def models(self, request: web.Request) -> web.StreamResponse:
        grant, ref = await self.admit(request)
        lookup = await self.route(ref)
        note_route(request, lookup.routes.snapshot, model=None, stale=lookup.stale)
        created = int(self._clock().timestamp())
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "haru"}
            for name in lookup.routes.models
            if grant.allows_model(name)
        ]
        return web.json_response({"object": "list", "data": data}, headers=routing_headers(lookup))


# -- wiring ------------------------------------------------------------------------------------


class InferenceProxy:
    """The inference proxy of one app: its routes' resources from startup to cleanup.

    Built before the app starts; :meth:`lifecycle` opens the pooled session, the route cache
    and the route listener, and closes them again. The control plane tells it what this
    process did to a fleet's route (:meth:`note_route_move`, :meth:`note_promotion`); other
    processes learn the same from their next pointer read (at most one lease later).
    """

    __slots__ = ("_kicker", "_running", "tuning")

    def __init__(self, tuning: ProxyTuning, *, kicker: FleetKicker | None) -> None:
        self.tuning = tuning
        self._kicker = kicker
        self._running: _Proxy | None = None

    @property
    def running(self) -> _Proxy | None:
        """The proxy between startup and cleanup; None outside them."""
        return self._running

    def note_route_move(self, pointer: FleetRoutePointer) -> None:
        """A flip made by this process: its own proxy routes with it at once."""
        if self._running is not None:
            self._running.cache.observe(pointer)

    def note_promotion(self, fleet_id: UUID) -> None:
        """A promotion accepted by this process: its own proxy holds for it at once."""
        if self._running is not None:
            self._running.cache.note_promotion(fleet_id)

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """The proxy alone as a ``cleanup_ctx`` (no fleet CA: see :meth:`open`)."""
        async with self.open(app, pki=None):
            yield

    @contextlib.asynccontextmanager
    async def open(self, app: web.Application, *, pki: FleetPki | None) -> AsyncIterator[None]:
        """Open the proxy's resources until the block ends.

        ``pki``: verifies a ``skypilot`` domain's gateway against its fleet's CA (None: such a
        gateway cannot be verified, so it is not routed to).
        """
        settings = app[settings_key]
        connect_s = min(settings.chat_header_timeout_ms, self.tuning.connect_timeout_ms) / 1000
        connector = aiohttp.TCPConnector(
            limit=0,  # each upstream queues its own requests; a pool cap would only add latency
            keepalive_timeout=_UPSTREAM_KEEPALIVE_S,
        )
        session = aiohttp.ClientSession(
            connector=connector,
            # No total bound: the header bound is applied per request, and a stream may run for
            # as long as the model needs; only silence is bounded (a generous sock_read, which
            # a stalled upstream turns into ServerTimeoutError mid-answer).
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=connect_s,
                sock_read=settings.upstream_idle_timeout_ms / 1000,
            ),
            cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to another
            trust_env=False,
        )
        async with session:
            proxy = _Proxy(app, session, self.tuning, self._kicker, pki)
            self._running = proxy
            store = app[store_key]
            listening: asyncio.Task[None] | None = None
            if self.tuning.listen and settings.route_lease_ms > 0:
                proxy.listener = RouteListener(store.url, proxy.cache.observe)
                if proxy.listener.supported:
                    listening = asyncio.create_task(proxy.listener.run(), name="route-listener")
            try:
                yield
            finally:
                self._running = None
                tasks = [*proxy.hold.releasers, *([listening] if listening else [])]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await proxy.stamps.aclose()
                await proxy.cache.aclose()


proxy_key: Final = web.AppKey("haru_proxy", InferenceProxy)


def _proxy_of(request: web.Request) -> _Proxy:
    proxy = request.app[proxy_key].running
    if proxy is None:
        raise ApiError(ErrorCode.SHUTTING_DOWN, "the inference proxy is not running")
    return proxy


async def _expect_continue(request: web.Request) -> None:
    proxy = request.app[proxy_key].running
    await expect_continue(request, None if proxy is None else proxy.max_body)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _proxy_of(request).forward(request, CHAT_PATH)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _proxy_of(request).forward(request, COMPLETIONS_PATH)


async def _embeddings(request: web.Request) -> web.StreamResponse:
    return await _proxy_of(request).forward(request, EMBEDDINGS_PATH)


async def _models(request: web.Request) -> web.StreamResponse:
    return await _proxy_of(request).models(request)


def add_proxy_routes(app: web.Application, proxy: InferenceProxy) -> None:
    """Register the inference routes on ``app``, served by ``proxy``.

    ``app[settings_key]``, ``app[store_key]``, ``app[clock_key]`` and ``app[metrics_key]``
    must be set, and
    ``proxy.lifecycle`` must run for the app's life (the control plane runs it). The bearer
    check and the rendering of :class:`haru_web.ApiError` are the app's middlewares' job.
    """
    app[proxy_key] = proxy
    metrics = app[metrics_key]
    metrics.watch_holding(lambda: 0 if proxy.running is None else proxy.running.hold.holding)
    metrics.watch_lease_ages(
        lambda: {} if proxy.running is None else proxy.running.cache.lease_ages()
    )
    app.router.add_post(CHAT_PATH, _chat_completions, expect_handler=_expect_continue)
    app.router.add_post(COMPLETIONS_PATH, _completions, expect_handler=_expect_continue)
    app.router.add_post(EMBEDDINGS_PATH, _embeddings, expect_handler=_expect_continue)
    app.router.add_get(MODELS_PATH, _models, allow_head=False)


def install_proxy(
    app: web.Application, *, tuning: ProxyTuning | None = None, kicker: FleetKicker | None = None
) -> InferenceProxy:
    """The proxy alone on ``app``: its routes and its lifecycle, without a control plane.

    ``app[metrics_key]`` is set to a fresh :class:`ServerMetrics` when the app has none.

    Args:
        app: The application, not yet started, with ``app[settings_key]``, ``app[store_key]``
            and ``app[clock_key]`` set.
        tuning: Non-environment knobs; the defaults suit production.
        kicker: Asked to reconcile a fleet on a passive failure; None sends no kick.
    """
    proxy = InferenceProxy(tuning if tuning is not None else ProxyTuning(), kicker=kicker)
    if metrics_key not in app:
        app[metrics_key] = ServerMetrics()
    add_proxy_routes(app, proxy)
    app.cleanup_ctx.append(proxy.lifecycle)
    return proxy
