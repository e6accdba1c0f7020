"""``haru-gateway``: the serving gateway of a provisioned domain's machine.

The only public route to the machine's vLLM servers (which listen on 127.0.0.1). It runs on
the hardened ``haru_web`` listener (header, body and idle bounds, a connection cap, protocol
errors such as ``Content-Length`` with ``Transfer-Encoding`` answered 400 and the connection
closed) and:

- requires the serving credential (``Authorization: Bearer``) on every route but
  ``/health``; it is neither the supervisor token nor a client API key: the Haru server
  presents it, and it never reaches vLLM;
- forwards ``/m/<model>/<inference path>`` for the four inference paths only
  (``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
  ``GET /v1/models``) to that model's server; ``<model>`` is everything between ``/m/`` and
  the inference path, percent-decoded (UTF-8), so ``qwen/qwen3-8b``, spaces and non-ASCII
  names route whether or not their slash is encoded;
- streams the request body to vLLM as it arrives (``Content-Length`` framing kept, chunked
  uploads re-framed) and cuts it one byte past ``--max-body-bytes`` (413 when nothing was
  answered yet), and streams the answer back chunk by chunk;
- answers ``GET /health`` 200 ``{"ok": true}`` once every model's server answers its own
  ``/health``, 503 ``{"ok": false}`` before: no model names unless the caller presents the
  credential (a SkyServe readiness probe sends none).

TLS: ``HARU_TLS_CERT_FILE`` / ``HARU_TLS_KEY_FILE`` (and ``HARU_TLS_CLIENT_CA_FILE`` for
mutual TLS), the same variables and loader as the supervisor's, re-read when they change.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final
from urllib.parse import unquote

import aiohttp
from aiohttp import hdrs, web
from haru_protocol import REQUEST_ID_HEADER, ErrorCode, bearer_matches, normalize_token
from haru_web import (
    TLS_CERT_FILE_VAR,
    TLS_CLIENT_CA_FILE_VAR,
    TLS_KEY_FILE_VAR,
    ApiError,
    ListenError,
    ServerLimits,
    StopSignals,
    TlsConfigError,
    TlsFiles,
    bearer_middleware,
    configure_logging,
    error_middleware,
    is_loopback_bind,
    json_error,
    serving,
    tls_files,
)

logger = logging.getLogger("haru_supervisor.gateway")

SERVING_TOKEN_VAR: Final = "HARU_SERVING_TOKEN"  # noqa: S105 -- a variable name, not a value
"""Where the gateway reads the serving credential unless ``--token-env``/``--token-file``."""

DEFAULT_MAX_BODY_BYTES: Final = 33_554_432
"""Largest request body forwarded (the server proxy's ``HARU_CHAT_MAX_BODY_BYTES`` default)."""

DEFAULT_GATEWAY_MAX_CONNECTIONS: Final = 4096
"""Client connections the gateway keeps open. Nearly all come from one peer (the Haru
server's proxy), so the per-peer bound is the same number."""

INFERENCE_ROUTES: Final = {
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/embeddings": "POST",
    "/v1/models": "GET",
}
"""The only paths forwarded, with their method (vLLM's admin routes are never reachable)."""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_PREFIX = "/m/"
_HEALTH = "/health"
# uvicorn (vLLM's server) closes idle keep-alive connections after 5 s: let go first.
_UPSTREAM_KEEPALIVE_S = 4.0
_HEALTH_TIMEOUT_S = 5.0
_SHUTDOWN_TIMEOUT_S = 5.0
# Open files kept out of the streams' budget (listening socket, logs, health checks).
_FD_RESERVE = 64


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
    content = upstream.content
    if content.is_eof() and content.exception() is None:
        return web.Response(status=upstream.status, body=content.read_nowait(), headers=headers)
    response = web.StreamResponse(status=upstream.status, headers=headers)
    length = upstream.content_length
    if length is not None and hdrs.CONTENT_ENCODING not in upstream.headers:
        response.content_length = length
    try:
        await response.prepare(request)
        while True:
            try:
                chunk = await content.readany()
            except aiohttp.ClientError as exc:
                # Never a clean end of a truncated answer: break the client's connection.
                logger.warning("a model server broke mid-answer (%s)", type(exc).__name__)
                transport = request.transport
                if transport is not None:
                    transport.close()
                return response
            if not chunk:
                break
            await response.write(chunk)
        await response.write_eof()
    except ConnectionError:
        logger.info("499 %s: client disconnected mid-answer", request.method)
    return response


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


def _route(text: str) -> tuple[str, int]:
    name, sep, port = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not MODEL=PORT")
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {port!r} is not a port") from None
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: {number} is not a TCP port")
    return name, number


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="haru-gateway",
        description="Serve a machine's vLLM servers' inference routes behind a credential.",
        epilog=(
            f"TLS: {TLS_CERT_FILE_VAR}, {TLS_KEY_FILE_VAR} (and {TLS_CLIENT_CA_FILE_VAR} for "
            "client certificates) from the environment, re-read when they change."
        ),
    )
    parser.add_argument("--host", default="0.0.0.0", help="interface (default 0.0.0.0)")
    parser.add_argument("--listen", type=int, required=True, help="port (0: any free one)")
    parser.add_argument(
        "--route",
        type=_route,
        action="append",
        default=[],
        metavar="MODEL=PORT",
        help="a model and its vLLM server's port on 127.0.0.1 (repeat per model)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--token-env",
        default=SERVING_TOKEN_VAR,
        metavar="VAR",
        help=f"variable holding the serving credential (default {SERVING_TOKEN_VAR})",
    )
    source.add_argument("--token-file", type=Path, help="file holding the serving credential")
    parser.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument(
        "--max-connections", type=_positive_int, default=DEFAULT_GATEWAY_MAX_CONNECTIONS
    )
    parser.add_argument("--header-timeout-s", type=_positive, default=10.0)
    parser.add_argument("--body-idle-timeout-s", type=_positive, default=30.0)
    parser.add_argument("--keepalive-timeout-s", type=_positive, default=75.0)
    parser.add_argument("--upstream-header-timeout-s", type=_positive, default=600.0)
    parser.add_argument("--upstream-idle-timeout-s", type=_positive, default=600.0)
    return parser


