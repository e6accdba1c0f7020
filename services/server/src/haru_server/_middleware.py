"""The server's own middleware: state-store failures in the error envelope.

The envelope, the bearer gate and the browser guard come from haru-web; this one translates
the failures only the server has (its state store) before they would become a 500.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.typedefs import Handler
from haru_db import MalformedFleetStateError, StateStoreUnavailableError
from haru_protocol import ErrorCode
from haru_web import ApiError

from haru_server._metrics import metrics_key

logger = logging.getLogger(__name__)


@web.middleware
async def store_error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer 503 ``state_store_unavailable`` for an unavailable store or malformed state.

    Malformed stored state is logged with its traceback and never served.
    """
    try:
        return await handler(request)
    except StateStoreUnavailableError as exc:
        request.app[metrics_key].store_error("request")
        logger.warning("%s %s: state store unavailable: %s", request.method, request.path, exc)
        raise ApiError(
            ErrorCode.STATE_STORE_UNAVAILABLE, "the state store is unavailable"
        ) from None
    except MalformedFleetStateError:
        request.app[metrics_key].store_error("request")
        logger.exception("%s %s: malformed stored state", request.method, request.path)
        raise ApiError(
            ErrorCode.STATE_STORE_UNAVAILABLE,
            "stored fleet state is malformed and cannot be served (see the server log)",
        ) from None
