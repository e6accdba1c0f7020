"""Async engines for both dialects, and the boundary that translates driver failures."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy.exc as sa_exc
from sqlalchemy import event
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from haru_db._errors import ConstraintViolationError, StateStoreUnavailableError
from haru_db._urls import dialect_of, redact_database_url, secrets_of

logger = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 5000
"""How long a SQLite statement waits for another writer's lock before failing."""

POSTGRES_CONNECT_TIMEOUT_S = 10
"""libpq connect timeout: an unreachable server fails fast instead of hanging a request."""

_WRITE_OPTION = "haru_write"


def create_engine(url: str, *, statement_timeout_ms: int | None = None) -> AsyncEngine:
    """An async engine for a resolved URL (see :func:`haru_db.resolve_database_url`).

    SQLite connections get ``foreign_keys=ON`` (SQLite leaves keys off by default), WAL (readers
    never block the writer), ``synchronous=NORMAL`` (durable enough under WAL, far fewer fsyncs)
    and a busy timeout; transactions begin DEFERRED, or IMMEDIATE on :func:`writer` engines.
    PostgreSQL connections use psycopg 3 with a pre-ping (a server restart or a scaled-to-zero
    Neon endpoint drops pooled connections) and, when given, a ``statement_timeout``.
    """
    if statement_timeout_ms is not None and statement_timeout_ms <= 0:
        raise ValueError("statement_timeout_ms must be positive")
    if dialect_of(url) == "sqlite":
        return _sqlite_engine(url, busy_timeout_ms=statement_timeout_ms or SQLITE_BUSY_TIMEOUT_MS)
    return _postgres_engine(url, statement_timeout_ms=statement_timeout_ms)


def writer(engine: AsyncEngine) -> AsyncEngine:
    """A view of ``engine`` (same pool) whose transactions are writes.

    On SQLite a write transaction starts with ``BEGIN IMMEDIATE``: it takes the write lock up
    front, so two writers queue on the busy timeout instead of failing with SQLITE_BUSY when a
    read lock cannot be upgraded. PostgreSQL ignores the option.
    """
    return engine.execution_options(**{_WRITE_OPTION: True})


def _sqlite_engine(url: str, *, busy_timeout_ms: int) -> AsyncEngine:
    engine = create_async_engine(url)
    directory = Path(str(make_url(url).database)).parent

    @event.listens_for(engine.sync_engine, "do_connect")
    def _check_directory(*_args: Any) -> None:
        # SQLite creates the file, never its directory. Fail here with a clear message rather
        # than inside aiosqlite, whose failed connect leaves a worker thread racing loop shutdown.
        if not directory.is_dir():
            raise sqlite3.OperationalError(
                f"unable to open database file: directory {str(directory)!r} does not exist"
            )

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" hook below emit BEGIN itself (the driver's implicit BEGIN
        # would always be DEFERRED).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            cursor.execute("PRAGMA foreign_keys = ON")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(connection: Connection) -> None:
        write = connection.get_execution_options().get(_WRITE_OPTION, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _postgres_engine(url: str, *, statement_timeout_ms: int | None) -> AsyncEngine:
    engine = create_async_engine(
        url,
        pool_pre_ping=True,
        connect_args={"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S, "application_name": "haru"},
    )
    if statement_timeout_ms is not None:
        # A SET on connect rather than a startup "options" parameter: connection poolers
        # (PgBouncer, Neon's pooled endpoints) reject startup options.
        timeout = int(statement_timeout_ms)

        @event.listens_for(engine.sync_engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(f"SET statement_timeout = {timeout}")
            finally:
                cursor.close()
            dbapi_connection.commit()

    return engine


@contextmanager
def translate_errors(url: str) -> Iterator[None]:
    """Re-raise driver failures as haru-db errors, with credentials scrubbed from the message.

    A constraint violation becomes :class:`ConstraintViolationError`; any other driver,
    connection or timeout failure becomes :class:`StateStoreUnavailableError`.
    """
    try:
        yield
    except (sa_exc.IntegrityError, sa_exc.DataError) as exc:
        raise ConstraintViolationError(
            f"write rejected by a schema constraint: {_describe(exc, url)}"
        ) from exc
    except (sa_exc.DBAPIError, sa_exc.TimeoutError, OSError, TimeoutError) as exc:
        logger.debug("state store failure on %s", redact_database_url(url), exc_info=True)
        raise StateStoreUnavailableError(
            f"state store {redact_database_url(url)} unavailable: {_describe(exc, url)}"
        ) from exc


def _describe(exc: BaseException, url: str) -> str:
    original = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    first_line = (str(original).strip().splitlines() or [""])[0]
    for secret in secrets_of(url):
        first_line = first_line.replace(secret, "***")
    name = type(original).__name__
    return f"{name}: {first_line}" if first_line else name
