"""The serving gateway's application: the credential, the routed paths, the streamed relay.

:func:`create_gateway_app` builds the aiohttp application that :mod:`haru_supervisor._gateway`
serves: ``/health`` (every model's server answers its own ``/health``), and
``/m/<model>/<inference path>`` forwarded to that model's vLLM server, the request body
streamed and capped, the answer streamed back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import unquote

import aiohttp
from aiohttp import hdrs, web
from haru_protocol import REQUEST_ID_HEADER, ErrorCode, bearer_matches
from haru_web import ApiError, bearer_middleware, error_middleware, json_error, relay_answer

logger = logging.getLogger("haru_supervisor.gateway")

DEFAULT_MAX_BODY_BYTES: Final = 33_554_432
"""Largest request body forwarded (the server proxy's ``HARU_CHAT_MAX_BODY_BYTES`` default)."""

INFERENCE_ROUTES: Final = {
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/embeddings": "POST",
    "/v1/models": "GET",
}
"""The only paths forwarded, with their method (vLLM's admin routes are never reachable)."""

_PREFIX = "/m/"
_HEALTH = "/health"
# uvicorn (vLLM's server) closes idle keep-alive connections after 5 s: let go first.
_UPSTREAM_KEEPALIVE_S = 4.0
_HEALTH_TIMEOUT_S = 5.0


class _BodyTooLargeError(Exception):
    """The client's streamed body went past the cap (the upstream request is aborted)."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """What one gateway serves.

    Attributes:
        routes: Each model's vLLM port on 127.0.0.1, by model name.
        token: The serving credential every forwarded request must present.
        max_body_bytes: Largest request body forwarded (413 past it).
        connect_timeout_s: Bound on connecting to a vLLM server (502 past it).
        header_timeout_s: Bound on a vLLM server's response headers (504 past it).
        idle_timeout_s: Longest silence of a vLLM server mid-answer (the client's connection
            is broken past it, never ended cleanly).
        upstream_host: Where the vLLM servers listen.
    """

    routes: Mapping[str, int]
    token: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    connect_timeout_s: float = 5.0
    header_timeout_s: float = 600.0
    idle_timeout_s: float = 600.0
    upstream_host: str = "127.0.0.1"
    upstreams: dict[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        host = f"[{self.upstream_host}]" if ":" in self.upstream_host else self.upstream_host
        object.__setattr__(
            self, "upstreams", {m: f"http://{host}:{p}" for m, p in self.routes.items()}
        )


def split_path(raw_path: str) -> tuple[str, str] | None:
    """``(model, inference path)`` of a raw request path, or None when it is not one.

    ``/m/<model><inference path>``: the inference path is one of :data:`INFERENCE_ROUTES`
    at the very end, so the model is everything between; it is percent-decoded as UTF-8
    (``qwen%2Fqwen3-8b`` and ``qwen/qwen3-8b`` are the same model). A query is ignored.
    """
    path = raw_path.partition("?")[0]
    if not path.startswith(_PREFIX):
        return None
    rest = path[len(_PREFIX) :]
    for suffix in INFERENCE_ROUTES:
        if rest.endswith(suffix) and len(rest) > len(suffix):
            try:
                model = unquote(rest[: -len(suffix)], errors="strict")
            except UnicodeDecodeError:
                return None
            return model, suffix
    return None


class Gateway:
    """The gateway's handlers and its upstream session."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the gateway's upstream session is not open")
        return self._session

    async def lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        config = self.config
        connector = aiohttp.TCPConnector(
            limit=0, keepalive_timeout=_UPSTREAM_KEEPALIVE_S, enable_cleanup_closed=True
        )
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=config.idle_timeout_s
        )
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, trust_env=False
        )
        try:
            yield
        finally:
            await self._session.close()
            self._session = None

    async def health(self, request: web.Request) -> web.StreamResponse:
        names = list(self.config.routes)
        answers = await asyncio.gather(*(self._healthy(name) for name in names))
        down = [name for name, ok in zip(names, answers, strict=True) if not ok]
        body: dict[str, object] = {"ok": not down}
        if bearer_matches_token(request, self.config.token):
            body["notHealthy"] = sorted(down)
        return web.json_response(body, status=503 if down else 200)

    async def _healthy(self, model: str) -> bool:
        url = f"{self.config.upstreams[model]}/health"
        try:
            async with asyncio.timeout(_HEALTH_TIMEOUT_S):
                async with self.session.get(url) as answer:
                    await answer.read()
                    return answer.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def forward(self, request: web.Request) -> web.StreamResponse:
        found = split_path(request.raw_path)
        if found is None:
            raise ApiError(ErrorCode.NOT_FOUND, "no such route")
        model, path = found
        if request.method != INFERENCE_ROUTES[path]:
            return json_error(
                ErrorCode.METHOD_NOT_ALLOWED,
                "method not allowed on this route",
                status=405,
                headers={hdrs.ALLOW: INFERENCE_ROUTES[path]},
            )
        base = self.config.upstreams.get(model)
        if base is None:
            # Authenticated already; still, the message names only what the caller sent.
            raise ApiError(ErrorCode.MODEL_NOT_FOUND, "no such model on this machine")
        limit = self.config.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise self._too_large()
        headers: dict[str, str] = {hdrs.ACCEPT_ENCODING: "identity"}
        for name in (hdrs.CONTENT_TYPE, hdrs.ACCEPT, REQUEST_ID_HEADER):
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        data: AsyncIterator[bytes] | None = None
        over = [False]
        if request.method == "POST":
            if length is not None:
                headers[hdrs.CONTENT_LENGTH] = str(length)
            data = _capped(request.content, limit, over)
        try:
            upstream = await self._open(request.method, base + path, headers, data)
        except Exception:
            # However the aborted upload surfaced (a payload or an OS error from the writer),
            # it was the body going past the cap.
            if over[0]:
                raise self._too_large() from None
            raise
        try:
            return await _relay(request, upstream)
        finally:
            if upstream.content.is_eof() and upstream.content.exception() is None:
                upstream.release()
            else:
                upstream.close()

    def _too_large(self) -> ApiError:
        return ApiError(
            ErrorCode.PAYLOAD_TOO_LARGE,
            f"the request body exceeds the gateway's cap ({self.config.max_body_bytes} bytes)",
        )

    async def _open(
        self, method: str, url: str, headers: dict[str, str], data: AsyncIterator[bytes] | None
    ) -> aiohttp.ClientResponse:
        try:
            async with asyncio.timeout(self.config.header_timeout_s):
                return await self.session.request(
                    method, url, data=data, headers=headers, allow_redirects=False
                )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
            raise ApiError(
                ErrorCode.UPSTREAM_UNREACHABLE, "the model server is unreachable"
            ) from None
        except TimeoutError:
            raise ApiError(
                ErrorCode.UPSTREAM_TIMEOUT,
                "the model server sent no response headers within "
                f"{self.config.header_timeout_s:g} s",
            ) from None
        except aiohttp.ClientError as exc:
            raise ApiError(
                ErrorCode.UPSTREAM_UNREACHABLE,
                f"the model server failed before answering ({type(exc).__name__})",
            ) from None


