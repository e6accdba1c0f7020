"""The client that drives supervisors: typed, bounded calls to the supervisor API (DESIGN 6.4).

The control server uses it, and so can a custom orchestrator built on haru-core: importing this
module needs only haru-protocol, aiohttp and pydantic, never the supervisor's own server side
(its web application, settings or trainers).

Every call has an explicit time bound (the caller passes what remains of its budget), presents
the bearer token, never follows a redirect (the token must not travel to another host) and maps
every failure onto one typed :class:`SupervisorCallError` (:mod:`haru_supervisor_client._errors`):
a malformed answer is a supervisor failure like any other, never an unexpected exception.

The state-changing calls (sleep, wake, training start and stop) take the fencing token of the
operation step they are made for (:class:`~haru_protocol.SupervisorFence`, sent as
``X-Haru-Fence``); None sends none (an operator's call, accepted and logged).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

import aiohttp
from haru_protocol import (
    FENCE_HEADER,
    REQUEST_ID_HEADER,
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

from haru_supervisor_client._bounds import MIN_CALL_TIMEOUT_S, probe_timeout_ms, read_bounded
from haru_supervisor_client._errors import (
    SupervisorBadResponseError,
    SupervisorPlaintextError,
    SupervisorTimeoutError,
    SupervisorUnreachableError,
    first_error,
    link_failure,
    status_failure,
)
from haru_supervisor_client._trust import SupervisorLinks, is_loopback_url, pin_key

_M = TypeVar("_M", bound=PeerModel)

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
                f"{first_error(exc)})",
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
                raw = await read_bounded(response, url)
                status = response.status
        except TimeoutError as exc:
            raise SupervisorTimeoutError(
                f"{method} {url}: no answer within {bound:.3f} s", url=url
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise link_failure(method, url, exc) from exc
        failure = status_failure(method, url, status, raw)
        if failure is not None:
            raise failure
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
