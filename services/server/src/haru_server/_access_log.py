"""The proxy's per-request notes, and the middleware that counts and access-logs each answer.

The proxy fills in a request's :class:`ProxyNote` as it learns the fleet, the model, the client
key and the upstream; when the answer is done the middleware counts it on the app's
:class:`ServerMetrics` and writes one access-log line (``haru_server.access``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from haru_protocol import FleetSnapshot
from haru_web import access_logged_key, client_address, observe_answer

from haru_server._metrics import metrics_key

UNKNOWN: Final = "unknown"
"""Label value of a fleet or model the request named but the server does not route."""

NO_KEY: Final = "none"
"""The ``key`` of a proxied request no client key was checked for (an open server, or a
request refused before its key was read)."""

access_logger = logging.getLogger("haru_server.access")


@dataclass(slots=True)
class ProxyNote:
    """What the proxy learned about one request, for its metrics and its access-log line.

    The proxy fills it in (:func:`note_route`, :func:`note_upstream`); the access middleware
    reads it when the answer is done. Only routed names go in: a model the client named but
    the fleet does not serve is logged as ``unknown`` (no client text in labels or logs).
    """

    fleet: str = UNKNOWN
    model: str = UNKNOWN
    snapshot: FleetSnapshot | None = None
    stale: bool = False
    upstream: str | None = None
    headers_s: float | None = None
    started: float = 0.0
    """``time.monotonic()`` when the request arrived (time to first token counts from here)."""
    key: str = NO_KEY
    """The client key's id, ``admin`` (the admin token) or ``none`` (no key checked)."""


proxy_note_key: Final = web.RequestKey("haru_proxy_note", ProxyNote)


def note_route(
    request: web.Request, snapshot: FleetSnapshot, *, model: str | None, stale: bool
) -> None:
    """The proxy resolved the request's fleet (and ``model`` when the fleet serves it)."""
    note = request.get(proxy_note_key)
    if note is None:
        return
    note.fleet = snapshot.slug
    note.snapshot = snapshot
    note.stale = stale
    if model is not None:
        note.model = model


def note_key(request: web.Request, label: str) -> None:
    """The request's client key id (or ``admin``/``none``) was checked."""
    note = request.get(proxy_note_key)
    if note is not None:
        note.key = label


def note_upstream(request: web.Request, origin: str, headers_s: float) -> None:
    """The upstream at ``origin`` answered with headers after ``headers_s`` seconds."""
    note = request.get(proxy_note_key)
    if note is None:
        return
    note.upstream = origin
    note.headers_s = headers_s


def note_first_chunk(request: web.Request) -> None:
    """The first chunk of a successful event stream was relayed to the client."""
    note = request.get(proxy_note_key)
    if note is None:
        return
    request.app[metrics_key].first_token(note.fleet, note.model, time.monotonic() - note.started)


def proxy_access_middleware(paths: frozenset[str]) -> Middleware:
    """Count and access-log every request to the proxied ``paths`` (status known at the end)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in paths:
            return await handler(request)
        note = ProxyNote(started=time.monotonic())
        request[proxy_note_key] = note
        request[access_logged_key] = True  # _record writes this request's access line
        return await observe_answer(
            request, handler, lambda status, total_s: _record(request, note, status, total_s)
        )

    return middleware


def _record(request: web.Request, note: ProxyNote, status: int, total_s: float) -> None:
    metrics = request.app[metrics_key]
    metrics.proxy_answered(note.fleet, note.model, request.path, status, note.headers_s)
    metrics.proxy_key_requests.labels(note.key, str(status)).inc()
    if note.stale:
        metrics.proxy_stale.labels(note.fleet).inc()
    if note.snapshot is not None:
        metrics.fleet_seen(note.snapshot)
    peer = client_address(request)
    access_logger.info(
        "proxy %s fleet=%s model=%s status=%d upstream=%s headers=%s total=%.3fs peer=%s key=%s",
        request.path,
        note.fleet,
        note.model,
        status,
        note.upstream or "-",
        "-" if note.headers_s is None else f"{note.headers_s:.3f}s",
        total_s,
        peer,
        note.key,
        extra={
            "route": request.path,
            "fleet": note.fleet,
            "model": note.model,
            "status": status,
            "upstream": note.upstream,
            "upstream_headers_s": None if note.headers_s is None else round(note.headers_s, 6),
            "total_s": round(total_s, 6),
            "stale": note.stale,
            "peer": peer,
            "key": note.key,
        },
    )
