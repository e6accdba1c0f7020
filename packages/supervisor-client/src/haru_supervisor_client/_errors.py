"""The typed failures of a supervisor call, and which failure each way a call fails is.

A call maps every failure onto one typed :class:`SupervisorCallError` (a failed link:
:func:`link_failure`; a non-2xx answer: :func:`status_failure`): a malformed answer is a
supervisor failure like any other, never an unexpected exception.

Hierarchy::

    SupervisorCallError              one call to a supervisor failed (.url)
    ├── SupervisorUnauthorizedError  401/403: the token is missing or wrong (.status)
    ├── SupervisorUnreachableError   connect failure, reset, refused, unusable URL
    │   ├── SupervisorConnectError   the TCP connect was refused or had no route (.reason):
    │   │                            nothing listens there, or the host is gone
    │   ├── SupervisorTlsError       the supervisor's certificate failed verification (expired,
    │   │                            another CA, another name, not the pinned one) or the
    │   │                            handshake failed
    │   └── SupervisorPlaintextError plain http:// to another host, not allowed
    ├── SupervisorTimeoutError       no complete answer within the call's bound
    ├── SupervisorRejectedError      another non-2xx answer, e.g. 502 from a failed sleep
    │   │                            (.status, .code)
    │   └── SupervisorStaleFenceError  409 stale_fence: the call's fencing token is older than
    │                                one the supervisor has seen (the caller lost its step)
    └── SupervisorBadResponseError   2xx, but not the documented body
"""

from __future__ import annotations

import errno
import json
from typing import Literal

import aiohttp
from haru_protocol import ErrorCode
from pydantic import ValidationError


class SupervisorCallError(Exception):
    """One call to a supervisor failed.

    Attributes:
        url: The URL that was called (never carries a credential).
    """

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class SupervisorUnauthorizedError(SupervisorCallError):
    """The supervisor answered 401 or 403: the caller's token is missing or wrong."""

    def __init__(self, message: str, *, url: str, status: int) -> None:
        super().__init__(message, url=url)
        self.status = status


class SupervisorUnreachableError(SupervisorCallError):
    """The supervisor could not be reached (refused, reset, DNS, TLS, unusable URL)."""


ConnectFailure = Literal["refused", "no_route"]
"""Why a TCP connect failed in a way only a missing listener or host explains."""

_NO_ROUTE_ERRNOS = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN})


def connect_failure(exc: BaseException) -> ConnectFailure | None:
    """``refused`` or ``no_route`` when ``exc`` is that kind of failed TCP connect, else None.

    Refused: the host answered the connect with a reset (``ECONNREFUSED``). No route: the
    kernel or a router said the host or its network cannot be reached (``EHOSTUNREACH``,
    ``ENETUNREACH``, ``EHOSTDOWN``). A timeout, a name that does not resolve, a TLS failure
    or a reset after connecting is none of these: the host may be there.
    """
    if isinstance(exc, aiohttp.ClientConnectorError):
        code = exc.os_error.errno
    elif isinstance(exc, OSError) and not isinstance(exc, TimeoutError):
        code = exc.errno
    else:
        return None
    if code == errno.ECONNREFUSED:
        return "refused"
    if code in _NO_ROUTE_ERRNOS:
        return "no_route"
    return None


class SupervisorConnectError(SupervisorUnreachableError):
    """The TCP connect to the supervisor was refused or had no route (nothing was sent).

    Attributes:
        reason: ``refused`` or ``no_route`` (:func:`connect_failure`).
    """

    def __init__(self, message: str, *, url: str, reason: ConnectFailure) -> None:
        super().__init__(message, url=url)
        self.reason: ConnectFailure = reason


class SupervisorTlsError(SupervisorUnreachableError):
    """TLS with the supervisor failed; never retried in clear text.

    Its certificate is expired, from another CA, for another name or not the pinned one, or
    the handshake was refused (e.g. no client certificate).
    """


class SupervisorPlaintextError(SupervisorUnreachableError):
    """Plain ``http://`` to another host, which :class:`SupervisorLinks` does not allow.

    The token would cross the network in clear text; nothing was sent.
    """


