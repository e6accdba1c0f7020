"""Errors of haru-web.

Hierarchy::

    HaruWebError
    ├── ApiError           a handler's answer in the ``{"error": {"code", "message"}}`` envelope
    ├── ListenError(OSError)  the listening socket could not be bound
    └── TokenConfigError(ValueError)  a token variable or token file is unusable
"""

from __future__ import annotations

from haru_protocol import ERROR_STATUS, ErrorCode


class HaruWebError(Exception):
    """Root of haru-web's exceptions."""


class ApiError(HaruWebError):
    """Raised by a handler to answer with the ``{"error": {"code", "message"}}`` envelope.

    Attributes:
        code: The envelope's error code.
        message: The envelope's message (never a secret, never an echo of the request).
        status: The HTTP status (the code's usual one unless given).
        headers: Extra response headers (``WWW-Authenticate``, ``Allow``, ``Retry-After``).
    """

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


class ListenError(HaruWebError, OSError):
    """The service could not listen on its address (port taken, no permission)."""
