"""Middlewares wrapping every route (the proxy's too): the error envelope and the bearer gate."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.typedefs import Handler
from haru_db import MalformedFleetStateError, StateStoreUnavailableError
from haru_protocol import ErrorCode, bearer_matches

from haru_server._http import ApiError, json_error, render_api_error
from haru_server._keys import settings_key

logger = logging.getLogger(__name__)

_STATUS_CODES: dict[int, ErrorCode] = {
    400: ErrorCode.INVALID_REQUEST,
    401: ErrorCode.UNAUTHORIZED,
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
    501: ErrorCode.NOT_IMPLEMENTED,
    503: ErrorCode.SHUTTING_DOWN,
}

_PROTECTED_PREFIX = "/v1/"


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _log_disconnect(request: web.Request) -> None:
    # nginx's convention: 499 = the client closed the connection before the answer.
    logger.info("499 %s %s: client disconnected before the response", request.method, request.path)


def _envelope_for(exc: web.HTTPException) -> web.Response:
    code = _STATUS_CODES.get(exc.status)
    if code is None:
        code = ErrorCode.INTERNAL_ERROR if exc.status >= 500 else ErrorCode.INVALID_REQUEST
    message = {
        404: "no such route",
        405: "method not allowed on this route",
    }.get(exc.status, exc.reason)
    headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
    return json_error(code, message, status=exc.status, headers=headers or None)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into the ``{"error": {"code", "message"}}`` envelope.

    Unknown routes are 404 ``not_found``, wrong methods 405 ``method_not_allowed``, an
    unavailable store 503 ``state_store_unavailable`` and anything unexpected 500
    ``internal_error`` (logged once, with its traceback, never sent on the wire). A client
    that went away gets nothing and is logged as 499.
    """
    try:
        response = await handler(request)
    except ApiError as exc:
        return render_api_error(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _envelope_for(exc)
    except StateStoreUnavailableError as exc:
        logger.warning("%s %s: state store unavailable: %s", request.method, request.path, exc)
        return json_error(ErrorCode.STATE_STORE_UNAVAILABLE, "the state store is unavailable")
    except MalformedFleetStateError:
        logger.exception("%s %s: malformed stored state", request.method, request.path)
        return json_error(
            ErrorCode.STATE_STORE_UNAVAILABLE,
            "stored fleet state is malformed and cannot be served (see the server log)",
        )
    except asyncio.CancelledError:
        if _client_gone(request):
            _log_disconnect(request)
        raise
    except ConnectionResetError:
        _log_disconnect(request)
        raise
    except Exception:  # the last line of defence: no fault reaches the wire raw
        logger.exception("%s %s: unexpected failure", request.method, request.path)
        return json_error(ErrorCode.INTERNAL_ERROR, "internal error (see the server log)")
    if _client_gone(request) and not response.prepared:
        _log_disconnect(request)
    return response


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Require ``Authorization: Bearer <HARU_API_TOKEN>`` on every ``/v1/*`` route.

    The comparison runs in constant time; with no token configured the API is open (and the
    server listens on 127.0.0.1 only).
    """
    if request.path.startswith(_PROTECTED_PREFIX):
        token = request.app[settings_key].api_token
        if not bearer_matches(request.headers.get("Authorization"), token):
            return json_error(
                ErrorCode.UNAUTHORIZED,
                "missing or invalid bearer token",
                headers={"WWW-Authenticate": 'Bearer realm="haru"'},
            )
    return await handler(request)
