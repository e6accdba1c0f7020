"""The error envelope on the wire: one exception type and one renderer for every route."""

from __future__ import annotations

from aiohttp import web
from haru_protocol import ERROR_STATUS, ErrorCode, error_body


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
