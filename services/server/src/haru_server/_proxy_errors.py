"""How the inference proxy says what went wrong: its error answers and their headers.

An answer that failed for want of a route carries ``Retry-After``; one served from a stale
route read carries ``X-Haru-Routing: stale``; one that was held through a failover carries
``X-Haru-Held-Ms``. :class:`UnansweredError` marks a failure no server answered and of which
nothing went to the client: the only kind a failover may hold (DESIGN 7.5).
"""

from __future__ import annotations

from typing import Final

from aiohttp import hdrs
from haru_protocol import ErrorCode
from haru_web import ApiError
from yarl import URL

from haru_server._proxy_routes import RouteTable
from haru_server._route_cache import RETRY_AFTER_S
from haru_server._route_entries import RouteLookup

ROUTING_HEADER: Final = "X-Haru-Routing"
HELD_HEADER: Final = "X-Haru-Held-Ms"
STALE: Final = "stale"


class UnansweredError(Exception):
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


def unroutable(lookup: RouteLookup[RouteTable]) -> ApiError:
    active = lookup.snapshot.active_domain
    reason = (
        "has no active domain"
        if active is None
        else f"has its active domain {active.slug!r} in state {active.state.value!r}"
    )
    return ApiError(
        ErrorCode.NO_ACTIVE_DOMAIN,
        f"fleet {lookup.routes.fleet_slug!r} {reason}; nothing can serve right now",
        headers=retry_headers(lookup),
    )


def unserved(lookup: RouteLookup[RouteTable], model: str) -> ApiError:
    active = lookup.snapshot.active_domain
    where = "" if active is None else f" of active domain {active.slug!r}"
    return ApiError(
        ErrorCode.NO_ACTIVE_DOMAIN,
        f"model {model[:200]!r} of fleet {lookup.routes.fleet_slug!r} is bound but its "
        f"slot{where} is not serving; nothing can serve it right now",
        headers=retry_headers(lookup),
    )


def with_held(error: ApiError, started: float, now: float) -> ApiError:
    """``error`` as answered after a hold that ran out, with the hold's length.

    It says when to try again too: the failover it waited for may still come.
    """
    headers = {
        **error.headers,
        HELD_HEADER: str(int((now - started) * 1000)),
        hdrs.RETRY_AFTER: str(RETRY_AFTER_S),
    }
    return ApiError(error.code, error.message, status=error.status, headers=headers)


def routing_headers(lookup: RouteLookup[RouteTable]) -> dict[str, str] | None:
    return {ROUTING_HEADER: STALE} if lookup.stale else None


def retry_headers(lookup: RouteLookup[RouteTable]) -> dict[str, str]:
    return {**(routing_headers(lookup) or {}), hdrs.RETRY_AFTER: str(RETRY_AFTER_S)}


def origin(url: URL) -> str:
    # Logged instead of the full URL: a servingUrl's query string may carry a credential.
    return str(url.origin())
