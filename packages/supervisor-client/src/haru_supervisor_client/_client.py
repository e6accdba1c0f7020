"""The client that drives supervisors: typed, bounded calls to the supervisor API (DESIGN 6.4).

The control server uses it, and so can a custom orchestrator built on haru-core: importing this
module needs only haru-protocol, aiohttp and pydantic, never the supervisor's own server side
(its web application, settings or trainers).

Every call has an explicit time bound (the caller passes what remains of its budget), presents
the bearer token, never follows a redirect (the token must not travel to another host) and maps
every failure onto one typed :class:`SupervisorCallError`: a malformed answer is a supervisor
failure like any other, never an unexpected exception.

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

The state-changing calls (sleep, wake, training start and stop) take the fencing token of the
operation step they are made for (:class:`~haru_protocol.SupervisorFence`, sent as
``X-Haru-Fence``); None sends none (an operator's call, accepted and logged).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
import json
import logging
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal, TypeVar
from urllib.parse import urlsplit

import aiohttp
from haru_protocol import (
    FENCE_HEADER,
    REQUEST_ID_HEADER,
    ErrorCode,
    GpuMemoryResponse,
    OkResponse,
    PeerModel,
    ProbeRequest,
    ProbeResponse,
    SleepRequest,
    SupervisorFence,
    SupervisorStatus,
    TrainingStopRequest,
    UrlJoinError,
    WakeRequest,
    WireModel,
    bearer_header,
    join_url,
)
from pydantic import ValidationError

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


logger = logging.getLogger(__name__)

_M = TypeVar("_M", bound=PeerModel)

MAX_RESPONSE_BYTES = 1024 * 1024
"""A supervisor answer larger than this is a bad response (it is never that large)."""

MIN_CALL_TIMEOUT_S = 0.001
"""A call is never given a zero or negative bound (aiohttp would read it as "no bound")."""

HEARTBEAT_TIMEOUT_S = 5.0
"""Bound of one heartbeat poll (DESIGN 7.3: about 5 s)."""

PROBE_REPLY_MARGIN_S = 2.0
"""Time the supervisor keeps, inside the HTTP bound of a probe call, to report its verdicts.

The supervisor bounds each model's completion by :func:`probe_timeout_ms` of the call's bound,
so a model that is too slow comes back as a failed result naming it, not as a call timeout."""


def probe_timeout_ms(call_timeout_s: float) -> int:
    """Per-model probe bound sent to the supervisor for a probe call bounded by ``call_timeout_s``.

    The HTTP bound minus :data:`PROBE_REPLY_MARGIN_S`; for a bound under twice that margin,
    half the bound. Never less than 1 ms.
    """
    margin = min(PROBE_REPLY_MARGIN_S, call_timeout_s / 2)
    return max(1, int((call_timeout_s - margin) * 1000))


def client_ssl_context(
    ca_file: Path | None = None,
    *,
    cert_file: Path | None = None,
    key_file: Path | None = None,
) -> ssl.SSLContext:
    """A verifying client context: TLS 1.2 or newer, the peer's certificate and name checked.

    Args:
        ca_file: PEM bundle of the CAs to trust; None = the system trust store.
        cert_file: Client certificate for mutual TLS (with ``key_file``).
        key_file: Its private key.

    Raises:
        OSError: A file cannot be read.
        ssl.SSLError: A file is not usable PEM, or the key does not match.
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context


def pin_key(url: str) -> str:
    """The key of a URL's endpoint in :attr:`SupervisorLinks.pins`: ``host:port``.

    Lower case, the default port written out, IPv6 in brackets.
    """
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _no_pins() -> Mapping[str, bytes]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class IssuedTrust:
    """How one supervisor whose certificate the server issued is verified.

    Attributes:
        ssl: A verifying context that trusts only the issuing CA.
        server_name: The DNS name its certificate must carry (sent as SNI and checked in
            place of the URL's host, which is an address the certificate cannot name).
    """

    ssl: ssl.SSLContext
    server_name: str


def _no_issued() -> Mapping[str, IssuedTrust]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SupervisorLinks:
    """How supervisors on other hosts are reached.

    Attributes:
        ssl: The verifying context of ``https://`` calls (:func:`client_ssl_context`; it may
            carry a client certificate); None = the system trust store.
        pins: SHA-256 digests of the leaf certificate (DER) by :func:`pin_key` of the
            supervisor URL. A pinned endpoint is trusted by that digest only, not by a CA
            (and presents no client certificate).
        allow_plaintext: Allow ``http://`` to a host other than loopback (a private network);
            otherwise such a call is refused before anything is sent.
        issued: :class:`IssuedTrust` by :func:`pin_key` of the supervisor URL, for
            supervisors whose certificate the server issued (``skypilot`` domains); it may be
            a live mapping the server fills as domains get addresses. It wins over ``pins``.
    """

    ssl: ssl.SSLContext | None = None
    pins: Mapping[str, bytes] = field(default_factory=_no_pins)
    allow_plaintext: bool = False
    issued: Mapping[str, IssuedTrust] = field(default_factory=_no_issued)


