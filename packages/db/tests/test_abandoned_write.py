"""A write abandoned at the deadline while SQLite's write lock is held elsewhere never keeps
that lock once it runs: the next writes of the same process succeed as soon as the other
holder lets go.

The abandoned statement keeps waiting for the lock in the driver's worker thread after its
caller got StateStoreUnavailableError; when the holder releases the lock, the statement runs.
A write with RETURNING (creating an operation) stops at its first row inside the driver until
the rows are fetched: abandoned there, it would hold the write lock (its transaction neither
committed nor rolled back) until garbage collection happened to finalize it.
"""

from __future__ import annotations

import asyncio
import gc
import sqlite3
from datetime import datetime
from uuid import uuid4

import pytest
from haru_db import StateStore, StateStoreUnavailableError
from haru_db.testing import DatabaseUrlFactory
from haru_protocol import FleetLayout, OperationKind
from sqlalchemy.engine import make_url

DEADLINE_S = 0.5


async def test_a_write_abandoned_on_the_lock_does_not_keep_it(
    sqlite_url_factory: DatabaseUrlFactory, fleet_layout: FleetLayout, now: datetime
) -> None:
    url = await sqlite_url_factory()
    # A busy timeout far above the deadline: the deadline abandons the write while it waits.
    store = StateStore.open(url, statement_timeout_ms=10_000, call_timeout_s=DEADLINE_S)
    holder = sqlite3.connect(str(make_url(url).database), isolation_level=None, timeout=0)
    # Garbage collection would finalize a leaked statement (and so free the lock) at a moment
    # of its own: the store must not depend on it, and the test must not either.
    gc.disable()
    try:
        await store.apply_fleet_layout(fleet_layout, at=now)
        snapshot = await store.get_fleet_snapshot("fleet")
        assert snapshot is not None
        beta = next(d for d in snapshot.domains if d.slug == "beta")

        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(StateStoreUnavailableError, match="no answer within"):
            await store.create_operation(
                fleet_id=snapshot.id, kind=OperationKind.PROMOTE, target_domain_id=beta.id, at=now
            )
        holder.execute("ROLLBACK")

        # The abandoned insert now takes the lock in the driver's thread: wait until it has
        # run, i.e. its operation is committed or the lock is held by this process.
        async with asyncio.timeout(10):  # only a guard against a hang
            while not _committed_or_locked(holder):
                await asyncio.sleep(0.01)

        outcomes = []
        for _ in range(3):
            try:
                await store.mark_domain_seen(uuid4(), at=now)
                outcomes.append("ok")
            except StateStoreUnavailableError:
                outcomes.append("unavailable")
        assert outcomes == ["ok", "ok", "ok"]
        assert _committed(holder)
    finally:
        gc.enable()
        holder.close()
        await store.close()


def _committed(holder: sqlite3.Connection) -> bool:
    return bool(holder.execute("SELECT count(*) FROM operations").fetchone()[0])


def _committed_or_locked(holder: sqlite3.Connection) -> bool:
    if _committed(holder):
        return True
    try:
        holder.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc):
            raise
        return True
    holder.execute("ROLLBACK")
    return False
