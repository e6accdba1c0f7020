"""Bounds on what one client may hold of a service: time, connections, log lines."""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from haru_web._peers import Network

DEFAULT_HEADER_TIMEOUT_S: Final = 10.0
DEFAULT_BODY_IDLE_TIMEOUT_S: Final = 30.0
DEFAULT_KEEPALIVE_TIMEOUT_S: Final = 75.0
DEFAULT_MAX_CONNECTIONS: Final = 512
DEFAULT_MAX_CONNECTIONS_PER_PEER: Final = 256

FD_RESERVE: Final = 64
"""File descriptors kept out of the connection cap (database, upstreams, trainers, logs)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerLimits:
    """Slow-client and overload bounds of one listening service.

    Attributes:
        header_timeout_s: Time a connection gets to send a whole request head, counted from
            the connection's opening or from the first byte of a later request's head. On
            expiry it gets 408 ``request_timeout`` and is closed.
        body_idle_timeout_s: Longest silence between two bytes of a request body the service
            is waiting for (a body the handler is not reading yet does not count). On expiry
            the connection is closed and the handler sees the client as gone (499).
        keepalive_timeout_s: How long an idle keep-alive connection is kept between requests.
        max_connections: Open client connections. At the cap a new connection evicts an
            idle or half-sent one (no request in flight): the oldest of the peer holding the
            most connections; when every connection is busy, the new one gets 503
            ``overloaded`` and is closed.
        max_connections_per_peer: Open connections of one peer (an IPv4 address or an IPv6
            /64). At this bound a new connection of the peer evicts the peer's own oldest
            idle or half-sent one, else gets 503 ``overloaded``. Trusted proxies are exempt.
        trusted_proxies: Reverse proxies (addresses or networks) whose ``X-Forwarded-For``
            names the client in the access log; they are exempt from the per-peer bound.
    """

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_idle_timeout_s: float = DEFAULT_BODY_IDLE_TIMEOUT_S
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER
    trusted_proxies: tuple[Network, ...] = ()

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_idle_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if self.max_connections_per_peer < 1:
            raise ValueError("max_connections_per_peer must be at least 1")

    @property
    def check_interval_s(self) -> float:
        """How often a connection's watchdog looks at it (bounds are met within this)."""
        return min(self.header_timeout_s / 4, self.body_idle_timeout_s / 4, 1.0)


def connection_cap(configured: int) -> int:
    """``configured``, lowered to fit the process's open-file limit with a reserve.

    Past the limit ``accept()`` fails with ``EMFILE`` and the service stops answering even its
    health check; a cap below it turns overload into clean 503s instead.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    room = soft - FD_RESERVE if soft > 2 * FD_RESERVE else soft // 2
    return max(1, min(configured, room))


class RateLimitedLog:
    """At most ``burst`` lines per ``window_s`` to one logger; the rest are counted.

    The count of suppressed lines is reported with the next line that gets through, so a
    flood of malformed requests costs a few log lines a minute, not one per request.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._window_start = clock()
        self._sent = 0
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        """Log ``message % args`` at WARNING unless this window's budget is spent."""
        now = self._clock()
        if now - self._window_start >= self._window_s:
            self._window_start = now
            self._sent = 0
        if self._sent >= self._burst:
            self._suppressed += 1
            return
        self._sent += 1
        if self._suppressed:
            message += " (%d similar lines suppressed)"
            args = (*args, self._suppressed)
            self._suppressed = 0
        self._logger.warning(message, *args)
