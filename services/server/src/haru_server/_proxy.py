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
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Protocol
from uuid import UUID

import aiohttp
from aiohttp import hdrs, web
from haru_db import RouteListener
from haru_protocol import REQUEST_ID_HEADER, ErrorCode, FleetRoutePointer, Policy, Provider
from haru_supervisor_client import connect_failure, is_loopback_url
from haru_web import ApiError, connection_cap, current_request_id
from yarl import URL

from haru_server._client_keys import Grant, KeyGate
from haru_server._fleet_aliases import ref_key
from haru_server._keys import api_token_key, clock_key, settings_key, store_key
from haru_server._metrics import (
    ServerMetrics,
    metrics_key,
    note_first_chunk,
    note_key,
    note_route,
    note_upstream,
)
from haru_server._pki import FleetPki
from haru_server._proxy_routes import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    EMBEDDINGS_PATH,
    MODELS_PATH,
    RouteTable,
    ServingCredentials,
    model_of,
    promotion_budget_ms,
)
from haru_server._route_cache import (
    DEFAULT_LEASE_IDLE_MS,
    DEFAULT_MAX_FLEETS,
    DEFAULT_OUTAGE_MEMO_MS,
    DEFAULT_POINTER_TIMEOUT_MS,
    DEFAULT_SNAPSHOT_TIMEOUT_MS,
    RETRY_AFTER_S,
    RouteCache,
)
from haru_server._route_entries import RouteLookup
from haru_server._route_http import resolve_route
from haru_server._stamps import ConnectStamps

logger = logging.getLogger(__name__)

FLEET_HEADER: Final = "X-Haru-Fleet"
ROUTING_HEADER: Final = "X-Haru-Routing"
HELD_HEADER: Final = "X-Haru-Held-Ms"
_STALE: Final = "stale"

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


class _ClientGoneError(Exception):
    """The client closed its connection while its request was being served."""


@dataclass(slots=True, eq=False)
class _HeldItem:
    released: asyncio.Future[bool]
    revision: int
    unroutable: bool
    model: str
    fleet_id: UUID
    started: float
    """Clock reading at which the request was first held."""
    policy: Policy
    """The fleet's policy as last read (its promotion budgets bound the hold)."""
    deadline: float = 0.0
    timer: asyncio.TimerHandle | None = None


def _settle_held(future: asyncio.Future[bool], released: bool) -> None:
    if not future.done():
        future.set_result(released)