# Pure, and asked once per supervisor call (each heartbeat).
@functools.lru_cache(maxsize=4096)
def is_loopback_url(url: str) -> bool:
    """The URL's host is ``localhost`` or a loopback address (the link stays on this host)."""
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


_NO_SESSION_TIMEOUT = aiohttp.ClientTimeout(total=None)
# Every call is bounded by asyncio.timeout instead (one bound covering connect, headers and body).


class SupervisorClient:
    """Typed calls to the supervisor API over one shared :class:`aiohttp.ClientSession`.

    Args:
        session: The application's client session (the client never closes it).
        token: Bearer token presented to every supervisor (the server's
            ``HARU_SUPERVISOR_TOKEN``); ``None`` presents none. A callable is asked at every
            call (a token file that is rotated: ``haru_web.TokenSource.current``).
        request_id: Returns the id of the work a call is made for (sent as ``X-Request-Id``,
            so the supervisor's log lines carry it too); None sends none.
        links: TLS trust, pins and the plain-HTTP policy; the default trusts the system store
            and refuses ``http://`` beyond loopback.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        token: str | Callable[[], str | None] | None,
        request_id: Callable[[], str | None] | None = None,
        links: SupervisorLinks | None = None,
    ) -> None:
        self._session = session
        self._token = token
        self._request_id = request_id
        self._links = links if links is not None else SupervisorLinks()

    async def status(self, base_url: str, *, timeout_s: float) -> SupervisorStatus:
        """``GET /v1/status``: sleep state of every model and state of every training run."""
        return await self._call("GET", base_url, "/v1/status", SupervisorStatus, timeout_s)

    async def gpu_memory(self, base_url: str, *, timeout_s: float) -> GpuMemoryResponse:
        """``GET /v1/gpu/memory``: used and total memory of every GPU."""
        return await self._call("GET", base_url, "/v1/gpu/memory", GpuMemoryResponse, timeout_s)

    async def gpu_processes(self, base_url: str, *, timeout_s: float) -> GpuMemoryResponse:
        """``GET /v1/gpu/processes``: memory and the compute processes holding each GPU."""
        return await self._call("GET", base_url, "/v1/gpu/processes", GpuMemoryResponse, timeout_s)

    async def wake(
        self, base_url: str, *, timeout_s: float, fence: SupervisorFence | None = None
    ) -> None:
        """``POST /v1/vllm/wake`` for every inference slot."""
        await self._call(
            "POST",
            base_url,
            "/v1/vllm/wake",
            OkResponse,
            timeout_s,
            body=WakeRequest(),
            fence=fence,
        )

    async def sleep(
        self,
        base_url: str,
        *,
        timeout_s: float,
        drain_timeout_ms: int | None = None,
        fence: SupervisorFence | None = None,
    ) -> None:
        """``POST /v1/vllm/sleep`` for every inference slot, draining first when asked."""
        body = SleepRequest(drain_timeout_ms=drain_timeout_ms)
        await self._call(
            "POST", base_url, "/v1/vllm/sleep", OkResponse, timeout_s, body=body, fence=fence
        )

    async def start_training(
        self, base_url: str, *, timeout_s: float, fence: SupervisorFence | None = None
    ) -> None:
        """``POST /v1/training/start`` (idempotent on the supervisor)."""
        await self._request("POST", base_url, "/v1/training/start", timeout_s, fence=fence)

    async def stop_training(
        self,
        base_url: str,
        *,
        timeout_s: float,
        grace_ms: int,
        fence: SupervisorFence | None = None,
    ) -> None:
        """``POST /v1/training/stop``: SIGTERM now, SIGKILL after ``grace_ms``."""
        body = TrainingStopRequest(grace_ms=grace_ms)
        await self._request(
            "POST", base_url, "/v1/training/stop", timeout_s, body=body, fence=fence
        )

    async def probe(
        self, base_url: str, *, timeout_s: float, prompt: str, max_tokens: int
    ) -> ProbeResponse:
        """``POST /v1/probe``: one small chat completion per configured model.

        ``timeout_s`` bounds the whole call; each model's completion is bounded by
        :func:`probe_timeout_ms` of it, comfortably inside, so a slow model is reported as a
        failed result (``ok`` false, ``error`` set) rather than lost in a call timeout.
        """
        body = ProbeRequest(
            prompt=prompt, max_tokens=max_tokens, timeout_ms=probe_timeout_ms(timeout_s)
        )
        return await self._call("POST", base_url, "/v1/probe", ProbeResponse, timeout_s, body=body)

    async def _call(
        self,
        method: str,
        base_url: str,
        path: str,
        model: type[_M],
        timeout_s: float,
        *,
        body: WireModel | None = None,
        fence: SupervisorFence | None = None,
    ) -> _M:
        url, raw = await self._request(method, base_url, path, timeout_s, body=body, fence=fence)
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise SupervisorBadResponseError(
                f"{method} {url}: malformed {model.__name__} ({exc.error_count()} error(s): "
                f"{_first_error(exc)})",
                url=url,
            ) from exc

    async def _request(
        self,
        method: str,
        base_url: str,
        path: str,
        timeout_s: float,
        *,
        body: WireModel | None = None,
        fence: SupervisorFence | None = None,
    ) -> tuple[str, bytes]:
        try:
            url = join_url(base_url, path)
        except UrlJoinError as exc:
            raise SupervisorUnreachableError(
                f"supervisor URL {base_url!r} is unusable: {exc}", url=base_url
            ) from exc
        tls, server_name = self._tls_for(method, url)
        data = None if body is None else body.model_dump_json(exclude_none=True).encode()
        token = self._token
        headers = bearer_header(token() if callable(token) else token)
        request_id = None if self._request_id is None else self._request_id()
        if request_id is not None:
            headers[REQUEST_ID_HEADER] = request_id
        if data is not None:
            headers["Content-Type"] = "application/json"
        if fence is not None:
            headers[FENCE_HEADER] = fence.header_value()
        bound = max(timeout_s, MIN_CALL_TIMEOUT_S)
        try:
            async with (
                asyncio.timeout(bound),
                self._session.request(
                    method,
                    url,
                    data=data,
                    headers=headers,
                    allow_redirects=False,
                    timeout=_NO_SESSION_TIMEOUT,
                    ssl=tls,
                    server_hostname=server_name,
                ) as response,
            ):
                raw = await _read_bounded(response, url)
                status = response.status
        except TimeoutError as exc:
            raise SupervisorTimeoutError(
                f"{method} {url}: no answer within {bound:.3f} s", url=url
            ) from exc
        except (aiohttp.ServerFingerprintMismatch, aiohttp.ClientSSLError) as exc:
            raise SupervisorTlsError(f"{method} {url}: {_tls_reason(exc)}", url=url) from exc
        except aiohttp.ClientError as exc:
            # TLS 1.3 checks a client certificate after the client's side of the handshake:
            # a refusal reaches the client as a closed connection.
            hint = (
                " (over TLS this is also how a supervisor that requires a client certificate "
                "refuses one it does not accept: see HARU_SUPERVISOR_CLIENT_CERT_FILE)"
                if isinstance(exc, aiohttp.ServerDisconnectedError) and url.startswith("https:")
                else ""
            )
            failure = connect_failure(exc)
            if failure is not None:
                raise SupervisorConnectError(
                    f"{method} {url}: {type(exc).__name__}: {exc}", url=url, reason=failure
                ) from exc
            raise SupervisorUnreachableError(
                f"{method} {url}: {type(exc).__name__}: {exc}{hint}", url=url
            ) from exc
        except OSError as exc:
            failure = connect_failure(exc)
            if failure is not None:
                raise SupervisorConnectError(
                    f"{method} {url}: {exc}", url=url, reason=failure
                ) from exc
            raise SupervisorUnreachableError(f"{method} {url}: {exc}", url=url) from exc
        if status in (401, 403):
            raise SupervisorUnauthorizedError(
                f"{method} {url}: supervisor refused the server's token ({status})",
                url=url,
                status=status,
            )
        if not 200 <= status < 300:
            code, message = _error_envelope(raw)
            detail = f": {code}: {message}" if code is not None else ""
            if status == 409 and code == ErrorCode.STALE_FENCE.value:
                raise SupervisorStaleFenceError(
                    f"{method} {url}: HTTP {status}{detail}", url=url, status=status, code=code
                )
            raise SupervisorRejectedError(
                f"{method} {url}: HTTP {status}{detail}", url=url, status=status, code=code
            )
        return url, raw

    def _tls_for(
        self, method: str, url: str
    ) -> tuple[ssl.SSLContext | aiohttp.Fingerprint | bool, str | None]:
        """The ``ssl`` and ``server_hostname`` arguments of a call to ``url``.

        Refuses clear text beyond loopback.
        """
        scheme = urlsplit(url).scheme
        if scheme == "http":
            if not self._links.allow_plaintext and not is_loopback_url(url):
                raise SupervisorPlaintextError(
                    f"{method} {url}: refused: plain HTTP to another host would carry the token "
                    "in clear text; serve the supervisor over TLS (https://) or allow plain "
                    "HTTP on a private network (the server's HARU_ALLOW_PLAINTEXT=1)",
                    url=url,
                )
            return True, None
        key = pin_key(url)
        issued = self._links.issued.get(key)
        if issued is not None:
            return issued.ssl, issued.server_name
        pin = self._links.pins.get(key)
        if pin is not None:
            return aiohttp.Fingerprint(pin), None
        return (self._links.ssl if self._links.ssl is not None else True), None


async def _read_bounded(response: aiohttp.ClientResponse, url: str) -> bytes:
    length = response.content_length
    if length is not None and length > MAX_RESPONSE_BYTES:
        raise SupervisorBadResponseError(
            f"{url}: answer of {length} bytes exceeds {MAX_RESPONSE_BYTES}", url=url
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise SupervisorBadResponseError(
                f"{url}: answer exceeds {MAX_RESPONSE_BYTES} bytes", url=url
            )
        chunks.append(chunk)
    return b"".join(chunks)


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


def _first_error(exc: ValidationError) -> str:
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = ".".join(str(part) for part in first["loc"]) or "<root>"
    return f"{loc}: {first['msg']}"
