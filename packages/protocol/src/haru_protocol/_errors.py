"""The error envelope every Haru service answers with, and its closed list of codes.

Exception hierarchy of haru-protocol::

    HaruProtocolError             (root of the errors haru-protocol's helpers raise)
    └── UrlJoinError(ValueError)  (_urls: a join that would change origin or escape the base)
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from haru_protocol._base import PeerModel


class HaruProtocolError(Exception):
    """Root of the exceptions raised by haru-protocol helpers."""


class ErrorCode(StrEnum):
    """Every code an error envelope may carry (DESIGN section 9)."""

    UNAUTHORIZED = "unauthorized"
    FLEET_NOT_FOUND = "fleet_not_found"
    MODEL_NOT_FOUND = "model_not_found"
    NO_ACTIVE_DOMAIN = "no_active_domain"
    INVALID_REQUEST = "invalid_request"
    INVALID_TARGET = "invalid_target"
    OPERATION_CONFLICT = "operation_conflict"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL_ERROR = "internal_error"
    STATE_STORE_UNAVAILABLE = "state_store_unavailable"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    NOT_IMPLEMENTED = "not_implemented"
    FORBIDDEN = "forbidden"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    REQUEST_TIMEOUT = "request_timeout"
    OVERLOADED = "overloaded"
    HTTP_VERSION_NOT_SUPPORTED = "http_version_not_supported"
    FLEET_NOT_RECONCILED = "fleet_not_reconciled"
    NOT_READY = "not_ready"
    STALE_FENCE = "stale_fence"
    POLICY_CONFLICT = "policy_conflict"
    PLAN_STALE = "plan_stale"
    CHANGE_REFUSED = "change_refused"
    RATE_LIMITED = "rate_limited"


ERROR_STATUS: dict[ErrorCode, int] = {
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FLEET_NOT_FOUND: 404,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.NO_ACTIVE_DOMAIN: 503,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.INVALID_TARGET: 422,
    ErrorCode.OPERATION_CONFLICT: 409,
    ErrorCode.UPSTREAM_UNREACHABLE: 502,
    ErrorCode.UPSTREAM_TIMEOUT: 504,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.STATE_STORE_UNAVAILABLE: 503,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.NOT_IMPLEMENTED: 501,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.HTTP_VERSION_NOT_SUPPORTED: 505,
    ErrorCode.FLEET_NOT_RECONCILED: 409,
    ErrorCode.NOT_READY: 503,
    ErrorCode.STALE_FENCE: 409,
    ErrorCode.POLICY_CONFLICT: 409,
    ErrorCode.PLAN_STALE: 409,
    ErrorCode.CHANGE_REFUSED: 409,
    ErrorCode.RATE_LIMITED: 429,
}
"""The usual HTTP status of each code (a route may document a different one)."""


class ErrorDetail(PeerModel):
    """The inside of the error envelope."""

    code: str
    """One of :class:`ErrorCode` (kept as a string when parsed from a newer peer)."""
    message: str = Field(max_length=4096)
    """Human-readable explanation; never contains a secret."""


class ErrorBody(PeerModel):
    """``{"error": {"code", "message"}}``: the body of every non-2xx answer."""

    error: ErrorDetail


def error_body(code: ErrorCode, message: str) -> ErrorBody:
    """Build the envelope for ``code``, truncating an overlong message."""
    return ErrorBody(error=ErrorDetail(code=code.value, message=message[:4096]))