def _token(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    if args.token_file is not None:
        try:
            raw: str | None = args.token_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the serving credential file: {exc}") from None
        where = "--token-file"
    else:
        raw = environ.get(args.token_env)
        where = args.token_env
    token = normalize_token(raw)
    if token is None:
        raise ValueError(f"the serving credential ({where}) is unset or blank")
    return token


async def serve(
    config: GatewayConfig, *, host: str, port: int, limits: ServerLimits, tls: TlsFiles | None
) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status."""
    if tls is None and not is_loopback_bind(host):
        logger.warning(
            "serving plain HTTP on %s: the serving credential, prompts and completions cross "
            "the network in clear text; set %s and %s unless this is a private network",
            host,
            TLS_CERT_FILE_VAR,
            TLS_KEY_FILE_VAR,
        )
    app = create_gateway_app(config)
    try:
        async with serving(
            app,
            host=host,
            port=port,
            limits=limits,
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
            tls=tls,
        ) as listening:
            logger.info(
                "haru-gateway listening on %s (%d models)", listening.url, len(config.routes)
            )
            with StopSignals() as signals:
                await signals.stop.wait()
    except (ListenError, TlsConfigError) as exc:
        logger.error("%s", exc)  # noqa: TRY400  (the message says it all)
        return EXIT_FAILED
    logger.info("haru-gateway stopped")
    return EXIT_OK


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def stream_budget(wanted: int) -> int:
    """How many client connections fit the open-file limit, raising its soft value first.

    Every proxied stream holds two files (the client's connection and vLLM's), so ``wanted``
    connections need about twice as many plus a reserve; the soft limit is raised toward that
    (never past the hard one) and the answer lowered to what fits.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * wanted + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the open-file limit to %d: %s", target, exc)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return wanted
    fits = max(1, (soft - _FD_RESERVE) // 2)
    if fits < wanted:
        logger.warning(
            "--max-connections lowered from %d to %d: the open-file limit is %d and every "
            "stream holds two files",
            wanted,
            fits,
            soft,
        )
    return min(wanted, fits)


def _configure(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[GatewayConfig, ServerLimits, TlsFiles | None]:
    """The gateway's configuration from its arguments and environment.

    Raises:
        ValueError: The credential is missing, or a model is routed twice.
        TlsConfigError: Only one of the TLS files is set.
    """
    token = _token(args, environ)
    routes = dict(args.route)
    if len(routes) != len(args.route):
        raise ValueError("a model is routed twice")
    tls = tls_files(
        *(
            Path(value) if (value := environ.get(var, "").strip()) else None
            for var in (TLS_CERT_FILE_VAR, TLS_KEY_FILE_VAR, TLS_CLIENT_CA_FILE_VAR)
        )
    )
    connections = stream_budget(args.max_connections)
    limits = ServerLimits(
        header_timeout_s=args.header_timeout_s,
        body_idle_timeout_s=args.body_idle_timeout_s,
        keepalive_timeout_s=args.keepalive_timeout_s,
        max_connections=connections,
        max_connections_per_peer=connections,
    )
    config = GatewayConfig(
        routes=routes,
        token=token,
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.upstream_header_timeout_s,
        idle_timeout_s=args.upstream_idle_timeout_s,
    )
    return config, limits, tls


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Console entry point (``haru-gateway``)."""
    env = os.environ if environ is None else environ
    configure_logging(level=logging.INFO, stream=sys.stderr)
    args = _parser().parse_args(argv)
    try:
        config, limits, tls = _configure(args, env)
    except (ValueError, TlsConfigError) as exc:
        logger.critical("invalid configuration: %s", exc)
        return EXIT_USAGE
    return asyncio.run(serve(config, host=args.host, port=args.listen, limits=limits, tls=tls))


if __name__ == "__main__":
    raise SystemExit(main())
