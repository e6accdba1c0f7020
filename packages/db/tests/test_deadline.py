"""A stalled database fails state-store calls within the store's deadline, and the pool recovers.

PostgreSQL runs behind a real TCP forwarder on 127.0.0.1 that can stall (keep every socket
open and stop forwarding) and resume; SQLite is stalled by another process holding its write
lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from datetime import datetime
from uuid import uuid4

import pytest
from haru_db import DEFAULT_CALL_TIMEOUT_S, StateStore, StateStoreUnavailableError
from haru_db.testing import DatabaseUrlFactory
from sqlalchemy.engine import make_url

DEADLINE_S = 0.5


class StallingForwarder:
    """Forwards 127.0.0.1:<port> to a target; :meth:`stall` holds every byte, never closing."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        self.resume()
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        self._writers += [writer, upstream_writer]
        for task in (
            asyncio.create_task(self._pipe(reader, upstream_writer)),
            asyncio.create_task(self._pipe(upstream_reader, writer)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            writer.close()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_a_deadline_that_is_not_positive_is_refused(bad: float) -> None:
    # Zero, negative or NaN would turn every call into an instant failure (or none at all).
    with pytest.raises(ValueError, match="positive"):
        StateStore.open(None, call_timeout_s=bad)
    assert DEFAULT_CALL_TIMEOUT_S > 0


async def test_a_stalled_postgres_fails_calls_within_the_deadline_then_recovers(
    postgres_url_factory: DatabaseUrlFactory, now: datetime
) -> None:
    url = make_url(await postgres_url_factory())
    assert url.host is not None
    forwarder = StallingForwarder(url.host, url.port or 5432)
    await forwarder.start()
    via = url.set(host="127.0.0.1", port=forwarder.port).render_as_string(hide_password=False)
    store = StateStore.open(via, call_timeout_s=DEADLINE_S)
    try:
        # Pooled connections exist: the stall hits them mid-conversation, as in production.
        assert await store.list_fleets() == []
        assert not await store.mark_domain_seen(uuid4(), at=now)

        forwarder.stall()
        with pytest.raises(StateStoreUnavailableError, match=r"no answer within 0\.5 s"):
            await store.list_fleets()
        with pytest.raises(StateStoreUnavailableError, match=r"no answer within 0\.5 s"):
            await store.mark_domain_seen(uuid4(), at=now)
        with pytest.raises(StateStoreUnavailableError, match=r"no answer within 0\.5 s"):
            await store.ping()

        forwarder.resume()
        # The connections that timed out were invalidated; new ones serve reads and writes.
        assert await store.list_fleets() == []
        assert not await store.mark_domain_seen(uuid4(), at=now)
        await store.ping()
    finally:
        await store.close()
        await forwarder.close()


async def test_a_stalled_sqlite_writer_fails_writes_within_the_deadline_then_recovers(
    sqlite_url_factory: DatabaseUrlFactory, now: datetime
) -> None:
    url = await sqlite_url_factory()
    # A busy timeout far above the deadline: only the deadline can end the wait.
    store = StateStore.open(url, statement_timeout_ms=60_000, call_timeout_s=DEADLINE_S)
    holder = sqlite3.connect(str(make_url(url).database), isolation_level=None)
    try:
        assert not await store.mark_domain_seen(uuid4(), at=now)
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(StateStoreUnavailableError, match=r"no answer within 0\.5 s"):
            await store.mark_domain_seen(uuid4(), at=now)
        holder.execute("ROLLBACK")
        assert not await store.mark_domain_seen(uuid4(), at=now)
    finally:
        holder.close()
        await store.close()
