"""``haru-supervisor``: run the GPU-host agent until SIGTERM or SIGINT.

Shutdown (DESIGN 6.5): refuse new training starts, stop every run (SIGTERM now, SIGKILL after
the grace) and wait for it to end, then stop listening and exit. A second signal during the
grace SIGKILLs the trainers at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from haru_web import (
    ListenError,
    StopSignals,
    TlsConfigError,
    configure_logging,
    configure_startup_logging,
    is_loopback_bind,
    serving,
)

from haru_supervisor._app import create_app
from haru_supervisor._errors import SettingsError
from haru_supervisor._keys import runs_key
from haru_supervisor._settings import TOKEN_VAR, Settings, load_settings

logger = logging.getLogger("haru_supervisor")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_USAGE = (
    "usage: haru-supervisor [--version | --help]\n"
    "Configured by the environment: PORT (default 8701), HARU_HOST, HARU_ALLOW_OPEN_BIND,\n"
    "HARU_SUPERVISOR_TOKEN,\n"
    "HARU_SUPERVISOR_TOKEN_FILE (a file holding the token instead; re-read when it changes),\n"
    "HARU_SUPERVISOR_TOKEN_OVERLAP_MS (the previous token's grace after a change; 300000),\n"
    "HARU_SUPERVISOR_CONFIG (required: inline JSON or a file path),\n"
    "HARU_SUPERVISOR_GPU_SOURCE (auto|nvml|nvidia-smi), HARU_SUPERVISOR_SHUTDOWN_GRACE_MS,\n"
    "HARU_HTTP_HEADER_TIMEOUT_MS, HARU_HTTP_BODY_IDLE_TIMEOUT_MS, HARU_HTTP_KEEPALIVE_TIMEOUT_MS,\n"
    "HARU_HTTP_MAX_CONNECTIONS, HARU_HTTP_MAX_CONNECTIONS_PER_PEER, HARU_TRUSTED_PROXIES,\n"
    "HARU_METRICS_PUBLIC, HARU_LOG_FORMAT (text|json), HARU_LOG_LEVEL,\n"
    "HARU_TLS_CERT_FILE, HARU_TLS_KEY_FILE, HARU_TLS_CLIENT_CA_FILE (serve HTTPS; mutual TLS).\n"
)

# Handlers are short (sleep/wake are bounded at about 120 s, but they are not worth waiting
# for once the trainers are down and the supervisor is exiting).
_HTTP_SHUTDOWN_TIMEOUT_S = 5.0


async def serve(settings: Settings) -> int:
    """Serve until SIGTERM/SIGINT, then shut down as DESIGN 6.5 says; returns the exit status."""
    if settings.open_to_network:
        logger.warning(
            "!!! %s is not set and HARU_ALLOW_OPEN_BIND lets the supervisor listen on %s: its "
            "API is OPEN to anyone on the network (no authentication; browsers from other "
            "origins are still refused); set a token unless this is on purpose",
            TOKEN_VAR,
            settings.host,
        )
    elif settings.token is None:
        logger.warning(
            "%s is not set: the supervisor API is OPEN (no authentication) and listens on "
            "%s only (browsers are refused: foreign Origin and non-loopback Host get "
            "403); set a token to serve the control plane from another host",
            TOKEN_VAR,
            settings.host,
        )
    if settings.tls is None and not is_loopback_bind(settings.host):
        logger.warning(
            "serving plain HTTP on %s: the token and every call cross the network in clear "
            "text; set HARU_TLS_CERT_FILE and HARU_TLS_KEY_FILE unless this is a private network",
            settings.host,
        )
    app = create_app(settings)
    try:
        async with serving(
            app,
            host=settings.host,
            port=settings.port,
            limits=settings.http_limits,
            shutdown_timeout=_HTTP_SHUTDOWN_TIMEOUT_S,
            tls=settings.tls,
        ) as listening:
            logger.info(
                "haru-supervisor listening on %s://%s:%d%s",
                "http" if settings.tls is None else "https",
                listening.host,
                listening.port,
                ""
                if settings.tls is None or settings.tls.client_ca_file is None
                else " (client certificates required)",
            )
            with StopSignals() as signals:
                await signals.stop.wait()
                runs = app[runs_key]
                runs.refuse_starts()

                async def kill_on_second_signal() -> None:
                    await signals.force.wait()
                    logger.warning("killing the trainers now")
                    await runs.stop_all(0.0)

                killer = asyncio.create_task(kill_on_second_signal(), name="second-signal")
                try:
                    ended = await runs.shutdown(settings.shutdown_grace_s)
                finally:
                    killer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await killer
    except (ListenError, TlsConfigError) as exc:
        logger.error("%s", exc)  # noqa: TRY400  (the message says it all; no traceback)
        return EXIT_FAILED
    logger.info("haru-supervisor stopped")
    return EXIT_OK if ended else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: configure logging, read the environment, serve."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--version"]:
        sys.stdout.write(f"haru-supervisor {metadata.version('haru-supervisor')}\n")
        return EXIT_OK
    if args:
        help_asked = args in (["-h"], ["--help"])
        (sys.stdout if help_asked else sys.stderr).write(_USAGE)
        return EXIT_OK if help_asked else EXIT_USAGE
    try:
        settings = load_settings(os.environ)
    except SettingsError as exc:
        # Through the log formatter: one line (JSON in JSON mode) that a log collector parses.
        configure_startup_logging(os.environ)
        logger.critical("invalid environment: %s", exc)
        return EXIT_USAGE
    # Heartbeats poll /v1/status every few seconds: their access lines are DEBUG (haru-web).
    configure_logging(log_format=settings.log_format, level=settings.log_level, stream=sys.stderr)
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    raise SystemExit(main())
