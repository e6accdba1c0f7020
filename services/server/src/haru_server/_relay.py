"""Streaming the upstream's answer back to the client (DESIGN 7.5).

The status and the body go back as they come, chunk by chunk; only ``content-type`` is copied
(and ``location`` on a 3xx: redirects are the client's to follow). An upstream that breaks or
goes silent (``HARU_UPSTREAM_IDLE_TIMEOUT_MS``) mid-answer breaks the client's connection, so
a truncated answer never reads as a clean end.
"""

from __future__ import annotations

import functools
import logging

import aiohttp
from aiohttp import hdrs, web
from haru_web import relay_answer

from haru_server._access_log import note_first_chunk
from haru_server._proxy_errors import HELD_HEADER, ROUTING_HEADER, STALE, origin
from haru_server._proxy_routes import RouteTable
from haru_server._route_entries import RouteLookup

logger = logging.getLogger(__name__)


class Relay:
    """Relays upstream answers to clients and counts the ones cut for silence."""

    __slots__ = ("idle_cuts",)

    def __init__(self) -> None:
        self.idle_cuts = 0
        """Answers cut because their upstream went silent mid-answer."""

    async def stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        lookup: RouteLookup[RouteTable],
        held_ms: int | None,
    ) -> web.StreamResponse:
        """Send ``upstream``'s answer to the client chunk by chunk, with its status.

        ``held_ms``: how long the request was held for a failover (None: it was not).
        """
        headers: dict[str, str] = {}
        content_type = upstream.headers.get(hdrs.CONTENT_TYPE)
        if content_type is not None:
            headers[hdrs.CONTENT_TYPE] = content_type
        location = upstream.headers.get(hdrs.LOCATION)
        if location is not None and 300 <= upstream.status < 400:
            headers[hdrs.LOCATION] = location  # the redirect is the client's to follow, or not
        if lookup.stale:
            headers[ROUTING_HEADER] = STALE
        if held_ms is not None:
            headers[HELD_HEADER] = str(held_ms)
        # Time to first token: the first chunk of a successful event stream (a streamed
        # completion); other answers have no first token to time.
        timing = 200 <= upstream.status < 300 and (content_type or "").startswith(
            "text/event-stream"
        )
        return await relay_answer(
            request,
            upstream,
            headers,
            on_broken=functools.partial(self._broken, upstream, lookup),
            on_client_gone=functools.partial(_client_gone, request),
            on_first_chunk=functools.partial(note_first_chunk, request) if timing else None,
        )

    def _broken(
        self,
        upstream: aiohttp.ClientResponse,
        lookup: RouteLookup[RouteTable],
        exc: aiohttp.ClientError,
    ) -> None:
        if isinstance(exc, aiohttp.ServerTimeoutError):
            self.idle_cuts += 1
            logger.warning(
                "fleet %s: upstream %s sent nothing for HARU_UPSTREAM_IDLE_TIMEOUT_MS "
                "mid-answer; cut (%d so far), breaking the client connection",
                lookup.routes.fleet_slug,
                origin(upstream.url),
                self.idle_cuts,
            )
        else:
            logger.warning(
                "fleet %s: upstream %s broke mid-answer (%s); breaking the client connection",
                lookup.routes.fleet_slug,
                origin(upstream.url),
                exc,
            )


def _client_gone(request: web.Request) -> None:
    # The client went away mid-answer: the relay stopped (the caller closes the upstream).
    logger.info("499 %s %s: client disconnected mid-answer", request.method, request.path)