class _UnansweredError(Exception):
    """No server answered the request and nothing was sent to the client: it may be held.

    ``reached``: the request reached an upstream that went away before any byte of an answer
    (reset before the headers, gone mid-body): it may be sent once more, to another active.
    Otherwise nothing of it reached a server (no route, refused, connect timeout).
    """

    def __init__(
        self, error: ApiError, lookup: RouteLookup[RouteTable], *, reached: bool = False
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.lookup = lookup
        self.reached = reached


class _DisconnectWatch:
    """Cancels the serving task when the client's connection closes.

    aiohttp leaves a handler running after its client disconnected (unless the server runs
    with ``handler_cancellation``), so without this a request waiting for upstream headers
    would keep the upstream generating for nobody. The check is a timer callback, free when
    nothing happens; a cancel it caused surfaces as :class:`_ClientGoneError`.
    """

    __slots__ = ("_handle", "_interval", "_loop", "_request", "_task", "fired")

    def __init__(self, request: web.BaseRequest, interval_s: float) -> None:
        self._request = request
        self._interval = interval_s
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - handlers always run in a task
            raise RuntimeError("a disconnect watch needs a running task")
        self._task = task
        self._handle: asyncio.TimerHandle | None = None
        self.fired = False

    def _check(self) -> None:
        transport = self._request.transport
        if transport is None or transport.is_closing():
            self.fired = True
            self._handle = None
            self._task.cancel()
        else:
            self._handle = self._loop.call_later(self._interval, self._check)

    async def __aenter__(self) -> _DisconnectWatch:
        self._handle = self._loop.call_later(self._interval, self._check)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        # Our own cancel is swallowed, unless someone else cancelled the task as well.
        if (
            self.fired
            and exc_type is not None
            and issubclass(exc_type, asyncio.CancelledError)
            and self._task.uncancel() == 0
        ):
            raise _ClientGoneError from exc


class FleetKicker(Protocol):
    """Whom the proxy asks for a reconcile of a fleet now (the control plane, in the server)."""

    def kick(self, fleet_id: UUID) -> None:
        """Reconcile ``fleet_id`` soon (debounced by the receiver; never blocks)."""


class _KickDebouncer:
    """Asks for an out-of-band reconcile at most once per interval per fleet."""

    __slots__ = ("_clock", "_interval", "_kicker", "_last")

    def __init__(
        self, kicker: FleetKicker | None, *, interval_s: float, clock: Callable[[], float]
    ) -> None:
        self._kicker = kicker
        self._interval = interval_s
        self._clock = clock
        self._last: dict[UUID, float] = {}

    def __call__(self, fleet_id: UUID) -> bool:
        """Kick ``fleet_id`` unless it was kicked within the interval; True when it kicked."""
        if self._kicker is None:
            return False
        now = self._clock()
        last = self._last.get(fleet_id)
        if last is not None and now - last < self._interval:
            return False
        self._last[fleet_id] = now
        if len(self._last) > 1024:
            self._last = {k: t for k, t in self._last.items() if now - t < self._interval}
        self._kicker.kick(fleet_id)
        return True


class _Proxy:
    """Everything one running app needs to proxy: settings, the pooled session, the cache."""

    def __init__(
        self,
        app: web.Application,
        session: aiohttp.ClientSession,
        tuning: ProxyTuning,
        kicker: FleetKicker | None,
        pki: FleetPki | None,
    ) -> None:
        settings = app[settings_key]
        self._pki = pki
        self._session = session
        self._allow_plaintext = settings.allow_plaintext
        self._serving_ssl = settings.serving_ssl()
        self._clock = app[clock_key]
        self._default_fleet = settings.default_fleet
        self.max_body = settings.chat_max_body_bytes
        self._header_timeout = settings.chat_header_timeout_ms / 1000
        self._poll = tuning.disconnect_poll_ms / 1000
        self._mono = tuning.monotonic
        self._hold = settings.failover_hold_ms / 1000
        self.hold_max = held_cap(settings.failover_hold_max, settings.http_max_connections)
        """Requests held at once: ``HARU_FAILOVER_HOLD_MAX``, at most half the connection cap."""
        if self.hold_max < settings.failover_hold_max:
            logger.warning(
                "HARU_FAILOVER_HOLD_MAX %d lowered to %d: held requests may take at most half "
                "of the listener's %d connections, so health checks and the control API "
                "always find one",
                settings.failover_hold_max,
                self.hold_max,
                connection_cap(settings.http_max_connections),
            )
        self._hold_poll = tuning.hold_poll_ms / 1000
        self.holding = 0
        """Requests held right now."""
        self.retried_total = 0
        """Requests sent to a second upstream after the first went away without answering."""
        self.over_cap = 0
        """Requests failed at once because ``hold_max`` requests were held already."""
        self.idle_cuts = 0
        """Answers cut because their upstream went silent mid-answer."""
        self.listener: RouteListener | None = None
        self._held: dict[UUID, list[_HeldItem]] = {}
        self._releasers: dict[UUID, asyncio.Task[None]] = {}
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
        self._kick = _KickDebouncer(
            kicker,
            interval_s=tuning.kick_interval_ms / 1000,
            clock=tuning.monotonic,
        )

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

    async def read_body(self, request: web.BaseRequest) -> bytes:
        limit = self.max_body
        length = request.content_length
        if length is not None:
            if length > limit:
                raise self._too_large()
            try:
                return await request.content.readexactly(length)
            except asyncio.IncompleteReadError:
                raise ApiError(
                    ErrorCode.INVALID_REQUEST, "the request body ended before its Content-Length"
                ) from None
        # No declared length (chunked upload): read as it comes and stop one byte past the cap.
        chunks: list[bytes] = []
        size = 0
        content = request.content
        while chunk := await content.readany():
            size += len(chunk)
            if size > limit:
                raise self._too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self) -> ApiError:
        return ApiError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"the request body exceeds HARU_CHAT_MAX_BODY_BYTES ({self.max_body} bytes)",
        )

    async def route(self, ref: str) -> RouteLookup[RouteTable]:
        lookup = await resolve_route(self.cache, ref)
        if not lookup.routes.routable:
            raise _unroutable(lookup)
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
            body = await self.read_body(request)
        except ConnectionResetError:
            return web.Response(status=499)  # gone while sending its body; logged as 499
        model = model_of(body)
        grant.check_model(model)
        headers: dict[str, str] = {
            hdrs.CONTENT_TYPE: request.headers.get(hdrs.CONTENT_TYPE, "application/json"),
            # The answer is relayed byte for byte with only content-type copied back, so it
            # must not arrive compressed.
            hdrs.ACCEPT_ENCODING: "identity",
        }
        accept = request.headers.get(hdrs.ACCEPT)
        if accept is not None:
            headers[hdrs.ACCEPT] = accept
        request_id = current_request_id()
        if request_id is not None:
            headers[REQUEST_ID_HEADER] = request_id
        try:
            async with _DisconnectWatch(request, self._poll):
                lookup, upstream, held_ms = await self._dispatch(
                    request, ref, model, path, body, headers
                )
                try:
                    return await self._relay(request, upstream, lookup, held_ms)
                finally:
                    # A fully read answer returns the connection to the pool; anything else
                    # (client gone, upstream broken, cancelled) closes it, which aborts the
                    # upstream request.
                    if upstream.content.is_eof() and upstream.content.exception() is None:
                        upstream.release()
                    else:
                        upstream.close()
        except _ClientGoneError:
            # Nobody will read this; the app's error middleware logs it as 499.
            return web.Response(status=499)

    async def _attempt(
        self,
        request: web.Request,
        ref: str,
        model: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
    ) -> tuple[RouteLookup[RouteTable], aiohttp.ClientResponse]:
        lookup = await resolve_route(self.cache, ref)
        routes = lookup.routes
        url = routes.target(model, path) if routes.routable else None
        # A model of the fleet's layout keeps its label even when it cannot be served now.
        known = url is not None or model in routes.known
        note_route(request, routes.snapshot, model=model if known else None, stale=lookup.stale)
        if not routes.routable:
            raise _UnansweredError(_unroutable(lookup), lookup)
        if url is None and routes.unserved(model):
            raise _UnansweredError(_unserved(lookup, model), lookup)
        if url is None:
            available = ", ".join(routes.models) or "none"
            raise ApiError(
                ErrorCode.MODEL_NOT_FOUND,
                f"model {model[:200]!r} is not available on fleet {routes.fleet_slug!r}; "
                f"available models: {available}",
                headers=_routing_headers(lookup),
            )
        auth = routes.authorization(model)
        if auth is not None:
            # The upstream's own credential; the client's Authorization is never forwarded.
            headers = {**headers, hdrs.AUTHORIZATION: auth}
        tls = await self._tls_for(url, lookup)
        sent = time.monotonic()
        upstream = await self._open(url, body, headers, lookup, tls)
        note_upstream(request, routes.origin(model) or _origin(url), time.monotonic() - sent)
        return lookup, upstream

    async def _dispatch(
        self,
        request: web.Request,
        ref: str,
        model: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
    ) -> tuple[RouteLookup[RouteTable], aiohttp.ClientResponse, int | None]:
        """Open the upstream answer, holding the request through a failover when allowed.

        A request reaches at most two upstreams: one that went away without answering
        (:attr:`_UnansweredError.reached`) is sent again only after the route moved, once.
        """
        try:
            lookup, upstream = await self._attempt(request, ref, model, path, body, headers)
        except _UnansweredError as exc:
            if not self._may_hold(exc.lookup):
                raise exc.error from None
            if self.holding >= self.hold_max:
                raise self._over_cap(exc) from None
            failed = exc
        else:
            return lookup, upstream, None
        # Held: no server answered and nothing was sent to the client, so it may go to the
        # next active.
        reached = failed.reached
        self.holding += 1
        started = self._mono()
        try:
            while True:
                if not await self._held_until_release(ref, model, failed, started):
                    raise _with_held(failed.error, started, self._mono()) from None
                try:
                    lookup, upstream = await self._attempt(request, ref, model, path, body, headers)
                except _UnansweredError as exc:
                    if exc.reached and reached:
                        # Twice sent, twice unanswered: never a third time.
                        raise _with_held(exc.error, started, self._mono()) from None
                    reached = reached or exc.reached
                    failed = exc
                    continue
                held_ms = int((self._mono() - started) * 1000)
                if reached:
                    self.retried_total += 1
                request.app[metrics_key].request_held(lookup.routes.fleet_slug)
                return lookup, upstream, held_ms
        finally:
            self.holding -= 1

    def _over_cap(self, failed: _UnansweredError) -> ApiError:
        self.over_cap += 1
        if self.over_cap == 1 or self.over_cap % 1000 == 0:  # one line per burst, not per request
            logger.warning(
                "fleet %s: %d requests already held (HARU_FAILOVER_HOLD_MAX); failing more at "
                "once with 503 (%d so far)",
                failed.lookup.routes.fleet_slug,
                self.holding,
                self.over_cap,
            )
        return ApiError(
            ErrorCode.OVERLOADED,
            f"{self.holding} requests are already held for a failover in this process "
            "(HARU_FAILOVER_HOLD_MAX); retry shortly",
            headers=_retry_headers(failed.lookup),
        )

    def hold_deadline(self, fleet_id: UUID, started: float, policy: Policy) -> float:
        """When a request of ``fleet_id`` held since ``started`` gives up (monotonic seconds).

        ``HARU_FAILOVER_HOLD_MS`` after it was held; while a promotion is in flight, no sooner
        than that promotion's step budgets up to the flip (counted from when this process
        first saw it in flight) plus ``HARU_FAILOVER_HOLD_MS`` for the flip to reach it.
        """
        deadline = started + self._hold
        since = self.cache.promotion_since(fleet_id)
        if since is not None:
            deadline = max(deadline, since + promotion_budget_ms(policy) / 1000 + self._hold)
        return deadline

    def _arm(self, item: _HeldItem) -> None:
        """(Re)arm the timer that gives ``item`` up at its deadline, which may have moved."""
        if item.released.done():
            return
        deadline = self.hold_deadline(item.fleet_id, item.started, item.policy)
        if item.timer is not None and deadline == item.deadline:
            return
        now = self._mono()
        if now >= deadline:
            _settle_held(item.released, False)
            return
        if item.timer is not None:
            item.timer.cancel()
        item.deadline = deadline
        item.timer = asyncio.get_running_loop().call_later(deadline - now, self._expire, item)

    def _expire(self, item: _HeldItem) -> None:
        item.timer = None
        self._arm(item)

    async def _held_until_release(
        self, ref: str, model: str, failed: _UnansweredError, started: float
    ) -> bool:
        """Queue behind the fleet's earlier held requests until the releaser lets this one go.

        One releaser task per fleet watches for the move and releases waiters in arrival
        order (their futures resolve in order, so they dispatch in order). False: the bound
        (:meth:`hold_deadline`) ran out first.
        """
        loop = asyncio.get_running_loop()
        fleet_id = failed.lookup.fleet_id
        routes = failed.lookup.routes
        item = _HeldItem(
            loop.create_future(),
            failed.lookup.snapshot.route_revision,
            # An upstream that went away (refused, or took the request and vanished) is only
            # left behind by a move; a missing route or slot may also come back in place.
            unroutable=not routes.routable or routes.unserved(model),
            model=model,
            fleet_id=fleet_id,
            started=started,
            policy=failed.lookup.snapshot.policy,
        )
        queue = self._held.setdefault(fleet_id, [])
        queue.append(item)
        if fleet_id not in self._releasers:
            self._releasers[fleet_id] = loop.create_task(self._release(ref, fleet_id))
        self._arm(item)
        try:
            return await item.released
        finally:
            if item.timer is not None:
                item.timer.cancel()
            if item in queue:
                queue.remove(item)

    async def _release(self, ref: str, fleet_id: UUID) -> None:
        """Release held requests of one fleet, in arrival order, once they can be served."""
        try:
            while queue := self._held.get(fleet_id):
                revision = min(item.revision for item in queue)
                await self.cache.wait_moved(fleet_id, revision, self._hold_poll)
                try:
                    lookup = await resolve_route(self.cache, ref)
                except ApiError:
                    continue
                now_revision = lookup.snapshot.route_revision
                # Held only for a promotion (no autoFailover) that ended without moving the
                # pointer: nothing will move it now, so the held requests fail at once.
                hopeless = not self._holds_for(lookup)
                for item in list(queue):
                    routes = lookup.routes
                    servable = routes.routable and not routes.unserved(item.model)
                    if now_revision > item.revision or (item.unroutable and servable):
                        queue.remove(item)
                        _settle_held(item.released, True)
                    elif hopeless:
                        queue.remove(item)
                        _settle_held(item.released, False)
                    else:
                        # A promotion that started, or ended, moves the bound.
                        item.policy = lookup.snapshot.policy
                        self._arm(item)
        finally:
            self._releasers.pop(fleet_id, None)
            if not self._held.get(fleet_id):
                self._held.pop(fleet_id, None)

    @property
    def releasers(self) -> list[asyncio.Task[None]]:
        return list(self._releasers.values())

    def _holds_for(self, lookup: RouteLookup[RouteTable]) -> bool:
        """Whether a failover may be coming: ``autoFailover`` on, or a promotion in flight."""
        return lookup.snapshot.policy.auto_failover or self.cache.promotion_in_flight(
            lookup.fleet_id
        )

    def _may_hold(self, lookup: RouteLookup[RouteTable]) -> bool:
        return self._hold > 0 and self.hold_max > 0 and self._holds_for(lookup)

    async def _tls_for(
        self, url: URL, lookup: RouteLookup[RouteTable]
    ) -> tuple[ssl.SSLContext | bool, str | None]:
        """The ``ssl`` and ``server_hostname`` of a request to the active domain at ``url``.

        ``http://`` beyond loopback is refused unless ``HARU_ALLOW_PLAINTEXT`` (a ``skyserve``
        endpoint has no certificate to serve: warned about at boot instead). A ``skypilot``
        domain's gateway is trusted by its fleet's CA under the domain's name only; any other
        ``https://`` endpoint by ``HARU_SERVING_CA_FILE`` (else the system store).
        """
        active = lookup.snapshot.active_domain
        slug = lookup.routes.fleet_slug
        if url.scheme == "http":
            if (
                self._allow_plaintext
                or is_loopback_url(str(url))
                or (active is not None and active.provider is Provider.SKYSERVE)
            ):
                return True, None
            raise ApiError(
                ErrorCode.UPSTREAM_UNREACHABLE,
                f"the model server of fleet {slug!r} is plain HTTP on another host: refused "
                "(prompts, completions and its credential would cross the network in clear "
                "text); serve it over https:// or allow plain HTTP on a private network (the "
                "server's HARU_ALLOW_PLAINTEXT=1)",
                headers=_routing_headers(lookup),
            )
        pki = self._pki
        if active is not None and active.provider is Provider.SKYPILOT and pki is not None:
            trust = await pki.domain_trust(lookup.fleet_id, slug, active.slug)
            if trust is None:
                raise ApiError(
                    ErrorCode.UPSTREAM_UNREACHABLE,
                    f"fleet {slug!r} has no CA in the store to verify its domain "
                    f"{active.slug!r} with",
                    headers=_routing_headers(lookup),
                )
            return trust.ssl, trust.server_name
        return (self._serving_ssl if self._serving_ssl is not None else True), None

    async def _open(
        self,
        url: URL,
        body: bytes,
        headers: dict[str, str],
        lookup: RouteLookup[RouteTable],
        tls: tuple[ssl.SSLContext | bool, str | None],
    ) -> aiohttp.ClientResponse:
        routing = _routing_headers(lookup)
        context, server_name = tls
        try:
            async with asyncio.timeout(self._header_timeout):
                # Never follow a redirect: following re-sends the client's body and headers
                # to wherever the upstream points (another host, an admin route).
                return await self._session.post(
                    url,
                    data=body,
                    headers=headers,
                    allow_redirects=False,
                    ssl=context,
                    server_hostname=server_name,
                )
        except aiohttp.ClientSSLError as exc:
            # A failed verification (foreign CA, wrong name, expired) or handshake: refused,
            # never retried elsewhere nor in clear text. Nothing was sent.
            reason = _tls_reason(exc)
            logger.warning(
                "fleet %s: upstream %s refused: %s", lookup.routes.fleet_slug, _origin(url), reason
            )
            raise ApiError(
                ErrorCode.UPSTREAM_UNREACHABLE,
                f"the model server of fleet {lookup.routes.fleet_slug!r} failed TLS "
                f"verification: {reason}",
                headers=routing,
            ) from None
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            # Connect failures (refused, unroutable, connect timeout) mean the active domain's
            # server is not there: ask the reconciler to look now instead of at its next tick.
            self._kick_for(lookup, url, "unreachable", exc)
            active = lookup.snapshot.active_domain_id
            if active is not None and connect_failure(exc) is not None:
                # Refused or no route (never a timeout): every replica's tick sees it.
                self.stamps(lookup.routes.fleet_slug, active)
            # Refused, unroutable or a connect timeout: the body was never sent.
            error = ApiError(
                ErrorCode.UPSTREAM_UNREACHABLE,
                f"the model server of fleet {lookup.routes.fleet_slug!r} is unreachable",
                headers=routing,
            )
            raise _UnansweredError(error, lookup) from None
        except TimeoutError:
            raise ApiError(
                ErrorCode.UPSTREAM_TIMEOUT,
                "the model server sent no response headers within "
                f"{int(self._header_timeout * 1000)} ms",
                headers=routing,
            ) from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # The connection closed or was reset before any byte of an answer (a server that
            # died with the request, or while its body was being sent): nothing came back, so
            # it may be sent to the next active, once.
            self._kick_for(lookup, url, "went away before answering", exc)
            error = ApiError(
                ErrorCode.UPSTREAM_UNREACHABLE,
                f"the model server of fleet {lookup.routes.fleet_slug!r} went away before "
                f"answering ({type(exc).__name__})",
                headers=routing,
            )
            raise _UnansweredError(error, lookup, reached=True) from None
        except aiohttp.ClientError as exc:
            # An answer that is not HTTP: the server did answer, so it is never sent again.
            logger.warning(
                "fleet %s: upstream %s failed before answering: %s",
                lookup.routes.fleet_slug,
                _origin(url),
                exc,
            )
            raise ApiError(
                ErrorCode.UPSTREAM_UNREACHABLE,
                f"the model server of fleet {lookup.routes.fleet_slug!r} failed before "
                f"answering ({type(exc).__name__})",
                headers=routing,
            ) from None

    def _kick_for(
        self, lookup: RouteLookup[RouteTable], url: URL, what: str, exc: BaseException
    ) -> None:
        if self._kick(lookup.fleet_id):
            logger.warning(
                "fleet %s: upstream %s %s (%s); requested a reconcile",
                lookup.routes.fleet_slug,
                _origin(url),
                what,
                exc,
            )

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        lookup: RouteLookup[RouteTable],
        held_ms: int | None,
    ) -> web.StreamResponse:
        headers: dict[str, str] = {}
        content_type = upstream.headers.get(hdrs.CONTENT_TYPE)
        if content_type is not None:
            headers[hdrs.CONTENT_TYPE] = content_type
        location = upstream.headers.get(hdrs.LOCATION)
        if location is not None and 300 <= upstream.status < 400:
            headers[hdrs.LOCATION] = location  # the redirect is the client's to follow, or not
        if lookup.stale:
            headers[ROUTING_HEADER] = _STALE
        if held_ms is not None:
            headers[HELD_HEADER] = str(held_ms)
        content = upstream.content
        # Time to first token: the first chunk of a successful event stream (a streamed
        # completion); other answers have no first token to time.
        timing = 200 <= upstream.status < 300 and (content_type or "").startswith(
            "text/event-stream"
        )
        if content.is_eof() and content.exception() is None:
            # The whole answer arrived together with its headers (a small JSON answer): it is
            # already in memory, so send it in one write instead of headers, body, terminator.
            if timing:
                note_first_chunk(request)
            return web.Response(status=upstream.status, body=content.read_nowait(), headers=headers)
        response = web.StreamResponse(status=upstream.status, headers=headers)
        length = upstream.content_length
        if length is not None and hdrs.CONTENT_ENCODING not in upstream.headers:
            # Framing, not a copied header: a known length spares chunked encoding, and a
            # short body still reads as truncated to the client.
            response.content_length = length
        try:
            await response.prepare(request)
            while True:
                try:
                    chunk = await content.readany()
                except aiohttp.ClientError as exc:
                    self._broken(request, upstream, lookup, exc)
                    return response
                if not chunk:
                    break
                await response.write(chunk)
                if timing:
                    timing = False
                    note_first_chunk(request)
            await response.write_eof()
        except ConnectionError:
            # The client went away mid-answer: stop reading (the caller closes the upstream).
            logger.info("499 %s %s: client disconnected mid-answer", request.method, request.path)
        return response

    def _broken(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        lookup: RouteLookup[RouteTable],
        exc: BaseException,
    ) -> None:
        if isinstance(exc, aiohttp.ServerTimeoutError):
            self.idle_cuts += 1
            logger.warning(
                "fleet %s: upstream %s sent nothing for HARU_UPSTREAM_IDLE_TIMEOUT_MS "
                "mid-answer; cut (%d so far), breaking the client connection",
                lookup.routes.fleet_slug,
                _origin(upstream.url),
                self.idle_cuts,
            )
        else:
            logger.warning(
                "fleet %s: upstream %s broke mid-answer (%s); breaking the client connection",
                lookup.routes.fleet_slug,
                _origin(upstream.url),
                exc,
            )
        # Close without the final chunk (or with fewer bytes than Content-Length): the client
        # must see a broken answer, never a clean end of a truncated one.
        transport = request.transport
        if transport is not None:
            transport.close()

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
        return web.json_response({"object": "list", "data": data}, headers=_routing_headers(lookup))


