"""The error envelope, the bearer check and strict request bodies."""

from __future__ import annotations

import logging
from typing import Final, TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler
from haru_protocol import ERROR_STATUS, ErrorCode, WireModel, bearer_matches, error_body
from pydantic import ValidationError

from haru_supervisor._keys import settings_key

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=WireModel)

MAX_BODY_BYTES: Final = 64 * 1024
"""Every request body of this API is a few keys; anything larger is refused (413)."""

_ERRORS_SHOWN: Final = 5


class ApiError(Exception):
    """Raised by a handler to answer with the ``{"error": {"code", "message"}}`` envelope."""

    def __init__(self, code: ErrorCode, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = ERROR_STATUS[code] if status is None else status


def json_error(
    code: ErrorCode,
    message: str,
    *,
    status: int | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """Render the error envelope for ``code`` (its usual status unless ``status`` is given)."""
    return web.json_response(
        text=error_body(code, message).model_dump_json(),
        status=ERROR_STATUS[code] if status is None else status,
        headers=headers,
    )


_HTTP_CODES: Final[dict[int, ErrorCode]] = {
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every failure with the envelope; an unexpected one is logged once, as a 500."""
    try:
        return await handler(request)
    except ApiError as exc:
        return json_error(exc.code, exc.message, status=exc.status)
    except web.HTTPException as exc:
        code = _HTTP_CODES.get(exc.status)
        if code is None:
            if exc.status < 400:
                raise
            code = ErrorCode.INVALID_REQUEST if exc.status < 500 else ErrorCode.INTERNAL_ERROR
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return json_error(code, exc.reason, status=exc.status, headers=headers)
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return json_error(ErrorCode.INTERNAL_ERROR, "internal error")


def _guarded(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every ``/v1/*`` route (known or not) needs the bearer token when one is configured."""
    token = request.app[settings_key].token
    if (
        token is not None
        and _guarded(request.path)
        and not bearer_matches(request.headers.get("Authorization"), token)
    ):
        return json_error(
            ErrorCode.UNAUTHORIZED,
            "missing or invalid bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return await handler(request)


def _summarize(exc: ValidationError) -> str:
    parts: list[str] = []
    errors = exc.errors(include_url=False, include_input=False)
    for error in errors[:_ERRORS_SHOWN]:
        location = ".".join(str(part) for part in error["loc"]) or "body"
        parts.append(f"{location}: {error['msg']}")
    if len(errors) > _ERRORS_SHOWN:
        parts.append(f"and {len(errors) - _ERRORS_SHOWN} more")
    return "invalid request body: " + "; ".join(parts)


async def read_body(request: web.Request, model: type[M]) -> M:
    """Parse a strict JSON body; an empty body means every default.

    Raises:
        ApiError: ``invalid_request`` (400) for malformed JSON, a non-object, an unknown key
            or a bad value.
    """
    raw = await request.read()
    if not raw.strip():
        return model()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, _summarize(exc)) from exc
