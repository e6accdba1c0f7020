"""The route cache at the proxy's boundary: its domain errors answered as HTTP API errors.

The cache (``_route_cache``) knows nothing of HTTP; a request's routing is resolved here, and a
fleet that does not exist answers 404 ``fleet_not_found``, routing that cannot be served safely
503 ``state_store_unavailable`` (with ``Retry-After`` when the cause passes in seconds).
"""

from __future__ import annotations

from typing import TypeVar

from haru_protocol import ErrorCode
from haru_web import ApiError

from haru_server._errors import FleetNotFoundError, RoutingUnavailableError
from haru_server._route_cache import RETRY_AFTER_S, RouteCache
from haru_server._route_entries import RouteLookup

T = TypeVar("T")


def routing_api_error(exc: FleetNotFoundError | RoutingUnavailableError) -> ApiError:
    """The HTTP answer to a fleet's routing that cannot be served."""
    if isinstance(exc, FleetNotFoundError):
        return ApiError(ErrorCode.FLEET_NOT_FOUND, str(exc))
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.retry_soon else None
    return ApiError(ErrorCode.STATE_STORE_UNAVAILABLE, str(exc), headers=headers)


async def resolve_route(cache: RouteCache[T], ref: str) -> RouteLookup[T]:
    """:meth:`RouteCache.resolve`, its failures raised as :class:`haru_web.ApiError`.

    Raises:
        ApiError: ``fleet_not_found`` (404) when no such fleet exists;
            ``state_store_unavailable`` (503) when routing cannot be served safely.
    """
    try:
        return await cache.resolve(ref)
    except (FleetNotFoundError, RoutingUnavailableError) as exc:
        raise routing_api_error(exc) from exc