class SupervisorTimeoutError(SupervisorCallError):
    """The supervisor did not answer within the call's bound."""


class SupervisorRejectedError(SupervisorCallError):
    """The supervisor answered a non-2xx status other than 401/403.

    Attributes:
        status: The HTTP status.
        code: The envelope's error code, when the body carried one.
    """

    def __init__(self, message: str, *, url: str, status: int, code: str | None) -> None:
        super().__init__(message, url=url)
        self.status = status
        self.code = code


class SupervisorStaleFenceError(SupervisorRejectedError):
    """409 ``stale_fence``: the supervisor has seen a newer fencing token for the fleet.

    Another server process wrote the operation since this caller read its token: the caller
    lost the step, and retrying with the same token can never succeed.
    """


class SupervisorBadResponseError(SupervisorCallError):
    """The supervisor answered 2xx with a body that is not the documented one."""


def link_failure(method: str, url: str, exc: aiohttp.ClientError | OSError) -> SupervisorCallError:
    """The typed failure of a call whose link failed before a complete answer came back."""
    if isinstance(exc, (aiohttp.ServerFingerprintMismatch, aiohttp.ClientSSLError)):
        return SupervisorTlsError(f"{method} {url}: {_tls_reason(exc)}", url=url)
    failure = connect_failure(exc)
    if not isinstance(exc, aiohttp.ClientError):
        if failure is not None:
            return SupervisorConnectError(f"{method} {url}: {exc}", url=url, reason=failure)
        return SupervisorUnreachableError(f"{method} {url}: {exc}", url=url)
    if failure is not None:
        return SupervisorConnectError(
            f"{method} {url}: {type(exc).__name__}: {exc}", url=url, reason=failure
        )
    # TLS 1.3 checks a client certificate after the client's side of the handshake: a refusal
    # reaches the client as a closed connection.
    hint = (
        " (over TLS this is also how a supervisor that requires a client certificate "
        "refuses one it does not accept: see HARU_SUPERVISOR_CLIENT_CERT_FILE)"
        if isinstance(exc, aiohttp.ServerDisconnectedError) and url.startswith("https:")
        else ""
    )
    return SupervisorUnreachableError(f"{method} {url}: {type(exc).__name__}: {exc}{hint}", url=url)


def status_failure(method: str, url: str, status: int, raw: bytes) -> SupervisorCallError | None:
    """The typed failure a supervisor's answer status means (None: 2xx, a success)."""
    if status in (401, 403):
        return SupervisorUnauthorizedError(
            f"{method} {url}: supervisor refused the server's token ({status})",
            url=url,
            status=status,
        )
    if 200 <= status < 300:
        return None
    code, message = _error_envelope(raw)
    detail = f": {code}: {message}" if code is not None else ""
    if status == 409 and code == ErrorCode.STALE_FENCE.value:
        return SupervisorStaleFenceError(
            f"{method} {url}: HTTP {status}{detail}", url=url, status=status, code=code
        )
    return SupervisorRejectedError(
        f"{method} {url}: HTTP {status}{detail}", url=url, status=status, code=code
    )


def _tls_reason(exc: aiohttp.ClientError) -> str:
    if isinstance(exc, aiohttp.ServerFingerprintMismatch):
        return (
            f"the certificate's SHA-256 fingerprint {exc.got.hex()} is not the pinned "
            f"{exc.expected.hex()}"
        )
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        cert_error = exc.certificate_error
        reason = getattr(cert_error, "verify_message", None) or str(cert_error)
        return f"certificate verification failed: {reason}"
    return f"TLS handshake failed: {exc}"


def _error_envelope(raw: bytes) -> tuple[str | None, str]:
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None, ""
    if not isinstance(parsed, dict):
        return None, ""
    error = parsed.get("error")
    if not isinstance(error, dict):
        return None, ""
    code = error.get("code")
    message = error.get("message")
    return (
        code if isinstance(code, str) else None,
        message[:512] if isinstance(message, str) else "",
    )


def first_error(exc: ValidationError) -> str:
    """The first validation error of a malformed answer: where, and what is wrong."""
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = ".".join(str(part) for part in first["loc"]) or "<root>"
    return f"{loc}: {first['msg']}"
