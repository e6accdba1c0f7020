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

This module is the command line (arguments, credential, TLS, the listener's bounds); the
application it serves is :mod:`haru_supervisor._gateway_app`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from haru_protocol import normalize_token
from haru_web import (
    TLS_CERT_FILE_VAR,
    TLS_CLIENT_CA_FILE_VAR,
    TLS_KEY_FILE_VAR,
    ListenError,
    ServerLimits,
    StopSignals,
    TlsConfigError,
    TlsFiles,
    configure_logging,
    is_loopback_bind,
    serving,
    tls_files,
)

from haru_supervisor._gateway_app import DEFAULT_MAX_BODY_BYTES, GatewayConfig, create_gateway_app

logger = logging.getLogger("haru_supervisor.gateway")

SERVING_TOKEN_VAR: Final = "HARU_SERVING_TOKEN"  # noqa: S105 -- a variable name, not a value
"""Where the gateway reads the serving credential unless ``--token-env``/``--token-file``."""

DEFAULT_GATEWAY_MAX_CONNECTIONS: Final = 4096
"""Client connections the gateway keeps open. Nearly all come from one peer (the Haru
server's proxy), so the per-peer bound is the same number."""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_SHUTDOWN_TIMEOUT_S = 5.0
# Open files kept out of the streams' budget (listening socket, logs, health checks).
_FD_RESERVE = 64


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
