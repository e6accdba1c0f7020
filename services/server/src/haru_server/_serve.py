"""Booting the server process: announce, migrate, listen, and stop cleanly on a signal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

from aiohttp import web
from haru_db import redact_database_url, resolve_database_url, upgrade

from haru_server._access_log import AccessLog
from haru_server._app import create_app
from haru_server._settings import Settings

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0
"""How long open requests (streams included) may finish after a stop signal."""


def describe_database(settings: Settings) -> str:
    """The database the server will use, credentials redacted, for the boot log."""
    resolved = resolve_database_url(settings.database_url)
    if settings.database_url is None:
        return f"embedded SQLite default {redact_database_url(resolved)} (DATABASE_URL unset)"
    return redact_database_url(resolved)


def announce(settings: Settings) -> None:
    """Log what the operator must know at boot (loudly where it matters)."""
    logger.info("state store: %s", describe_database(settings))
    if settings.api_token is None:
        logger.warning(
            "!!! HARU_API_TOKEN is unset: the API is OPEN to anyone who can connect, so the "
            "server listens on 127.0.0.1 only. Set HARU_API_TOKEN to listen on all interfaces."
        )
    if settings.supervisor_token is None:
        logger.warning("HARU_SUPERVISOR_TOKEN is unset: supervisors are called without a token")


async def migrate(settings: Settings) -> None:
    """Apply the state store's migrations (refused when the schema is newer than this code).

    Raises:
        haru_db.SchemaTooNewError: The database was migrated by a newer Haru.
    """
    await upgrade(settings.database_url)


async def run_server(
    settings: Settings,
    *,
    on_listening: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    reuse_port: bool = False,
) -> None:
    """Migrate, build the app and serve until SIGINT/SIGTERM (or ``stop`` is set).

    Args:
        settings: The parsed environment.
        on_listening: Called with the base URL once the socket is bound.
        stop: Set it to stop the server (signals do the same).
        reuse_port: Bind with SO_REUSEPORT (one of ``HARU_WORKERS`` processes on one port).
    """
    announce(settings)
    await migrate(settings)
    app = create_app(settings)
    runner = web.AppRunner(
        app,
        handle_signals=False,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        access_log_class=AccessLog,
    )
    await runner.setup()
    stopping = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stopping.set)
            installed.append(signum)
    try:
        site = web.TCPSite(runner, settings.host, settings.port, reuse_port=reuse_port or None)
        await site.start()
        url = _bound_url(site, settings)
        logger.info("haru-server listening on %s:%d (%s)", settings.host, site.port, url)
        if on_listening is not None:
            on_listening(url)
        await stopping.wait()
        logger.info("stopping")
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
        await runner.cleanup()


def _bound_url(site: web.TCPSite, settings: Settings) -> str:
    host = "127.0.0.1" if settings.host == "0.0.0.0" else settings.host
    return f"http://{host}:{site.port}"
