"""Statement execution: one short transaction per write, one implicit one per read, bounded.

Every state-store call runs under a client-side deadline (:meth:`Executor.bounded`): when the
database stalls (a connection that neither answers nor closes), the caller gets
:class:`~haru_db.StateStoreUnavailableError` once the deadline passes instead of waiting on
TCP retransmission. On PostgreSQL the abandoned statement is cancelled in the background;
SQLAlchemy then invalidates its connection (a cancelled statement leaves it in an unknown
state), so the pool never hands it out again and recovers by reconnecting once the database
answers. On SQLite the abandoned call is left to finish on its own (see :meth:`Executor.bounded`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Coroutine, Mapping
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
import sqlalchemy.exc as sa_exc
from haru_core import Machine, assert_transition
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from haru_db._engine import reader, statement_writer, translate_errors
from haru_db._errors import StateStoreUnavailableError
from haru_db._rows import Row, malformed
from haru_db._urls import Dialect, dialect_of, redact_database_url

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

DEFAULT_CALL_TIMEOUT_S = 5.0
"""Client-side deadline of one state-store call (every :class:`~haru_db.StateStore` method)."""

_ABANDONED_GRACE_S = 1.0


class Executor:
    """Runs statements on one engine for the store's modules (never shared across loops)."""

    def __init__(self, engine: AsyncEngine, *, url: str, call_timeout_s: float) -> None:
        if not call_timeout_s > 0:
            raise ValueError("call_timeout_s must be positive")
        self.engine = engine
        self.url = url
        self.dialect: Dialect = dialect_of(url)
        self.call_timeout_s = call_timeout_s
        self._writer = statement_writer(engine)
        self._reader = reader(engine)
        self._abandoned: set[asyncio.Task[Any]] = set()

    async def bounded(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Await ``coro`` for at most :attr:`call_timeout_s` seconds.

        Raises:
            StateStoreUnavailableError: The deadline passed. A write's outcome is then unknown
                (it may have committed): callers re-read, as after any unavailable error.
        """
        task = asyncio.create_task(coro)
        try:
            done, _ = await asyncio.wait((task,), timeout=self.call_timeout_s)
        except asyncio.CancelledError:
            self._abandon(task)
            raise
        if done:
            return task.result()
        self._abandon(task)
        raise StateStoreUnavailableError(
            f"state store {redact_database_url(self.url)} unavailable: no answer within "
            f"{self.call_timeout_s:g} s"
        )

    def _abandon(self, task: asyncio.Task[Any]) -> None:
        """Let go of a call whose caller stopped waiting (deadline passed, or caller cancelled).

        PostgreSQL: the call is cancelled, without waiting for the cancellation to finish (on a
        stalled link the driver's own cleanup, a cancel request then a wait, can take longer
        than the deadline itself).

        SQLite: the call is NOT cancelled. Its statement runs in aiosqlite's worker thread,
        which a cancellation cannot stop: it only detaches the awaiting side. The statement
        then still runs once the other writer's lock is free, and a write with RETURNING stops
        at its first row until the rows are fetched, its transaction open: nothing would fetch
        them, so the write lock stayed held (every later write of the process waiting out the
        busy timeout) until garbage collection finalized the statement. Left alone, the call
        fetches its rows and returns its connection as soon as the statement ends: within the
        busy timeout, which bounds its wait for the lock.
        """
        if self.dialect != "sqlite":
            task.cancel()
        self._abandoned.add(task)
        task.add_done_callback(_forget(self._abandoned))

    async def close(self) -> None:
        """Let abandoned statements finish briefly, cancel what remains, close every connection."""
        if self._abandoned:
            _, pending = await asyncio.wait(tuple(self._abandoned), timeout=_ABANDONED_GRACE_S)
            for task in pending:
                task.cancel()
        await self.engine.dispose()

    async def write(
        self, stmt: sa.Executable, params: Mapping[str, Any] | None = None
    ) -> list[Row]:
        """Run one write statement as its own transaction; the rows it returned.

        The statement commits as it completes (:func:`~haru_db._engine.statement_writer`):
        one round trip, no ``BEGIN``/``COMMIT`` around it. ``params`` fills the statement's
        bind parameters (a statement built once and reused, see :mod:`haru_db._postgres`).
        """
        with translate_errors(self.url):
            async with self._writer.connect() as conn:
                result = await conn.execute(stmt, params)
                with malformed("stored row"):
                    return [dict(r) for r in result.mappings().all()] if result.returns_rows else []

    async def read(self, stmt: sa.Executable) -> list[Row]:
        """Run one read statement (its own implicit transaction, so one consistent view)."""
        # A read is retried once when the pooled connection turns out dead (SQLAlchemy then
        # invalidates the pool's older connections); a write is never retried.
        with translate_errors(self.url):
            try:
                return await self._read_once(stmt)
            except sa_exc.DBAPIError as exc:
                if not exc.connection_invalidated:
                    raise
                logger.info("state store connection dropped; retrying the read once")
            return await self._read_once(stmt)

    async def _read_once(self, stmt: sa.Executable) -> list[Row]:
        async with self._reader.connect() as conn:
            result = await conn.execute(stmt)
            with malformed("stored row"):
                return [dict(r) for r in result.mappings().all()]

    def insert(self, table: sa.Table) -> postgresql.Insert | sqlite.Insert:
        """The dialect's INSERT (both support ``ON CONFLICT DO NOTHING``)."""
        if self.dialect == "postgresql":
            return postgresql.insert(table)
        return sqlite.insert(table)


def _forget(tasks: set[asyncio.Task[Any]]) -> Any:
    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("abandoned state store call ended with %r", task.exception())

    return done


def aware(at: datetime) -> datetime:
    """``at`` itself, refused when naive (every state time is the caller's aware clock)."""
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError(f"timestamps must be timezone-aware: {at!r}")
    return at


def checked_froms(machine: Machine, from_states: Collection[str], to: str) -> list[str]:
    """The sorted from-states, each checked against haru-core's table for ``machine``."""
    froms = sorted({str(s) for s in from_states})
    for state in froms:
        assert_transition(machine, state, str(to))
    return froms
