"""Async engines for both dialects, and the boundary that translates driver failures."""

from __future__ import annotations

import logging
import math
import select
import sqlite3
import time
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
"""libpq connect timeout when no call deadline is given (migrations, CLI tools)."""

POSTGRES_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}
"""TCP keepalives: a peer that vanished (no FIN, no RST) is detected in about 11 s."""

WRITE_PING_IDLE_S = 1.0
"""A pooled PostgreSQL connection idle longer than this is pinged before a write uses it."""

_WRITE_OPTION = "haru_write"
_READ_OPTION = "haru_read"
_SINGLE_OPTION = "haru_single_write"
_CHECKED_IN_AT = "haru_checked_in_at"


def create_engine(
    url: str,
    *,
    statement_timeout_ms: int | None = None,
    call_timeout_s: float | None = None,
) -> AsyncEngine:
    """An async engine for a resolved URL (see :func:`haru_db.resolve_database_url`).

    SQLite connections get ``foreign_keys=ON`` (SQLite leaves keys off by default), WAL (readers
    never block the writer), ``synchronous=NORMAL`` (durable enough under WAL, far fewer fsyncs)
    and a busy timeout; transactions begin DEFERRED, or IMMEDIATE on :func:`writer` engines.
    PostgreSQL connections use psycopg 3 with TCP keepalives, a connect timeout (the call
    deadline rounded up, at least libpq's 2 s; else 10 s) and, when given (or when a call
    deadline is), a ``statement_timeout`` and ``idle_in_transaction_session_timeout``
    (default: the call deadline); every checkout except a :func:`reader`'s pings the
    connection first (a server restart or a scaled-to-zero Neon endpoint drops pooled
    connections).
    """
    if statement_timeout_ms is not None and statement_timeout_ms <= 0:
        raise ValueError("statement_timeout_ms must be positive")
    if call_timeout_s is not None and not call_timeout_s > 0:
        raise ValueError("call_timeout_s must be positive")
    if dialect_of(url) == "sqlite":
        return _sqlite_engine(url, busy_timeout_ms=statement_timeout_ms or SQLITE_BUSY_TIMEOUT_MS)
    if statement_timeout_ms is None and call_timeout_s is not None:
        statement_timeout_ms = math.ceil(call_timeout_s * 1000)
    connect_timeout_s = (
        POSTGRES_CONNECT_TIMEOUT_S if call_timeout_s is None else max(2, math.ceil(call_timeout_s))
    )
    return _postgres_engine(
        url, statement_timeout_ms=statement_timeout_ms, connect_timeout_s=connect_timeout_s
    )


def writer(engine: AsyncEngine) -> AsyncEngine:
    """A view of ``engine`` (same pool) whose transactions are writes.

    On SQLite a write transaction starts with ``BEGIN IMMEDIATE``: it takes the write lock up
    front, so two writers queue on the busy timeout instead of failing with SQLITE_BUSY when a
    read lock cannot be upgraded. PostgreSQL ignores the option.
    """
    return engine.execution_options(**{_WRITE_OPTION: True})


def statement_writer(engine: AsyncEngine) -> AsyncEngine:
    """A view of ``engine`` (same pool) for writes that are ONE statement, at one round trip.

    Every write of the store is a single statement (a compare-and-swap whose side effects ride
    in the same statement: CTEs on PostgreSQL, triggers on SQLite), and a single statement is
    its own transaction: atomic, and it commits when it completes. So no ``BEGIN``/``COMMIT``
    is sent around it: on PostgreSQL the connection is in ``AUTOCOMMIT``; on SQLite the
    connection stays in autocommit mode, where a writing statement takes the write lock as it
    starts (waiting on the busy timeout, exactly as ``BEGIN IMMEDIATE`` would). Never run
    several statements on one such connection expecting them to commit together: use
    :func:`writer` for that.
    """
    if engine.dialect.name == "postgresql":
        return engine.execution_options(**{_SINGLE_OPTION: True}, isolation_level="AUTOCOMMIT")
    return engine.execution_options(**{_SINGLE_OPTION: True})