def bearer_matches_token(request: web.BaseRequest, token: str) -> bool:
    """Whether ``request`` presents the serving credential."""
    return bearer_matches(request.headers.get(hdrs.AUTHORIZATION), token)


async def _capped(
    content: aiohttp.StreamReader, limit: int, over: list[bool]
) -> AsyncIterator[bytes]:
    size = 0
    while chunk := await content.readany():
        size += len(chunk)
        if size > limit:
            over[0] = True
            raise _BodyTooLargeError
        yield chunk


async def _relay(request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
    headers: dict[str, str] = {}
    content_type = upstream.headers.get(hdrs.CONTENT_TYPE)
    if content_type is not None:
        headers[hdrs.CONTENT_TYPE] = content_type
    return await relay_answer(
        request,
        upstream,
        headers,
        on_broken=_broken,
        on_client_gone=functools.partial(_client_gone, request),
    )


def _broken(exc: aiohttp.ClientError) -> None:
    logger.warning("a model server broke mid-answer (%s)", type(exc).__name__)


def _client_gone(request: web.Request) -> None:
    logger.info("499 %s: client disconnected mid-answer", request.method)


def create_gateway_app(config: GatewayConfig) -> web.Application:
    """The gateway as an aiohttp app (serve it with :func:`haru_web.serving`)."""
    gateway = Gateway(config)
    app = web.Application(
        middlewares=[
            error_middleware,
            bearer_middleware(config.token, guarded=lambda path: path != _HEALTH),
        ],
        client_max_size=config.max_body_bytes,
    )
    app.cleanup_ctx.append(gateway.lifecycle)
    app.router.add_get(_HEALTH, gateway.health, allow_head=False)
    app.router.add_route("*", "/{tail:.*}", gateway.forward)
    return app
