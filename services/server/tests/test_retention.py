"""Retention: ``haru db prune`` and the server's own periodic prune, as real processes."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from haru_db import PruneCounts, StateStore, upgrade
from haru_protocol import (
    FleetSnapshot,
    OperationError,
    OperationErrorCode,
    OperationKind,
    OperationStep,
    load_example_layout,
)
from haru_server._clock import ManualClock
from haru_server._metrics import ServerMetrics
from haru_server._retention import Pruner
from haru_server._settings import Settings
from haru_server.cli import DEFAULT_RETENTION_DAYS, app
from typer.testing import CliRunner

Haru = Callable[..., subprocess.CompletedProcess[str]]
HaruServe = Callable[..., AbstractAsyncContextManager[Any]]
"""The ``haru_serve`` fixture: ``async with haru_serve(env) as server`` (a ServerProcess)."""

OLD = 90
"""Days ago the old history was written (beyond the default 30-day retention)."""
PROMOTIONS = 70
"""Old finished promotions: 64 stay (the newest of the fleet), 6 are prunable."""


async def _old_history(url: str) -> FleetSnapshot:
    """A fleet with PROMOTIONS failed promotions and one fleet event, all OLD days ago."""
    await upgrade(url)
    store = StateStore.open(url)
    try:
        return await _write_old_history(store, datetime.now(UTC))
    finally:
        await store.close()


async def _write_old_history(store: StateStore, now: datetime) -> FleetSnapshot:
    layout = load_example_layout()
    await store.apply_fleet_layout(layout, at=now)
    fleet = await store.get_fleet_snapshot(layout.slug)
    assert fleet is not None
    target = next(d for d in fleet.domains if d.id != fleet.active_domain_id)
    start = now - timedelta(days=OLD)
    for i in range(PROMOTIONS):
        at = start + timedelta(minutes=i)
        operation, created = await store.create_operation(
            fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=target.id, at=at
        )
        assert created
        await store.append_event(
            fleet_id=fleet.id, type="test.note", payload={}, operation_id=operation.id, at=at
        )
        error = OperationError(
            step=OperationStep.STOP_TRAINING,
            code=OperationErrorCode.STEP_TIMEOUT.value,
            message="test",
        )
        assert await store.fail_operation(operation.id, error=error, at=at)
    await store.append_event(fleet_id=fleet.id, type="test.note", payload={}, at=start)
    return fleet


async def _counts(
    url: str, fleet: FleetSnapshot, *, up_to_event: int | None = None
) -> tuple[int, int]:
    """Events (those up to ``up_to_event`` only, when given) and operations of ``fleet``."""
    store = StateStore.open(url)
    try:
        events = await store.list_events(fleet.id, limit=1000)
        recent = await store.list_recent_operations(fleet.id, limit=1000)
        kept = [e for e in events if up_to_event is None or e.id <= up_to_event]
        return len(kept), len(recent)
    finally:
        await store.close()


async def test_db_prune_deletes_old_history_and_keeps_the_newest(
    haru: Haru, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'prune.db'}"
    fleet = await _old_history(url)
    events_before, operations_before = await _counts(url, fleet)
    assert operations_before == PROMOTIONS
    env = {"DATABASE_URL": url}

    dry = haru("db", "prune", "--dry-run", "--json", env=env)
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    assert planned["dryRun"] is True
    assert planned["olderThanDays"] == DEFAULT_RETENTION_DAYS
    assert planned["keptPerFleet"] == 64
    # The 6 oldest promotions with their events, and the old fleet event.
    assert (planned["events"], planned["operations"]) == (PROMOTIONS - 64 + 1, PROMOTIONS - 64)
    assert await _counts(url, fleet) == (events_before, operations_before)

    # Nothing is older than 100 days.
    none = haru("db", "prune", "--older-than", "100", "--json", env=env)
    assert none.returncode == 0, none.stderr
    assert (json.loads(none.stdout)["events"], json.loads(none.stdout)["operations"]) == (0, 0)

    done = haru("db", "prune", env=env)
    assert done.returncode == 0, done.stderr
    assert "deleted 7 event(s) and 6 finished operation(s) older than 30 day(s)" in done.stdout
    assert await _counts(url, fleet) == (events_before - 7, 64)

    store = StateStore.open(url)
    try:
        left = await store.count_prunable(before=datetime.now(UTC) - timedelta(days=30))
    finally:
        await store.close()
    assert (left.events, left.operations) == (0, 0)


def test_db_prune_refuses_bad_input_and_an_unmigrated_store(haru: Haru, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    runner = CliRunner()
    zero = runner.invoke(app, ["db", "prune", "--older-than", "0", "--database-url", url])
    assert zero.exit_code == 2
    assert "--older-than" in zero.output
    # HARU_RETENTION_DAYS=0 (keep forever) never means "prune everything".
    off = runner.invoke(
        app, ["db", "prune", "--database-url", url], env={"HARU_RETENTION_DAYS": "0"}
    )
    assert off.exit_code == 2
    unmigrated = haru("db", "prune", env={"DATABASE_URL": url})
    assert unmigrated.returncode == 1
    assert "has no schema" in unmigrated.stderr
    assert "Traceback" not in unmigrated.stderr


def test_retention_setting() -> None:
    assert Settings.from_env({}).retention_days == DEFAULT_RETENTION_DAYS
    assert Settings.from_env({"HARU_RETENTION_DAYS": "0"}).retention_days == 0
    with pytest.raises(ValueError, match="HARU_RETENTION_DAYS"):
        Settings.from_env({"HARU_RETENTION_DAYS": "-1"})


_PRUNED = re.compile(r"retention: pruned (\d+) event\(s\) and (\d+) finished operation\(s\)")


async def test_the_server_prunes_by_itself(haru_serve: HaruServe, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'serve.db'}"
    fleet = await _old_history(url)
    events_before, _ = await _counts(url, fleet)
    last = await _last_event_id(url, fleet)
    env = {"DATABASE_URL": url, "PORT": "0", "HARU_RETENTION_DAYS": "30"}
    async with haru_serve(env, listening=False) as server:
        match = await server.line(_PRUNED, timeout_s=60)
    assert (int(match.group(1)), int(match.group(2))) == (PROMOTIONS - 64 + 1, PROMOTIONS - 64)
    # What the server wrote since it started (its unreachable supervisors: `server.partitioned`)
    # is not history; of the history, the 7 oldest events went.
    assert await _counts(url, fleet, up_to_event=last) == (events_before - 7, 64)


async def _last_event_id(url: str, fleet: FleetSnapshot) -> int:
    store = StateStore.open(url)
    try:
        return max(e.id for e in await store.list_events(fleet.id, limit=1000))
    finally:
        await store.close()


def test_pruning_keeps_what_the_server_reads_back() -> None:
    """The rule in haru-db keeps what the server's decisions read (a drift guard)."""
    import haru_core
    from haru_db import KEEP_RECENT_OPERATIONS, RELAUNCH_STREAK_EVENTS
    from haru_server._reconciler import RECENT_OPERATIONS

    assert RECENT_OPERATIONS <= KEEP_RECENT_OPERATIONS
    assert {str(t) for t in haru_core.RELAUNCH_STREAK_EVENTS} == RELAUNCH_STREAK_EVENTS


async def test_the_pruner_cuts_at_the_app_clock_and_counts(store: StateStore) -> None:
    clock = ManualClock(datetime(2030, 1, 1, tzinfo=UTC))
    fleet = await _write_old_history(store, clock())
    metrics = ServerMetrics()
    pruner = Pruner(store, clock, retention=timedelta(days=OLD + 1), metrics=metrics)
    assert await pruner.run_once() == PruneCounts(0, 0)
    clock.now += timedelta(days=2)  # the history is now older than the retention
    assert await pruner.run_once() == PruneCounts(PROMOTIONS - 64 + 1, PROMOTIONS - 64)
    sample = metrics.registry.get_sample_value
    assert sample("haru_pruned_rows_total", {"table": "events"}) == PROMOTIONS - 64 + 1
    assert sample("haru_pruned_rows_total", {"table": "operations"}) == PROMOTIONS - 64
    assert len(await store.list_recent_operations(fleet.id, limit=1000)) == 64
