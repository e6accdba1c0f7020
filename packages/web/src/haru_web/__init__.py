"""Haru's web layer, shared by the control server and the supervisor.

One error envelope and its middleware, one bearer check, bounded bodies parsed strictly into
pydantic models, a browser guard for token-less services, and a hardened way to listen:
bounds on slow clients, a connection cap, protocol errors answered in the envelope without
echoing the request, and SIGINT/SIGTERM handling. One logging setup (text or JSON lines, a
request id in every line about a request) and a per-app Prometheus ``/metrics`` route.
"""

from haru_web._bind import (
    HOST_VAR,
    OPEN_BIND_VAR,
    choose_bind_host,
    is_loopback_bind,
    normalize_bind_host,
)
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
from haru_web._logs import (
    LOG_FORMATS,
    LOG_LEVELS,
    AccessLogger,
    LogFormat,
    RequestIdFilter,
    TextFormatter,
    accept_request_id,
    access_logged_key,
    configure_logging,
    current_request_id,
    echo_request_id,
    install_request_ids,
    new_request_id,
    parse_log_format,
    parse_log_level,
    request_id_key,
    request_id_middleware,
    request_id_scope,
)
from haru_web._metrics import METRICS_PATH, BeforeScrape, add_metrics_route, metrics_guarded
from haru_web._middleware import (
    BEARER_CHALLENGE,
    CLIENT_CLOSED_STATUS,
    bearer_middleware,
    browser_guard_middleware,
    error_middleware,
    is_api_path,
    is_loopback_host,
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
    "HOST_VAR",
    "JSON_MEDIA_TYPE",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "METRICS_PATH",
    "MIN_TOKEN_LENGTH",
    "OPEN_BIND_VAR",
    "VALIDATION_ERRORS_SHOWN",
    "AccessLogger",
    "ApiError",
    "BeforeScrape",
    "HardenedAppRunner",
    "HardenedRequestHandler",
    "HaruWebError",
    "ListenError",
    "Listening",
    "LogFormat",
    "RateLimitedLog",
    "RequestIdFilter",
    "ServerLimits",
    "StopSignals",
    "TextFormatter",
    "TokenConfigError",
    "accept_request_id",
    "access_logged_key",
    "add_metrics_route",
    "bearer_middleware",
    "browser_guard_middleware",
    "check_token",
    "choose_bind_host",
    "configure_logging",
    "connection_cap",
    "current_request_id",
    "describe_protocol_error",
    "describe_validation_error",
    "echo_request_id",
    "error_middleware",
    "install_request_ids",
    "int_query",
    "is_api_path",
    "is_loopback_bind",
    "is_loopback_host",
    "json_error",
    "metrics_guarded",
    "new_request_id",
    "normalize_bind_host",
    "parse_body",
    "parse_log_format",
    "parse_log_level",
    "raw_error_bytes",
    "read_body",
    "render_api_error",
    "request_id_key",
    "request_id_middleware",
    "request_id_scope",
    "require_json",
    "resolve_token",
    "serving",
)
