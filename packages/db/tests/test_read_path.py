"""The cheap read path: one statement per read, no explicit transaction, one retry on a dropped
PostgreSQL connection, and still the last committed value."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from haru_db import StateStore, StateStoreUnavailableError
from haru_db._engine import create_engine, writer
from haru_protocol import FleetSnapshot
from sqlalchemy import event
from sqlalchemy.engine import make_url

READ_BOUND_S = 2.0
WriteStarted = Callable[[StateStore], AbstractContextManager[asyncio.Event]]
"""A read that waited for the writer would sit on the busy timeout (5 s) first."""


@contextmanager
def _statements(store: StateStore) -> Iterator[list[str]]:
    seen: list[str] = []
    target = store._ex.engine.sync_engine  # the store's own engine

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        words = statement.split()
        seen.append(" ".join(words[:2]) if words[0].upper() == "BEGIN" else words[0].upper())

    event.listen(target, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(target, "before_cursor_execute", record)


async def test_a_read_is_one_statement_and_no_transaction(
    store: StateStore, fleet: FleetSnapshot
) -> None:
    with _statements(store) as seen:
        pointer = await store.get_fleet_route_pointer("fleet")
        assert await store.get_fleet_snapshot("fleet") is not None
    assert pointer is not None
    assert pointer.route_revision == fleet.route_revision
    assert seen == ["SELECT", "SELECT"]


async def test_a_write_is_one_statement_in_autocommit(
    store: StateStore, fleet: FleetSnapshot, now: datetime
) -> None:
    autocommit: list[bool] = []
    target = store._ex.engine.sync_engine

    def note(conn: Any, *_args: Any) -> None:
        driver = conn.connection.driver_connection
        # psycopg: the autocommit attribute; aiosqlite: no transaction open around it.
        flag = getattr(driver, "autocommit", None)
        autocommit.append(bool(flag) if flag is not None else not driver.in_transaction)

    event.listen(target, "before_cursor_execute", note)
    try:
        with _statements(store) as seen:
            await store.append_event(fleet_id=fleet.id, type="x", payload={}, at=now)
            assert await store.mark_domains_seen([d.id for d in fleet.domains], at=now)
    finally:
        event.remove(target, "before_cursor_execute", note)
    assert seen == ["INSERT", "UPDATE"]
    assert autocommit == [True, True]


async def test_a_sqlite_write_waits_for_another_writers_lock(
    sqlite_store: StateStore, make_layout: Any, now: datetime, write_started: WriteStarted
) -> None:
    # Without BEGIN IMMEDIATE, the single statement takes the write lock as it starts and
    # waits on the busy timeout, as BEGIN IMMEDIATE did: it neither fails with SQLITE_BUSY nor
    # writes over the other transaction.
    await sqlite_store.apply_fleet_layout(make_layout(), at=now)
    pointer = await sqlite_store.get_fleet_route_pointer("fleet")
    assert pointer is not None
    path = make_url(sqlite_store.url).database
    assert path is not None
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("UPDATE fleets SET route_revision = route_revision + 1")
        with write_started(sqlite_store) as started:
            write = asyncio.ensure_future(
                sqlite_store.append_event(fleet_id=pointer.id, type="x", payload={}, at=now)
            )
            await asyncio.wait_for(started.wait(), timeout=READ_BOUND_S)
        # It began while the lock was held, so it can only end after the commit below.
        assert not write.done()
        other.execute("COMMIT")
    finally:
        other.close()
    assert await asyncio.wait_for(write, timeout=READ_BOUND_S) > 0
    after = await sqlite_store.get_fleet_route_pointer("fleet")
    assert after is not None
    assert after.route_revision == pointer.route_revision + 1


async def test_a_sqlite_read_beside_an_open_write_sees_the_last_commit(
    sqlite_store: StateStore, make_layout: Any, now: datetime
) -> None:
    await sqlite_store.apply_fleet_layout(make_layout(), at=now)
    before = await sqlite_store.get_fleet_route_pointer("fleet")
    assert before is not None
    path = make_url(sqlite_store.url).database
    assert path is not None
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("UPDATE fleets SET route_revision = route_revision + 1")
        # The write lock is held and the change is uncommitted: the read neither waits for it
        # nor sees it.
        during = await asyncio.wait_for(
            sqlite_store.get_fleet_route_pointer("fleet"), timeout=READ_BOUND_S
        )
        other.execute("COMMIT")
    finally:
        other.close()
    after = await sqlite_store.get_fleet_route_pointer("fleet")
    assert during == before
    assert after is not None
    assert after.route_revision == before.route_revision + 1


async def test_a_sqlite_read_inside_another_engines_write_transaction(
    sqlite_store: StateStore, make_layout: Any, now: datetime
) -> None:
    # Same as above through SQLAlchemy's own writer, and the read leaves the pool clean: the
    # next write on the store's engine still gets the lock.
    await sqlite_store.apply_fleet_layout(make_layout(), at=now)
    holder = create_engine(sqlite_store.url)
    try:
        async with writer(holder).begin() as conn:
            await conn.exec_driver_sql("UPDATE fleets SET display_name = 'uncommitted'")
            snapshot = await asyncio.wait_for(
                sqlite_store.get_fleet_snapshot("fleet"), timeout=READ_BOUND_S
            )
            assert snapshot is not None
            assert snapshot.display_name == "Test fleet"
    finally:
        await holder.dispose()
    event_id = await sqlite_store.append_event(
        fleet_id=snapshot.id, type="x", payload={}, at=now + timedelta(seconds=1)
    )
    assert event_id > 0


def _admin_url(url: str) -> str:
    admin = make_url(url).set(drivername="postgresql", database="postgres")
    return admin.render_as_string(hide_password=False)


async def _kill_store_connections(url: str) -> int:
    """Terminate every server backend on the store's database; wait until they are gone."""
    database = make_url(url).database
    async with await psycopg.AsyncConnection.connect(_admin_url(url), autocommit=True) as admin:
        # Pids first, then the kills: a single WHERE may evaluate pg_terminate_backend on rows
        # (this connection included) before the other conditions filter them out.
        cursor = await admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (database,),
        )
        pids = [row[0] for row in await cursor.fetchall()]
        for pid in pids:
            await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        for _ in range(500):
            cursor = await admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                " AND pid <> pg_backend_pid()",
                (database,),
            )
            left = await cursor.fetchone()
            if left is not None and left[0] == 0:
                break
            await asyncio.sleep(0.01)
    return len(pids)


