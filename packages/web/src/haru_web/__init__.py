"""Haru's web layer, shared by the control server and the supervisor.

One error envelope and its middleware, one bearer check, bounded bodies parsed strictly into
pydantic models, a browser guard for token-less services, and a hardened way to listen:
bounds on slow clients, a connection cap, protocol errors answered in the envelope without
echoing the request, and SIGINT/SIGTERM handling.
"""

from haru_web._body import (
    JSON_MEDIA_TYPE,
    VALIDATION_ERRORS_SHOWN,
    describe_validation_error,
    int_query,
    parse_body,
    read_body,
    require_json,
)
from haru_web._envelope import json_error, raw_error_bytes, render_api_error
from haru_web._errors import ApiError, HaruWebError, ListenError
from haru_web._handler import HardenedRequestHandler, describe_protocol_error
from haru_web._limits import (
    DEFAULT_BODY_IDLE_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    RateLimitedLog,
    ServerLimits,
    connection_cap,
)
from haru_web._middleware import (
    BEARER_CHALLENGE,
    CLIENT_CLOSED_STATUS,
    bearer_middleware,
    browser_guard_middleware,
    error_middleware,
    is_api_path,
    is_loopback_host,
)
from haru_web._openapi import (
    OPENAPI_PATH,
    ApiRoute,
    ApiTable,
    Param,
    openapi_document,
    openapi_handler,
    registered_routes,
    render_openapi,
    route,
    undeclared_routes,
)
from haru_web._serve import HardenedAppRunner, Listening, StopSignals, serving
from haru_web._tokens import MIN_TOKEN_LENGTH, TokenConfigError, check_token, resolve_token

__all__ = (
    "BEARER_CHALLENGE",
    "CLIENT_CLOSED_STATUS",
    "DEFAULT_BODY_IDLE_TIMEOUT_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_KEEPALIVE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "JSON_MEDIA_TYPE",
    "MIN_TOKEN_LENGTH",
    "OPENAPI_PATH",
    "VALIDATION_ERRORS_SHOWN",
    "ApiError",
    "ApiRoute",
    "ApiTable",
    "HardenedAppRunner",
    "HardenedRequestHandler",
    "HaruWebError",
    "ListenError",
    "Listening",
    "Param",
    "RateLimitedLog",
    "ServerLimits",
    "StopSignals",
    "TokenConfigError",
    "bearer_middleware",
    "browser_guard_middleware",
    "check_token",
    "connection_cap",
    "describe_protocol_error",
    "describe_validation_error",
    "error_middleware",
    "int_query",
    "is_api_path",
    "is_loopback_host",
    "json_error",
    "openapi_document",
    "openapi_handler",
    "parse_body",
    "raw_error_bytes",
    "read_body",
    "registered_routes",
    "render_api_error",
    "render_openapi",
    "require_json",
    "resolve_token",
    "route",
    "serving",
    "undeclared_routes",
)
