from __future__ import annotations

import asyncio
import importlib.metadata
import itertools
import shutil
import subprocess
import zipfile
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from haru_db import (
    SCHEMA_RELEASES,
    SchemaOutdatedError,
    SchemaTooNewError,
    StateStore,
    check_schema,
    current_revision,
    downgrade,
    head_revision,
    upgrade,
)
from haru_db._engine import create_engine
from haru_db._migrate import alembic_config
from haru_db._tables import metadata
from haru_db.testing import DatabaseUrlFactory
from haru_protocol import FleetLayout, OperationKind
from packaging.version import Version
from sqlalchemy.engine import Connection

TABLES = {
    "fleets",
    "domains",
    "slots",
    "operations",
    "events",
    "fleet_cas",
    "domain_certs",
    "client_keys",
}
SQLITE_TRIGGERS = {
    "trg_operations_promote_failed_cleanup",
    "trg_fleets_switch_commits_routing",
    "trg_operations_pending_writes",
    "trg_operations_fence_cas",
    "trg_operations_fence_create",
    "trg_fleets_config_events",
    "trg_domains_config_events",
    "trg_domains_insert_config_events",
    "trg_slots_config_events",
    "trg_slots_insert_config_events",
    "trg_operations_target_not_removed",
    "trg_operations_insert_events",
}


async def _inspect(url: str, fn: Any) -> Any:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(fn)
    finally:
        await engine.dispose()


def _tables(conn: Connection) -> set[str]:
    return set(sa.inspect(conn).get_table_names())


def _triggers(conn: Connection) -> set[str]:
    if conn.dialect.name != "sqlite":
        return set()
    rows = conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'trigger'")
    return {r[0] for r in rows}


def _include(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    # sqlite_sequence is SQLite's own bookkeeping for AUTOINCREMENT, not part of the schema.
    return not (type_ == "table" and name in {"sqlite_sequence", "alembic_version"})


def _drift(conn: Connection) -> list[Any]:
    context = MigrationContext.configure(
        conn, opts={"compare_type": True, "include_object": _include}
    )
    return list(compare_metadata(context, metadata))


def _check_constraints(conn: Connection) -> dict[str, set[str]]:
    inspector = sa.inspect(conn)
    return {t: {str(c["name"]) for c in inspector.get_check_constraints(t)} for t in TABLES}


def test_the_history_has_a_single_head_and_a_linear_chain() -> None:
    script = ScriptDirectory.from_config(alembic_config())
    assert script.get_heads() == [head_revision()]
    revisions = list(script.walk_revisions())
    assert revisions[-1].down_revision is None
    for newer, older in itertools.pairwise(revisions):
        assert newer.down_revision == older.revision


async def test_models_and_migrations_do_not_drift(
    database_url_factory: DatabaseUrlFactory,
) -> None:
    url = await database_url_factory()
    assert await _inspect(url, _drift) == []


async def test_check_constraints_match_the_models(database_url_factory: DatabaseUrlFactory) -> None:
    # compare_metadata ignores CHECK constraints; compare their names instead.
    url = await database_url_factory()
    expected = {
        table.name: {str(c.name) for c in table.constraints if isinstance(c, sa.CheckConstraint)}
        for table in metadata.sorted_tables
    }
    assert await _inspect(url, _check_constraints) == expected


async def test_upgrade_downgrade_upgrade_with_data(
    store: StateStore, fleet_layout: FleetLayout, now: datetime
) -> None:
    url = store.url
    applied = await store.apply_fleet_layout(fleet_layout, at=now)
    snapshot = await store.get_fleet_snapshot(fleet_layout.slug)
    assert snapshot is not None
    await store.create_operation(
        fleet_id=applied.fleet_id,
        kind=OperationKind.PROMOTE,
        target_domain_id=snapshot.domains[1].id,
        at=now,
    )
    await store.close()

    await downgrade(url)
    assert await current_revision(url) is None
    assert await _inspect(url, _tables) & TABLES == set()
    assert await _inspect(url, _triggers) == set()

    await upgrade(url)
    assert await current_revision(url) == head_revision()
    assert await _inspect(url, _tables) >= TABLES
    if store.dialect == "sqlite":
        assert await _inspect(url, _triggers) == SQLITE_TRIGGERS
    again = StateStore.open(url)
    try:
        assert await again.list_fleets() == []
        result = await again.apply_fleet_layout(fleet_layout, at=now)
        assert result.fleet_created
    finally:
        await again.close()


async def test_0012_down_and_up_keep_every_row_and_key(
    database_url_factory: DatabaseUrlFactory, fleet_layout: FleetLayout, now: datetime
) -> None:
    # The rebuild of `domains` and `slots` on SQLite (both ways) must keep every row, id and
    # the keys that reference them (slots, events, operations).
    url = await database_url_factory()
    store = StateStore.open(url)
    try:
        applied = await store.apply_fleet_layout(fleet_layout, at=now)
        before = await store.get_fleet_snapshot(fleet_layout.slug)
        assert before is not None
        standby = before.domains[1]
        await store.create_operation(
            fleet_id=applied.fleet_id,
            kind=OperationKind.DEMOTE,
            target_domain_id=standby.id,
            at=now,
        )
        events_before = await store.list_events(applied.fleet_id)
    finally:
        await store.close()
    await downgrade(url, revision="0011")
    assert await current_revision(url) == "0011"
    await upgrade(url)
    store = StateStore.open(url)
    try:
        after = await store.get_fleet_snapshot(fleet_layout.slug)
        assert after is not None
        assert after.model_dump() == before.model_dump()
        assert await store.list_events(applied.fleet_id) == events_before
        operation = await store.get_in_flight_operation(applied.fleet_id)
        assert operation is not None
        assert operation.target_domain_id == standby.id
    finally:
        await store.close()


async def test_upgrade_is_idempotent(database_url_factory: DatabaseUrlFactory) -> None:
    url = await database_url_factory()
    await upgrade(url)
    await upgrade(url)
    assert await current_revision(url) == head_revision()
    await check_schema(url)


async def test_concurrent_upgrades_of_one_database(
    database_url_factory: DatabaseUrlFactory,
) -> None:
    url = await database_url_factory()
    await downgrade(url)
    await asyncio.gather(upgrade(url), upgrade(url), upgrade(url))
    assert await current_revision(url) == head_revision()
    assert await _inspect(url, _drift) == []


async def test_check_schema_reports_an_unmigrated_database(
    database_url_factory: DatabaseUrlFactory,
) -> None:
    url = await database_url_factory()
    await downgrade(url)
    with pytest.raises(SchemaOutdatedError, match="haru db upgrade"):
        await check_schema(url)


async def test_a_revision_from_a_newer_release_is_refused(
    database_url_factory: DatabaseUrlFactory,
) -> None:
    url = await database_url_factory()
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text("UPDATE alembic_version SET version_num = 'f00dfeed'"))
    finally:
        await engine.dispose()
    assert await current_revision(url) == "f00dfeed"
    with pytest.raises(SchemaTooNewError, match="f00dfeed"):
        await check_schema(url)
    with pytest.raises(SchemaTooNewError):
        await upgrade(url)
    assert await current_revision(url) == "f00dfeed"


