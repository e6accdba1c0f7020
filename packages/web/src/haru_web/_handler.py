"""aiohttp's request handler with slow-client bounds, a connection cap and quiet protocol errors.

aiohttp bounds neither the time to receive a request head nor the silence inside a body, and
answers its own protocol errors (a bad header character, a line over 8,190 bytes) in plain
text that quotes the offending line, after logging it at ERROR with a traceback. That line can
be ``Authorization: Bearer <token>``. This subclass:

- closes a connection whose request head is not complete within ``header_timeout_s`` (408),
- closes one whose request body stays silent for ``body_idle_timeout_s`` while awaited,
- keeps at most ``max_connections`` open, and ``max_connections_per_peer`` per peer, by
  evicting an idle or half-sent connection (one peer's before the others'), else 503,
- refuses request lines other than HTTP/1.0 and HTTP/1.1 (505),
- answers every protocol error in the JSON envelope with a fixed message, and logs it as one
  rate-limited WARNING line naming the error's kind only (never its text).

It relies on a few of ``RequestHandler``'s internals (``_messages``, ``_request_count``); the
package pins the aiohttp minor and its tests exercise each of them with real sockets.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Any, Final

from aiohttp import http_exceptions, web
from aiohttp.http import HttpVersion10, HttpVersion11
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler, _ErrInfo
from aiohttp.web_request import BaseRequest
from haru_protocol import ErrorCode

from haru_web._envelope import json_error, raw_error_bytes
from haru_web._limits import RateLimitedLog, ServerLimits
from haru_web._peers import forwarded_client, is_trusted, peer_group

logger = logging.getLogger("haru_web.protocol")

_VERSIONS: Final = (HttpVersion10, HttpVersion11)


class _VersionNotSupported(http_exceptions.HttpProcessingError):
    code = 505
    message = "HTTP version not supported"


def describe_protocol_error(status: int, exc: BaseException | None) -> tuple[ErrorCode, str]:
    """A fixed code and message for an error aiohttp raised while parsing (never its text)."""
    if isinstance(exc, _VersionNotSupported) or status == 505:
        return ErrorCode.HTTP_VERSION_NOT_SUPPORTED, "only HTTP/1.0 and HTTP/1.1 are supported"
    if isinstance(exc, http_exceptions.LineTooLong):
        return ErrorCode.INVALID_REQUEST, "a request line or header field is too long"
    if isinstance(exc, http_exceptions.BadHttpMethod):
        return ErrorCode.INVALID_REQUEST, "malformed request method"
    if isinstance(exc, http_exceptions.BadStatusLine):
        return ErrorCode.INVALID_REQUEST, "malformed request line"
    if isinstance(exc, http_exceptions.InvalidHeader):
        return ErrorCode.INVALID_REQUEST, "malformed header field"
    if isinstance(exc, http_exceptions.TransferEncodingError | http_exceptions.ContentLengthError):
        return ErrorCode.INVALID_REQUEST, "malformed request body framing"
    if status == 504:
        return ErrorCode.UPSTREAM_TIMEOUT, "the request handler timed out"
    if status >= 500:
        return ErrorCode.INTERNAL_ERROR, "internal error (see the service log)"
    return ErrorCode.INVALID_REQUEST, "malformed HTTP request"


class ConnectionRegistry:
    """The open connections of one listening service, oldest first, and by peer."""

    def __init__(self, limits: ServerLimits, protocol_log: RateLimitedLog) -> None:
        self.limits = limits
        self.protocol_log = protocol_log
        self._open: dict[HardenedRequestHandler, None] = {}
        self._by_peer: dict[str, dict[HardenedRequestHandler, None]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, handler: HardenedRequestHandler) -> str | None:
        """Register ``handler``, evicting to make room; None, or why it is refused.

        At the per-peer bound the peer's own oldest evictable connection goes; at the global
        cap the oldest evictable one of the peer holding the most connections (so a client
        that opens hundreds of half-sent requests evicts its own, not the others').
        """
        limits = self.limits
        mine = self._by_peer.get(handler.peer_group, {})
        if not handler.trusted_proxy and len(mine) >= limits.max_connections_per_peer:
            victim = _first_evictable(mine)
            if victim is None:
                return f"per-peer connection bound ({limits.max_connections_per_peer}) reached"
            self.protocol_log.warning(
                "per-peer connection bound (%d) reached by %s: closing its oldest idle "
                "or half-sent connection",
                limits.max_connections_per_peer,
                handler.peer_group,
            )
            self._evict(victim)
        if len(self._open) >= limits.max_connections:
            victim = self._global_victim()
            if victim is None:
                return f"connection cap ({limits.max_connections}) reached, every one busy"
            self.protocol_log.warning(
                "connection cap (%d) reached: closing an idle or half-sent connection of %s",
                limits.max_connections,
                victim.peer_group,
            )
            self._evict(victim)
        self._open[handler] = None
        self._by_peer.setdefault(handler.peer_group, {})[handler] = None
        return None

    def _global_victim(self) -> HardenedRequestHandler | None:
        groups = sorted(self._by_peer.values(), key=len, reverse=True)
        for group in groups:
            victim = _first_evictable(group)
            if victim is not None:
                return victim
        return None

    def _evict(self, victim: HardenedRequestHandler) -> None:
        victim.force_close()
        self.discard(victim)

    def discard(self, handler: HardenedRequestHandler) -> None:
        self._open.pop(handler, None)
        group = self._by_peer.get(handler.peer_group)
        if group is not None:
            group.pop(handler, None)
            if not group:
                del self._by_peer[handler.peer_group]


def _first_evictable(
    handlers: dict[HardenedRequestHandler, None],
) -> HardenedRequestHandler | None:
    return next((h for h in handlers if h.evictable), None)


class HardenedRequestHandler(RequestHandler):
    """One client connection, with the bounds of :class:`ServerLimits`."""

    def __init__(self, manager: web.Server, *, registry: ConnectionRegistry, **kwargs: Any) -> None:
        limits = registry.limits
        kwargs["keepalive_timeout"] = limits.keepalive_timeout_s
        super().__init__(manager, **kwargs)
        self._registry = registry
        self._limits = limits
        self._head_since: float | None = None
        self._head_partial = False
        self._body: StreamReader | None = None
        self._last_body_byte = 0.0
        self._finished = 0
        self._watchdog: asyncio.TimerHandle | None = None
        self._admitted = False
        self.peer_group = "-"
        """The key this connection counts under for the per-peer bound."""
        self.trusted_proxy = False
        """The direct peer is one of :attr:`ServerLimits.trusted_proxies`."""

    @property
    def evictable(self) -> bool:
        """Idle, or half-way through sending a request head: no request is being served."""
        return self._request_count == self._finished and not self._force_close

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        now = self._loop.time()
        self._head_since = now
        peer = self.peername
        address = str(peer[0]) if isinstance(peer, tuple) and peer else None
        self.peer_group = peer_group(address)
        self.trusted_proxy = is_trusted(address, self._limits.trusted_proxies)
        refused = self._registry.admit(self)
        if refused is not None:
            self._registry.protocol_log.warning(
                "refused a connection from %s: %s", self.peer_group, refused
            )
            self._answer_raw(503, ErrorCode.OVERLOADED, "too many connections; retry shortly")
            return
        self._admitted = True
        self._watchdog = self._loop.call_at(now + self._limits.check_interval_s, self._check_bounds)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._registry.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        now = self._loop.time()
        body = self._body
        in_body = body is not None and not body.is_eof()
        before = self._request_count
        queued = len(self._messages)
        super().data_received(data)
        if in_body:
            self._last_body_byte = now
        parsed = self._request_count - before
        if parsed > 0:
            self._head_since = None
            self._head_partial = False
            self._last_body_byte = now
            self._reject_unsupported_versions(queued)
            self._body = self._messages[-1][1] if self._messages else None
        elif data and not in_body:
            self._head_partial = True
            if self._head_since is None:
                self._head_since = now

    def _reject_unsupported_versions(self, first_new: int) -> None:
        for index in range(first_new, len(self._messages)):
            message, payload = self._messages[index]
            if isinstance(message, _ErrInfo) or message.version in _VERSIONS:
                continue
            exc = _VersionNotSupported()
            self._messages[index] = (_ErrInfo(status=505, exc=exc, message=exc.message), payload)

    def log_access(self, request: BaseRequest, response: Any, time: float | None) -> None:
        self._finished += 1
        super().log_access(request, response, time)

    def _check_bounds(self) -> None:
        self._watchdog = None
        transport = self.transport
        if transport is None or self._force_close:
            return
        now = self._loop.time()
        limits = self._limits
        head_since = self._head_since
        body = self._body
        if (
            head_since is not None
            and self._request_count == self._finished
            and now - head_since >= limits.header_timeout_s
        ):
            self._registry.protocol_log.warning(
                "closed a connection from %s: no complete request head within %.1f s",
                self._peer(),
                limits.header_timeout_s,
            )
            self._answer_raw(408, ErrorCode.REQUEST_TIMEOUT, "request head not received in time")
            return
        if body is not None and not body.is_eof():
            if not transport.is_reading():
                # Paused by flow control: the handler is slow, not the client.
                self._last_body_byte = now
            elif now - self._last_body_byte >= limits.body_idle_timeout_s:
                self._registry.protocol_log.warning(
                    "closed a connection from %s: request body silent for %.1f s",
                    self._peer(),
                    limits.body_idle_timeout_s,
                )
                self.force_close()
                return
        self._watchdog = self._loop.call_at(now + limits.check_interval_s, self._check_bounds)

    def _peer(self) -> str:
        peer = self.peername
        return str(peer[0]) if isinstance(peer, tuple) and peer else "an unknown peer"

    def _answer_raw(self, status: int, code: ErrorCode, message: str) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(raw_error_bytes(status, HTTPStatus(status).phrase, code, message))
        # close() flushes what was written before closing the socket.
        self.force_close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Answer a protocol error or an escaped failure in the envelope, never echoing input."""
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent; cannot send an error")
        code, text = describe_protocol_error(status, exc)
        if (
            status >= 500
            and status != 505
            and not isinstance(exc, http_exceptions.HttpProcessingError)
        ):
            # A failure of the service's own code, outside its error middleware.
            logger.error("%s %s: unexpected failure", request.method, request.path, exc_info=exc)
        else:
            self._registry.protocol_log.warning(
                "rejected a malformed request from %s: %s (%d)",
                request.remote,
                type(exc).__name__ if exc is not None else "error",
                status,
            )
        response = json_error(code, text, status=status)
        response.force_close()
        return response


def client_address(request: BaseRequest) -> str:
    """The client's address for logs.

    The direct peer, or the client ``X-Forwarded-For`` names when the direct peer is a trusted
    proxy (``HARU_TRUSTED_PROXIES``; none by default, so a client cannot forge its address).
    """
    protocol = request.protocol
    trusted = (
        protocol._limits.trusted_proxies if isinstance(protocol, HardenedRequestHandler) else ()
    )
    return forwarded_client(request.remote, request.headers.get("X-Forwarded-For"), trusted)


class HardenedServer(web.Server):
    """An aiohttp low-level server whose connections are :class:`HardenedRequestHandler`."""

    def __init__(self, *args: Any, registry: ConnectionRegistry, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.registry = registry

    def __call__(self) -> RequestHandler:
        return HardenedRequestHandler(self, loop=self._loop, registry=self.registry, **self._kwargs)


def harden(server: web.Server, registry: ConnectionRegistry) -> HardenedServer:
    """The same server (handler, request factory, options) with hardened connections."""
    return HardenedServer(
        server.request_handler,
        request_factory=server.request_factory,
        handler_cancellation=server.handler_cancellation,
        loop=server._loop,
        registry=registry,
        **server._kwargs,
    )
