"""Middlewares shared by both services: the error envelope, the bearer gate, the browser guard.

Also :func:`observe_answer`, the status and duration of an answer however it ends, for a
service's own counting and access logging.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import time
from collections.abc import Callable
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from haru_protocol import ErrorCode

from haru_web._envelope import json_error, render_api_error
from haru_web._errors import ApiError
from haru_web._tokens import TokenSource

logger = logging.getLogger("haru_web")

BEARER_CHALLENGE: Final = 'Bearer realm="haru"'
"""The ``WWW-Authenticate`` value of every 401 (one realm for both services)."""

CLIENT_CLOSED_STATUS: Final = 499
"""nginx's convention: the client closed the connection before the answer."""

_STATUS_CODES: Final[dict[int, ErrorCode]] = {
    400: ErrorCode.INVALID_REQUEST,
    401: ErrorCode.UNAUTHORIZED,
    403: ErrorCode.FORBIDDEN,
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    408: ErrorCode.REQUEST_TIMEOUT,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
    415: ErrorCode.UNSUPPORTED_MEDIA_TYPE,
    501: ErrorCode.NOT_IMPLEMENTED,
    503: ErrorCode.SHUTTING_DOWN,
    505: ErrorCode.HTTP_VERSION_NOT_SUPPORTED,
}

_MESSAGES: Final[dict[int, str]] = {
    404: "no such route",
    405: "method not allowed on this route",
}


def is_api_path(path: str) -> bool:
    """Whether ``path`` is under ``/v1`` (the routes the bearer token guards)."""
    return path == "/v1" or path.startswith("/v1/")


async def observe_answer(
    request: web.Request, handler: Handler, record: Callable[[int, float], None]
) -> web.StreamResponse:
    """``handler``'s answer to ``request``, with ``record(status, seconds)`` called once at its end.

    The status is the response's, or the one an :class:`ApiError` or an aiohttp HTTP exception
    carries; 499 when the request was cancelled (the client went away), 500 for any other
    failure. The exception, if any, goes on up after ``record``.
    """
    started = time.monotonic()
    status = 500
    try:
        response = await handler(request)
    except (ApiError, web.HTTPException) as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = CLIENT_CLOSED_STATUS
        raise
    else:
        status = response.status
    finally:
        record(status, time.monotonic() - started)
    return response


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _client_closed(request: web.Request) -> web.Response:
    logger.info(
        "%d %s %s: client disconnected before the response",
        CLIENT_CLOSED_STATUS,
        request.method,
        request.path,
    )
    # Never written (the socket is gone); returned so the access log shows 499, not 200.
    return web.Response(status=CLIENT_CLOSED_STATUS)


def _envelope_for(exc: web.HTTPException) -> web.Response:
    code = _STATUS_CODES.get(exc.status)
    if code is None:
        code = ErrorCode.INTERNAL_ERROR if exc.status >= 500 else ErrorCode.INVALID_REQUEST
    message = _MESSAGES.get(exc.status, exc.reason)
    headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
    return json_error(code, message, status=exc.status, headers=headers or None)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into the ``{"error": {"code", "message"}}`` envelope.

    :class:`ApiError` renders as itself; aiohttp's HTTP errors keep their status (unknown
    route 404 ``not_found``, wrong method 405 ``method_not_allowed`` with ``Allow``);
    anything unexpected is a 500 ``internal_error``, logged once with its traceback and never
    sent on the wire. A client that went away gets nothing and is logged (and access-logged)
    as 499.
    """
    try:
        response = await handler(request)
    except ApiError as exc:
        if _client_gone(request):
            return _client_closed(request)
        return render_api_error(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _envelope_for(exc)
    except asyncio.CancelledError:
        if _client_gone(request):
            logger.info("%d %s %s: cancelled", CLIENT_CLOSED_STATUS, request.method, request.path)
        raise
    except ConnectionResetError:
        return _client_closed(request)
    except Exception:  # the last line of defence: no fault reaches the wire raw
        logger.exception("%s %s: unexpected failure", request.method, request.path)
        return json_error(ErrorCode.INTERNAL_ERROR, "internal error (see the service log)")
    if _client_gone(request) and not response.prepared:
        return _client_closed(request)
    return response


def bearer_middleware(
    token: str | TokenSource | None, *, guarded: Callable[[str], bool] = is_api_path
) -> Middleware:
    """Require ``Authorization: Bearer <token>`` on every guarded path (``/v1`` and below).

    A :class:`TokenSource` is asked on every request (a rotated token file takes effect
    without a restart). The comparison runs in constant time; a 401 carries
    ``WWW-Authenticate: Bearer realm="haru"``. With no token the API is open (and the service
    listens on loopback only, behind :func:`browser_guard_middleware`).
    """
    source = TokenSource.constant(token) if isinstance(token, str) else token

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            source is not None
            and guarded(request.path)
            and not source.matches(request.headers.get("Authorization"))
        ):
            return json_error(
                ErrorCode.UNAUTHORIZED,
                "missing or invalid bearer token",
                headers={"WWW-Authenticate": BEARER_CHALLENGE},
            )
        return await handler(request)

    return middleware


def is_loopback_host(host: str) -> bool:
    """Whether a ``Host`` header value (port optional) names the loopback interface."""
    return _is_loopback_host(host)


@functools.lru_cache(maxsize=256)  # asked on every request of a token-less service
def _is_loopback_host(host: str) -> bool:
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    name = name.rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _same_origin(origin: str, host: str) -> bool:
    return origin.strip().lower() in {f"http://{host.strip().lower()}"}


def browser_guard_middleware(*, open_api: bool, check_host: bool = True) -> Middleware:
    """Keep browsers from driving an API that has no token (CSRF and DNS rebinding).

    With ``open_api`` (no token configured; the service listens on loopback only), a request
    whose ``Host`` is not a loopback name or address is refused (403 ``forbidden``: a DNS
    rebinding page reaches 127.0.0.1 under its own host name), and so is one carrying an
    ``Origin`` other than the service's own (a page on another site, or ``null``). Clients
    that are not browsers send no ``Origin`` and are not affected. With a token the guard
    does nothing: a browser cannot add the ``Authorization`` header to a cross-site request
    without a CORS preflight, which these services never grant.

    ``check_host=False`` drops the ``Host`` rule (the ``Origin`` rule stays): for a token-less
    service its operator deliberately exposed on a network (``HARU_ALLOW_OPEN_BIND``), whose
    clients reach it under a non-loopback name.
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if open_api:
            host = request.headers.get("Host")
            if check_host and host is not None and not is_loopback_host(host):
                raise ApiError(
                    ErrorCode.FORBIDDEN,
                    "this service has no token and answers loopback host names only",
                )
            origin = request.headers.get("Origin")
            if origin is not None and (host is None or not _same_origin(origin, host)):
                raise ApiError(
                    ErrorCode.FORBIDDEN, "cross-origin requests are refused (no token is set)"
                )
        return await handler(request)

    return middleware