def _unroutable(lookup: RouteLookup[RouteTable]) -> ApiError:
    active = lookup.snapshot.active_domain
    reason = (
        "has no active domain"
        if active is None
        else f"has its active domain {active.slug!r} in state {active.state.value!r}"
    )
    return ApiError(
        ErrorCode.NO_ACTIVE_DOMAIN,
        f"fleet {lookup.routes.fleet_slug!r} {reason}; nothing can serve right now",
        headers=_retry_headers(lookup),
    )


def _unserved(lookup: RouteLookup[RouteTable], model: str) -> ApiError:
    active = lookup.snapshot.active_domain
    where = "" if active is None else f" of active domain {active.slug!r}"
    return ApiError(
        ErrorCode.NO_ACTIVE_DOMAIN,
        f"model {model[:200]!r} of fleet {lookup.routes.fleet_slug!r} is bound but its "
        f"slot{where} is not serving; nothing can serve it right now",
        headers=_retry_headers(lookup),
    )


def held_cap(configured: int, max_connections: int) -> int:
    """Requests one process holds at once: ``configured``, at most half the connection cap.

    A held request keeps its client's connection open; past the listener's cap new
    connections are refused, health checks and the control API included. Half the cap (as
    lowered to fit the open-file limit) always stays for them and for requests being served.
    """
    return min(configured, connection_cap(max_connections) // 2)


def _with_held(error: ApiError, started: float, now: float) -> ApiError:
    """``error`` as answered after a hold that ran out, with the hold's length.

    It says when to try again too: the failover it waited for may still come.
    """
    headers = {
        **error.headers,
        HELD_HEADER: str(int((now - started) * 1000)),
        hdrs.RETRY_AFTER: str(RETRY_AFTER_S),
    }
    return ApiError(error.code, error.message, status=error.status, headers=headers)


def _routing_headers(lookup: RouteLookup[RouteTable]) -> dict[str, str] | None:
    return {ROUTING_HEADER: _STALE} if lookup.stale else None


def _retry_headers(lookup: RouteLookup[RouteTable]) -> dict[str, str]:
    return {**(_routing_headers(lookup) or {}), hdrs.RETRY_AFTER: str(RETRY_AFTER_S)}


def _tls_reason(exc: aiohttp.ClientSSLError) -> str:
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        cert_error = exc.certificate_error
        reason = getattr(cert_error, "verify_message", None) or str(cert_error)
        return f"certificate verification failed: {reason}"
    return f"TLS handshake failed: {exc.os_error}"


def _origin(url: URL) -> str:
    # Logged instead of the full URL: a servingUrl's query string may carry a credential.
    return str(url.origin())


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
                tasks = [*proxy.releasers, *([listening] if listening else [])]
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
    # aiohttp's default answers "100 Continue" to any Expect before anything else runs, which
    # invites a client to send a body the cap will refuse. Over the cap, stay silent: the
    # handler (after the bearer check) answers 413 without reading the body.
    proxy = request.app[proxy_key].running
    length = request.content_length
    if proxy is not None and length is not None and length > proxy.max_body:
        return
    if request.version != aiohttp.HttpVersion11:
        return
    expect = request.headers.get(hdrs.EXPECT, "")
    if expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"unknown expectation {expect[:100]!r}")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the 100 is not part of the response


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
    metrics.watch_holding(lambda: 0 if proxy.running is None else proxy.running.holding)
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
