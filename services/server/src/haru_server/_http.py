"""The error envelope on the wire: one exception type and one renderer for every route."""

from __future__ import annotations

from typing import TypeVar

from aiohttp import web
from haru_protocol import ERROR_STATUS, ErrorCode, error_body
from pydantic import BaseModel, ValidationError


class ApiError(Exception):
    """Raised by a handler to answer with the ``{"error": {"code", "message"}}`` envelope."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = ERROR_STATUS[code] if status is None else status
        self.headers = headers or {}


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


def render_api_error(error: ApiError) -> web.Response:
    """The response an :class:`ApiError` stands for."""
    return json_error(error.code, error.message, status=error.status, headers=error.headers)


CONTROL_BODY_LIMIT = 16 * 1024
"""Largest body a control-API POST accepts (SPEC 7.2)."""

_M = TypeVar("_M", bound=BaseModel)


async def read_body(request: web.Request, *, limit: int) -> bytes:
    """Read the request body, refusing more than ``limit`` bytes before buffering them.

    Raises:
        ApiError: 413 ``payload_too_large`` when the declared or streamed size exceeds ``limit``.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise ApiError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"request body of {declared} bytes exceeds the limit of {limit} bytes",
        )
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise ApiError(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"request body exceeds the limit of {limit} bytes",
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(
    request: web.Request,
    model: type[_M],
    *,
    limit: int = CONTROL_BODY_LIMIT,
    empty_ok: bool = False,
) -> _M:
    """Read and validate a strict JSON body (unknown keys, bad JSON: 400 ``invalid_request``).

    Args:
        request: The request.
        model: The strict wire model of the body.
        limit: Byte cap (413 beyond it).
        empty_ok: Treat an empty body as ``{}`` (for routes whose every field is optional).
    """
    raw = await read_body(request, limit=limit)
    if not raw.strip():
        if not empty_ok:
            raise ApiError(ErrorCode.INVALID_REQUEST, "request body is empty; JSON expected")
        raw = b"{}"
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError, *, limit: int = 3) -> str:
    """A short, input-free summary of a validation error (never echoes the body)."""
    parts: list[str] = []
    for error in exc.errors(include_url=False, include_input=False)[:limit]:
        loc = ".".join(str(p) for p in error["loc"]) or "body"
        parts.append(f"{loc}: {error['msg']}")
    more = exc.error_count() - len(parts)
    suffix = f" (and {more} more)" if more > 0 else ""
    return "invalid request body: " + "; ".join(parts) + suffix
