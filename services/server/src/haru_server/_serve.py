"""Booting the server process: announce, migrate, listen, and stop cleanly on a signal."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable

from aiohttp import web
from haru_db import (
    check_writable,
    redact_database_url,
    resolve_database_url,
    sqlite_file,
    upgrade,
)
from haru_web import StopSignals, TlsConfigError, is_loopback_bind, server_context, serving

from haru_server._app import create_app
from haru_server._keys import draining_key
from haru_server._metrics import metrics_key
from haru_server._settings import Settings, SettingsError

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
    if settings.open_to_network:
        logger.warning(
            "!!! HARU_API_TOKEN is unset and HARU_ALLOW_OPEN_BIND lets the server listen on %s: "
            "the API is OPEN to anyone on the network (no authentication; browsers from "
            "other origins are still refused). Set HARU_API_TOKEN unless this is on purpose.",
            settings.host,
        )
    elif settings.api_token is None:
        logger.warning(
            "!!! HARU_API_TOKEN is unset: the API is OPEN to anyone who can connect, so the "
            "server listens on %s only (browsers are refused: foreign Origin and "
            "non-loopback Host get 403). Set HARU_API_TOKEN to listen on all interfaces.",
            settings.host,
        )
    if settings.supervisor_token is None:
        logger.warning("HARU_SUPERVISOR_TOKEN is unset: supervisors are called without a token")
    if settings.tls is None and not is_loopback_bind(settings.host):
        logger.warning(
            "serving plain HTTP on %s: API tokens, prompts and completions cross the network in "
            "clear text; set HARU_TLS_CERT_FILE and HARU_TLS_KEY_FILE unless a TLS-terminating "
            "proxy or a private network carries them",
            settings.host,
        )


def check_tls(settings: Settings) -> None:
    """Load the TLS files and the store key once, before anything starts.

    Raises:
        SettingsError: A certificate, key, CA or store key file does not load (named).
    """
    if settings.tls is not None:
        try:
            server_context(settings.tls)
        except TlsConfigError as exc:
            raise SettingsError(str(exc)) from None
    settings.supervisor_links()
    settings.serving_ssl()
    settings.store_key()


def check_database(settings: Settings) -> None:
    """Refuse a ``DATABASE_URL`` that cannot hold the store, or that names a missing SQLite file.

    A missing file is created (by the migration) only for the embedded default (no
    ``DATABASE_URL``) or with ``HARU_CREATE_DATABASE``: a typo in the path would otherwise start
    a new, empty store beside the real one. Nothing is created here.

    Raises:
        SettingsError: The URL is unusable, or the SQLite file it names does not exist.
    """
    try:
        database = sqlite_file(settings.database_url)
    except ValueError as exc:  # an in-memory database, another scheme, a malformed URL
        raise SettingsError(f"DATABASE_URL: {exc}") from None
    if settings.database_url is None or settings.create_database or database is None:
        return
    if not database.exists():
        raise SettingsError(
            f"DATABASE_URL names the SQLite file {database}, which does not exist: create the "
            "store with `haru db upgrade`, or let the server create it with "
            "HARU_CREATE_DATABASE=1 (`haru serve --create-db`)"
        )


async def migrate(settings: Settings) -> None:
    """Apply the state store's migrations (refused when the schema is newer than this code).

    Raises:
        SettingsError: See :func:`check_database` (checked first; nothing is created).
        haru_db.SchemaTooNewError: The database was migrated by a newer Haru.
        haru_db.StateStoreReadOnlyError: The database would refuse writes (refuse to start).
    """
    check_database(settings)
    await upgrade(settings.database_url)
    await check_writable(settings.database_url)


async def drain(app: web.Application, seconds: float, *, force: asyncio.Event) -> None:
    """Fail ``/readyz`` and keep serving for ``seconds`` (a second signal cuts it short).

    Load balancers and Kubernetes stop routing new connections to a server whose readiness
    fails; only then does the listener close, so a rolling update refuses nobody.
    """
    app[draining_key].set()
    logger.info("draining: /readyz fails; the listener closes in %.1f s", seconds)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await force.wait()


def freeze_startup_heap() -> None:
    """Move everything start-up made into the collector's permanent generation.

    The long-lived heap (imported modules, pydantic and SQLAlchemy metadata, the OpenAPI
    document, the app) is never garbage, but every full collection walked all of it: with
    each request allocating container objects, those walks were the proxy's tail latency.
    Frozen objects are never scanned again. Each ``HARU_WORKERS`` process runs this after its
    own start-up (after the fork), so nothing is shared between the two.
    """
    gc.collect()
    gc.freeze()
    logger.debug("garbage collector: %d start-up objects frozen", gc.get_freeze_count())


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

    Raises:
        haru_web.ListenError: The port could not be bound.
        SettingsError: A TLS file does not load, or ``DATABASE_URL`` names a missing SQLite
            file without ``HARU_CREATE_DATABASE`` (see :func:`check_database`).
    """
    check_tls(settings)
    check_database(settings)
    announce(settings)
    await migrate(settings)
    app = create_app(settings)
    metrics = app[metrics_key]
    with StopSignals(stop) as signals, metrics.watching_gc(), metrics.refreshing():
        async with serving(
            app,
            host=settings.host,
            port=settings.port,
            limits=settings.http_limits,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
            reuse_port=reuse_port,
            tls=settings.tls,
        ) as listening:
            freeze_startup_heap()
            logger.info(
                "haru-server listening on %s:%d (%s)",
                listening.host,
                listening.port,
                listening.url,
            )
            if on_listening is not None:
                on_listening(listening.url)
            await signals.stop.wait()
            if settings.shutdown_drain_ms > 0:
                await drain(app, settings.shutdown_drain_ms / 1000, force=signals.force)
            logger.info("stopping")
