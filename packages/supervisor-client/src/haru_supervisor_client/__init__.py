"""Haru's supervisor client: typed, bounded calls to the supervisor API (DESIGN 6.4).

:class:`SupervisorClient` is the only code that calls supervisors: the control server drives
them with it, and so can a custom orchestrator built on haru-core, without installing the
supervisor itself. Every failure is one typed :class:`SupervisorCallError`.
"""

from haru_supervisor_client._bounds import (
    HEARTBEAT_TIMEOUT_S,
    MAX_RESPONSE_BYTES,
    MIN_CALL_TIMEOUT_S,
    PROBE_REPLY_MARGIN_S,
    probe_timeout_ms,
)
from haru_supervisor_client._client import SupervisorClient
from haru_supervisor_client._errors import (
    ConnectFailure,
    SupervisorBadResponseError,
    SupervisorCallError,
    SupervisorConnectError,
    SupervisorPlaintextError,
    SupervisorRejectedError,
    SupervisorStaleFenceError,
    SupervisorTimeoutError,
    SupervisorTlsError,
    SupervisorUnauthorizedError,
    SupervisorUnreachableError,
    connect_failure,
)
from haru_supervisor_client._trust import (
    IssuedTrust,
    SupervisorLinks,
    client_ssl_context,
    is_loopback_url,
    pin_key,
)

__all__ = (
    "HEARTBEAT_TIMEOUT_S",
    "MAX_RESPONSE_BYTES",
    "MIN_CALL_TIMEOUT_S",
    "PROBE_REPLY_MARGIN_S",
    "ConnectFailure",
    "IssuedTrust",
    "SupervisorBadResponseError",
    "SupervisorCallError",
    "SupervisorClient",
    "SupervisorConnectError",
    "SupervisorLinks",
    "SupervisorPlaintextError",
    "SupervisorRejectedError",
    "SupervisorStaleFenceError",
    "SupervisorTimeoutError",
    "SupervisorTlsError",
    "SupervisorUnauthorizedError",
    "SupervisorUnreachableError",
    "client_ssl_context",
    "connect_failure",
    "is_loopback_url",
    "pin_key",
    "probe_timeout_ms",
)
