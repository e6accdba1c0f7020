"""Rendering JSON answers: a model's body, and the error envelope of every failure."""

from __future__ import annotations

from aiohttp import web
from haru_protocol import ERROR_STATUS, ErrorCode, error_body
from pydantic import BaseModel

from haru_web._errors import ApiError


def json_model(
    model: BaseModel, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """A JSON answer whose body is ``model`` serialised by pydantic (its aliases, no extras)."""
    return web.json_response(text=model.model_dump_json(), status=status, headers=headers)


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


def raw_error_bytes(status: int, reason: str, code: ErrorCode, message: str) -> bytes:
    """A whole ``Connection: close`` HTTP/1.1 answer, for a socket no request object owns.

    Used where aiohttp has no request to answer (a header bound ran out, the connection cap
    was hit before anything was read).
    """
    body = error_body(code, message).model_dump_json().encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body