async def test_a_fresh_sqlite_file_is_created_by_upgrade(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    assert await current_revision(str(path)) is None
    await upgrade(str(path))
    assert await current_revision(f"sqlite:///{path}") == head_revision()


@pytest.mark.slow
def test_the_wheel_ships_the_migrations_and_the_pytest_plugin(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    root = Path(__file__).resolve().parents[3]
    subprocess.run(
        [uv, "build", "--package", "haru-db", "--wheel", "--offline", "-o", str(tmp_path)],
        cwd=root,
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = tmp_path.glob("haru_db-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        # The pytest plugin is opt-in (pytest_plugins = ["haru_db.testing"]), not an entry point.
        entry_points = [n for n in names if n.endswith("entry_points.txt")]
        assert all(b"pytest11" not in archive.read(n) for n in entry_points)
    assert {
        "haru_db/migrations/env.py",
        "haru_db/migrations/script.py.mako",
        "haru_db/migrations/versions/v0001_initial.py",
        "haru_db/migrations/versions/v0002_operation_events.py",
        "haru_db/migrations/versions/v0003_domain_provisioning.py",
        "haru_db/migrations/versions/v0004_route_notify.py",
        "haru_db/migrations/versions/v0005_operation_mirrors.py",
        "haru_db/migrations/versions/v0006_route_lease.py",
        "haru_db/migrations/versions/v0007_operation_fence.py",
        "haru_db/migrations/versions/v0009_config_revision.py",
        "haru_db/migrations/versions/v0010_fleet_ca.py",
        "haru_db/migrations/versions/v0011_client_keys.py",
        "haru_db/migrations/versions/v0012_removal.py",
        "haru_db/migrations/versions/v0008_domain_connect_failed.py",
        "haru_db/py.typed",
    } <= names


def test_the_package_version_names_the_schema() -> None:
    """A migration without a new haru-db version (and its SCHEMA_RELEASES entry) fails here."""
    releases = list(SCHEMA_RELEASES.items())
    version, head = releases[-1]
    # The release that introduced this code's head is this one or an older one.
    assert Version(version) <= Version(importlib.metadata.version("haru-db"))
    assert head == head_revision(), "a new migration needs a new release entry"
    versions = [Version(v) for v, _ in releases]
    assert versions == sorted(set(versions)), "one entry per release, oldest first"
    heads = [h for _, h in releases]
    assert heads == sorted(set(heads)), "each listed release moved the schema forward"
    # The released pairs never change.
    assert SCHEMA_RELEASES["0.1.0"] == "0007"