def reader(engine: AsyncEngine) -> AsyncEngine:
    """A view of ``engine`` (same pool) for single-statement reads, at one round trip each.

    Every statement runs in its own implicit transaction, so a single SELECT still reads one
    consistent snapshot; never run several statements on one reader connection expecting a
    common view. On SQLite no ``BEGIN`` is emitted (the connections are in autocommit mode),
    and releasing the connection costs nothing (see :func:`_sqlite_engine`). On PostgreSQL the
    connection is in ``AUTOCOMMIT`` (no ``BEGIN``/``ROLLBACK`` round trips) and is not pinged
    at checkout: the caller retries a read ONCE when it fails with
    ``connection_invalidated`` (a dropped pooled connection), which is safe for a read and only
    for a read.
    """
    if engine.dialect.name == "postgresql":
        return engine.execution_options(**{_READ_OPTION: True}, isolation_level="AUTOCOMMIT")
    return engine.execution_options(**{_READ_OPTION: True})


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
        options = connection.get_execution_options()
        if options.get(_READ_OPTION, False) or options.get(_SINGLE_OPTION, False):
            # A lone statement in autocommit mode is its own transaction (a lone SELECT one
            # consistent read, a lone write one atomic commit); an explicit BEGIN would only
            # add round trips to aiosqlite's worker thread.
            return
        connection.exec_driver_sql("BEGIN IMMEDIATE" if options.get(_WRITE_OPTION) else "BEGIN")

    dialect = engine.sync_engine.dialect
    rollback = dialect.do_rollback

    def _rollback_if_open(dbapi_connection: Any) -> None:
        # sqlite3's rollback() is already a no-op outside a transaction (it checks the same
        # autocommit flag), but through aiosqlite even the no-op is a round trip to the worker
        # thread, paid by every read when SQLAlchemy releases its connection. Checking here,
        # on the loop's side, skips only calls that would have done nothing.
        if _sqlite_in_transaction(dbapi_connection):
            rollback(dbapi_connection)

    dialect.do_rollback = _rollback_if_open  # type: ignore[method-assign]
    return engine


def _sqlite_in_transaction(dbapi_connection: Any) -> bool:
    try:
        return bool(dbapi_connection.driver_connection.in_transaction)
    except (AttributeError, ValueError, sqlite3.Error):
        # Closed or not an aiosqlite connection: let the real rollback decide.
        return True


def _postgres_engine(
    url: str, *, statement_timeout_ms: int | None, connect_timeout_s: int
) -> AsyncEngine:
    # No pool-wide pre-ping: it would cost the per-request pointer read a second round trip.
    # Writers (and migrations, and anything else but a reader) ping on connect below; readers
    # retry once on a dropped connection instead (see reader()).
    engine = create_async_engine(
        url,
        connect_args={
            "connect_timeout": connect_timeout_s,
            "application_name": "haru",
            **POSTGRES_KEEPALIVES,
        },
    )

    @event.listens_for(engine.sync_engine.pool, "checkin")
    def _note_checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info[_CHECKED_IN_AT] = time.monotonic()

    @event.listens_for(engine.sync_engine, "engine_connect")
    def _ping_unless_reader(connection: Connection) -> None:
        # A write is a compare-and-swap: failing on a dead connection after the statement may
        # have been sent would leave its outcome unknown, so a connection is proven alive
        # before a write, as pool_pre_ping did: by a ping when it sat idle in the pool (where a
        # server restart or a scaled-to-zero endpoint drops it), or when its socket has
        # something to read (an idle PostgreSQL connection is sent nothing but the server's
        # goodbye: a terminated backend's FATAL, or the close itself). One returned moments
        # ago with a quiet socket (a promotion's writes follow each other within
        # milliseconds) is used as it is: pinging it would double the write's round trips. A
        # failed ping invalidates the connection (raising here would strand the checked-out
        # connection); the first statement then checks out a fresh one, and reports the
        # failure itself if the server is really gone.
        options = connection.get_execution_options()
        if options.get(_READ_OPTION, False):
            return
        fairy = connection.connection
        dbapi_connection = fairy.dbapi_connection
        if dbapi_connection is None:
            return
        checked_in = fairy.info.get(_CHECKED_IN_AT)
        if (
            options.get(_SINGLE_OPTION, False)
            and checked_in is not None
            and time.monotonic() - checked_in < WRITE_PING_IDLE_S
            and _quiet(fairy.driver_connection)
        ):
            return
        dialect = connection.dialect
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as exc:
            logger.info("pooled connection failed its ping before a write; reconnecting")
            connection.invalidate(exc)

    if statement_timeout_ms is not None:
        # A SET on connect rather than a startup "options" parameter: connection poolers
        # (PgBouncer, Neon's pooled endpoints) reject startup options. One round trip: a
        # session stuck inside a transaction (its client stalled) is ended by the server too.
        timeout = int(statement_timeout_ms)

        @event.listens_for(engine.sync_engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(
                    f"SET statement_timeout = {timeout}; "
                    f"SET idle_in_transaction_session_timeout = {timeout}"
                )
            finally:
                cursor.close()
            dbapi_connection.commit()

    return engine


def _quiet(driver_connection: Any) -> bool:
    """True when an idle psycopg connection is open and its socket has nothing to read."""
    # Imported here, where a PostgreSQL connection exists: a SQLite server never loads the
    # driver (about 8 MiB of its resident memory).
    import psycopg

    try:
        if driver_connection.closed:
            return False
        fd = driver_connection.pgconn.socket
        readable, _, _ = select.select([fd], [], [], 0)
    except (AttributeError, OSError, ValueError, psycopg.Error):
        return False
    return not readable


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