async def _allow_connections(url: str, *, allowed: bool) -> None:
    database = make_url(url).database
    async with await psycopg.AsyncConnection.connect(_admin_url(url), autocommit=True) as admin:
        await admin.execute(
            f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS {str(allowed).lower()}'
        )


async def test_a_read_survives_a_killed_pooled_connection(
    postgres_store: StateStore,
    make_layout: Any,
    now: datetime,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await postgres_store.apply_fleet_layout(make_layout(), at=now)
    before = await postgres_store.get_fleet_route_pointer("fleet")
    assert before is not None
    assert await _kill_store_connections(postgres_store.url) >= 1

    with caplog.at_level(logging.INFO, logger="haru_db"):
        after = await postgres_store.get_fleet_route_pointer("fleet")
    assert after == before
    assert any("retrying the read once" in r.getMessage() for r in caplog.records)


async def test_a_write_survives_a_killed_pooled_connection(
    postgres_store: StateStore, make_layout: Any, now: datetime
) -> None:
    # Writes are never retried; they ping before their statement instead.
    await postgres_store.apply_fleet_layout(make_layout(), at=now)
    pointer = await postgres_store.get_fleet_route_pointer("fleet")
    assert pointer is not None
    assert await _kill_store_connections(postgres_store.url) >= 1
    event_id = await postgres_store.append_event(fleet_id=pointer.id, type="x", payload={}, at=now)
    assert event_id > 0


async def test_a_read_is_retried_once_then_reported_unavailable(
    postgres_store: StateStore, make_layout: Any, now: datetime
) -> None:
    await postgres_store.apply_fleet_layout(make_layout(), at=now)
    assert await postgres_store.get_fleet_route_pointer("fleet") is not None
    url = postgres_store.url
    await _allow_connections(url, allowed=False)
    try:
        assert await _kill_store_connections(url) >= 1
        # The pooled connection is dead and no new one can be made: the retry fails too,
        # and the failure is the store's error, not a driver's.
        with pytest.raises(StateStoreUnavailableError) as caught:
            await postgres_store.get_fleet_route_pointer("fleet")
        assert caught.value.__cause__ is not None
    finally:
        await _allow_connections(url, allowed=True)
    assert await postgres_store.get_fleet_route_pointer("fleet") is not None


async def test_an_unreachable_server_is_unavailable_on_the_read_path() -> None:
    store = StateStore.open("postgresql://haru:hunter2@127.0.0.1:1/haru")
    try:
        with pytest.raises(StateStoreUnavailableError) as caught:
            await store.get_fleet_route_pointer("fleet")
        assert "hunter2" not in str(caught.value)
    finally:
        await store.close()
