"""Engines, connection settings and the error boundary."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime
from pathlib import Path
from uuid import uuid4

import pytest
from haru_db import (
    ConstraintViolationError,
    StateStore,
    StateStoreUnavailableError,
    current_revision,
    head_revision,
    upgrade,
)
from haru_db._engine import create_engine, writer
from haru_db.testing import DatabaseUrlFactory
from haru_protocol import DomainState

WriteStarted = Callable[[StateStore], AbstractContextManager[asyncio.Event]]


async def test_open_describes_the_store(store: StateStore) -> None:
    assert store.dialect in ("sqlite", "postgresql")
    assert store.url.startswith(
        "sqlite+aiosqlite:///" if store.dialect == "sqlite" else "postgresql+psycopg://"
    )
    assert store.display_url.split("://")[0] == store.url.split("://")[0]
    await store.ping()


async def test_the_embedded_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    await upgrade(None)
    assert (tmp_path / "haru.db").is_file()
    assert await current_revision(None) == head_revision()
    store = StateStore.open(None)
    try:
        assert store.dialect == "sqlite"
        assert store.url == f"sqlite+aiosqlite:///{tmp_path / 'haru.db'}"
        assert await store.list_fleets() == []
    finally:
        await store.close()


async def test_an_unreachable_postgres_is_unavailable_without_credentials(now: datetime) -> None:
    store = StateStore.open("postgresql://haru:hunter2@127.0.0.1:1/haru")
    try:
        for call in (
            store.ping(),
            store.get_fleet_snapshot("fleet"),
            store.transition_domain(
                uuid4(), from_states=[DomainState.READY], to=DomainState.DEGRADED, at=now
            ),
        ):
            with pytest.raises(StateStoreUnavailableError) as caught:
                await call
            assert "hunter2" not in str(caught.value)
            assert "127.0.0.1:1" in str(caught.value)
            assert caught.value.__cause__ is not None
    finally:
        await store.close()


async def test_an_unopenable_sqlite_file_is_unavailable(tmp_path: Path) -> None:
    store = StateStore.open(str(tmp_path / "missing-dir" / "haru.db"))
    try:
        with pytest.raises(StateStoreUnavailableError, match="missing-dir' does not exist"):
            await store.ping()
    finally:
        await store.close()


async def test_a_missing_schema_is_unavailable(tmp_path: Path) -> None:
    store = StateStore.open(str(tmp_path / "empty.db"))
    try:
        with pytest.raises(StateStoreUnavailableError, match="no such table"):
            await store.list_fleets()
    finally:
        await store.close()


async def test_sqlite_connection_settings(sqlite_url_factory: DatabaseUrlFactory) -> None:
    url = await sqlite_url_factory()
    for timeout, expected_busy in ((None, 5000), (1234, 1234)):
        engine = create_engine(url, statement_timeout_ms=timeout)
        try:
            async with engine.connect() as conn:
                values = [
                    (await conn.exec_driver_sql(f"PRAGMA {name}")).scalar_one()
                    for name in ("foreign_keys", "journal_mode", "busy_timeout", "synchronous")
                ]
        finally:
            await engine.dispose()
        assert values == [1, "wal", expected_busy, 1]


async def test_postgres_statement_timeout(postgres_url_factory: DatabaseUrlFactory) -> None:
    engine = create_engine(await postgres_url_factory(), statement_timeout_ms=1234)
    try:
        async with engine.connect() as conn:
            assert (await conn.exec_driver_sql("SHOW statement_timeout")).scalar_one() == "1234ms"
    finally:
        await engine.dispose()


def test_a_non_positive_timeout_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        StateStore.open(str(tmp_path / "x.db"), statement_timeout_ms=0)


async def test_sqlite_writers_queue_instead_of_failing(
    sqlite_url_factory: DatabaseUrlFactory, now: datetime, write_started: WriteStarted
) -> None:
    # A write transaction holds the lock; another engine's write that starts meanwhile waits
    # for it (BEGIN IMMEDIATE + busy timeout) instead of failing with SQLITE_BUSY. That it
    # needs the lock at all: test_a_lock_held_past_the_busy_timeout_is_unavailable.
    url = await sqlite_url_factory()
    holder = create_engine(url)
    store = StateStore.open(url)
    try:
        async with writer(holder).begin() as conn:
            await conn.exec_driver_sql("UPDATE alembic_version SET version_num = version_num")
            # WAL readers never wait for the writer.
            await asyncio.wait_for(store.list_fleets(), timeout=5)
            with write_started(store) as started:
                write = asyncio.ensure_future(
                    store.append_event(fleet_id=uuid4(), type="x", payload={}, at=now)
                )
                await asyncio.wait_for(started.wait(), timeout=5)
            assert not write.done(), "the second writer waits for the lock"
        with pytest.raises(ConstraintViolationError):
            await write  # it ran once the lock was free (and hit the unknown fleet)
    finally:
        await store.close()
        await holder.dispose()


async def test_a_lock_held_past_the_busy_timeout_is_unavailable(
    sqlite_url_factory: DatabaseUrlFactory, now: datetime
) -> None:
    url = await sqlite_url_factory()
    holder = create_engine(url)
    store = StateStore.open(url, statement_timeout_ms=50)
    try:
        async with writer(holder).begin() as conn:
            await conn.exec_driver_sql("UPDATE alembic_version SET version_num = version_num")
            with pytest.raises(StateStoreUnavailableError, match="locked"):
                await store.append_event(fleet_id=uuid4(), type="x", payload={}, at=now)
    finally:
        await store.close()
        await holder.dispose()
