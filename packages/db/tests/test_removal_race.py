"""A removal and an operation's insert serialize on the domain row on PostgreSQL (0012).

Each side is held open in its own transaction while the other is shown (in
``pg_stat_activity``) to wait for it; then the first commits and the second loses. SQLite runs
one writer at a time, so the interleaving cannot happen there (its guards are in the writes).
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any
from uuid import UUID, uuid4

import psycopg
from haru_db import StateStore
from haru_protocol import FleetLayout
from sqlalchemy.engine import make_url


def _dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def _blocked(monitor: psycopg.AsyncConnection[Any], pid: int) -> None:
    # Waits for a positive fact (the backend waits on a lock), bounded.
    for _ in range(500):
        cursor = await monitor.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        )
        row = await cursor.fetchone()
        if row is not None and row[0] == "Lock":
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited on a lock")


async def _setup(store: StateStore, layout: FleetLayout, now: datetime) -> tuple[UUID, UUID]:
    await store.apply_fleet_layout(layout, at=now)
    fleet = await store.get_fleet_snapshot(layout.slug)
    assert fleet is not None
    return fleet.id, fleet.domains[1].id


_INSERT_OPERATION = """
INSERT INTO operations (id, fleet_id, kind, state, target_domain_id, routing_committed,
                        created_at, updated_at)
VALUES (%s, %s, 'promote', 'pending', %s, false, now(), now())
RETURNING id
"""
_REMOVE = "UPDATE domains SET removed_at = now(), updated_at = now() WHERE id = %s RETURNING id"


async def test_an_operation_waiting_on_a_removal_is_not_inserted(
    postgres_store: StateStore, fleet_layout: FleetLayout, now: datetime
) -> None:
    store = postgres_store
    fleet_id, standby = await _setup(store, fleet_layout, now)
    dsn = _dsn(store.url)
    async with (
        await psycopg.AsyncConnection.connect(dsn) as remover,
        await psycopg.AsyncConnection.connect(dsn) as creator,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as monitor,
    ):
        removed = await (await remover.execute(_REMOVE, (standby,))).fetchall()
        assert len(removed) == 1
        insert = asyncio.create_task(
            creator.execute(_INSERT_OPERATION, (uuid4(), fleet_id, standby))
        )
        await _blocked(monitor, creator.info.backend_pid)
        await remover.commit()
        assert await (await insert).fetchall() == []
        await creator.commit()
    assert await store.get_in_flight_operation(fleet_id) is None


async def test_a_removal_waiting_on_an_operations_insert_does_not_land(
    postgres_store: StateStore, fleet_layout: FleetLayout, now: datetime
) -> None:
    store = postgres_store
    fleet_id, standby = await _setup(store, fleet_layout, now)
    dsn = _dsn(store.url)
    async with (
        await psycopg.AsyncConnection.connect(dsn) as creator,
        await psycopg.AsyncConnection.connect(dsn) as remover,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as monitor,
    ):
        inserted = await (
            await creator.execute(_INSERT_OPERATION, (uuid4(), fleet_id, standby))
        ).fetchall()
        assert len(inserted) == 1
        removal = asyncio.create_task(remover.execute(_REMOVE, (standby,)))
        await _blocked(monitor, remover.info.backend_pid)
        await creator.commit()
        assert await (await removal).fetchall() == []
        await remover.commit()
    operation = await store.get_in_flight_operation(fleet_id)
    assert operation is not None
    assert operation.target_domain_id == standby
    fleet = await store.get_fleet_snapshot(fleet_layout.slug)
    assert fleet is not None
    assert standby in {d.id for d in fleet.domains}


async def test_a_slot_write_waiting_on_an_operations_insert_does_not_land(
    postgres_store: StateStore, fleet_layout: FleetLayout, now: datetime
) -> None:
    store = postgres_store
    fleet_id, standby = await _setup(store, fleet_layout, now)
    fleet = await store.get_fleet_snapshot(fleet_layout.slug)
    assert fleet is not None
    slot = fleet.domains[1].slots[0]
    dsn = _dsn(store.url)
    write = (
        "UPDATE slots SET config_revision = config_revision + 1, updated_at = now() "
        "WHERE id = %s RETURNING id"
    )
    async with (
        await psycopg.AsyncConnection.connect(dsn) as creator,
        await psycopg.AsyncConnection.connect(dsn) as writer,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as monitor,
    ):
        await creator.execute(_INSERT_OPERATION, (uuid4(), fleet_id, standby))
        change = asyncio.create_task(writer.execute(write, (slot.id,)))
        await _blocked(monitor, writer.info.backend_pid)
        await creator.commit()
        assert await (await change).fetchall() == []
        await writer.commit()
    assert (await store.get_config_revisions(fleet_id))[("slot", slot.id)] == 1
