"""Schema migrations: the committed Alembic history, applied to either engine."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import event, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from haru_db._engine import create_engine, translate_errors, writer
from haru_db._errors import SchemaOutdatedError, SchemaTooNewError
from haru_db._urls import dialect_of, redact_database_url, resolve_database_url

logger = logging.getLogger(__name__)

SCRIPT_LOCATION = "haru_db:migrations"
"""Where the history lives: inside the package, so it ships in the wheel."""

# Serialises concurrent upgrades (several server replicas booting at once) on PostgreSQL.
# SQLite needs nothing: the whole upgrade is one BEGIN IMMEDIATE transaction.
_POSTGRES_MIGRATION_LOCK = 0x68617275  # "haru"

# Alembic's migration context says at INFO which dialect it drives on every configure: a
# schema check (each /readyz) or a no-op upgrade would log two lines that say nothing.
_quiet_alembic: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "haru_quiet_alembic", default=False
)


class _QuietAlembic(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or not _quiet_alembic.get()


logging.getLogger("alembic.runtime.migration").addFilter(_QuietAlembic())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    token = _quiet_alembic.set(True)
    try:
        yield
    finally:
        _quiet_alembic.reset(token)


def alembic_config() -> Config:
    """An Alembic config pointing at the packaged history (no ``alembic.ini`` needed)."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    return config


SCHEMA_RELEASES: Final[Mapping[str, str]] = MappingProxyType(
    {
        "0.1.0": "0007",
        "0.2.0": "0011",
        "0.3.0": "0012",
        "0.4.0": "0013",
    }
)
"""Each haru-db release that changed the schema (oldest first) and the revision it migrates to.

A released schema never changes: a new migration ships in a new version, with a new entry
here (a test fails when the newest entry is not :func:`head_revision` or names a version newer
than the installed one). ``haru_build_info``'s version thus names the schema too."""


def head_revision() -> str:
    """The newest revision this code knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:  # pragma: no cover - the history is never empty
        raise RuntimeError("haru-db has no migrations")
    return head


def _known(revision: str) -> bool:
    script = ScriptDirectory.from_config(alembic_config())
    try:
        return script.get_revision(revision) is not None
    except CommandError:
        return False


async def upgrade(url: str | None, *, revision: str = "head") -> None:
    """Migrate the database at ``url`` to ``revision`` (default: head).

    All pending migrations run in ONE transaction, so a failure leaves the previous schema in
    place. Concurrent upgrades of one database are safe (an advisory lock on PostgreSQL, the
    write lock on SQLite).

    Args:
        url: Any form :func:`haru_db.resolve_database_url` accepts.
        revision: Target revision.

    Raises:
        SchemaTooNewError: The database carries a revision this code does not know.
        StateStoreUnavailableError: The database cannot be reached.
    """
    await _run(url, "upgrade", revision)


async def downgrade(url: str | None, *, revision: str = "base") -> None:
    """Migrate the database at ``url`` back to ``revision`` (default: base, an empty schema).

    For operators rolling back a release and for migration tests; it drops state.
    """
    await _run(url, "downgrade", revision)


async def current_revision(url: str | None) -> str | None:
    """The schema revision of the database at ``url`` (``None`` when never migrated).

    A missing SQLite file is never migrated: it is reported as such, not created.
    """
    resolved = resolve_database_url(url)
    if dialect_of(resolved) == "sqlite":
        path = make_url(resolved).database
        if path is not None and not await asyncio.to_thread(Path(path).exists):
            return None
    engine = create_engine(resolved)
    try:
        with translate_errors(resolved):
            async with engine.connect() as connection:
                return await connection.run_sync(_current_revision)
    finally:
        await engine.dispose()


async def check_schema(url: str | None) -> None:
    """Ensure the database at ``url`` is exactly at this code's head revision.

    Raises:
        SchemaOutdatedError: Not migrated, or migrated to an older revision.
        SchemaTooNewError: Migrated by a newer release.
        StateStoreUnavailableError: The database cannot be reached.
    """
    revision = await current_revision(url)
    head = head_revision()
    if revision == head:
        return
    if revision is not None and not _known(revision):
        raise SchemaTooNewError(revision)
    raise SchemaOutdatedError(revision, head)


def _current_revision(connection: Connection) -> str | None:
    with _quiet():
        return MigrationContext.configure(connection).get_current_revision()


def _foreign_keys_off(engine: AsyncEngine) -> None:
    # SQLite's way to rebuild a table others reference (migration 0012): keys off on the
    # migration's connection (a pragma that is a no-op inside a transaction, so set at
    # connect), every key checked before the commit instead (`_check_foreign_keys`).
    @event.listens_for(engine.sync_engine, "connect")
    def _keys_off(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys = OFF")
        finally:
            cursor.close()


def _check_foreign_keys(connection: Connection) -> None:
    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if broken:
        raise RuntimeError(f"the migration broke {len(broken)} foreign key(s): {broken[:5]}")


async def _run(url: str | None, direction: str, revision: str) -> None:
    resolved = resolve_database_url(url)
    engine = create_engine(resolved)
    if dialect_of(resolved) == "sqlite":
        _foreign_keys_off(engine)
    try:
        with translate_errors(resolved):
            async with writer(engine).begin() as connection:
                await connection.run_sync(_migrate_sync, direction, revision, resolved)
    finally:
        await engine.dispose()


def _migrate_sync(connection: Connection, direction: str, revision: str, url: str) -> None:
    if connection.dialect.name == "postgresql":
        connection.execute(
            text("SELECT pg_advisory_xact_lock(:key)"), {"key": _POSTGRES_MIGRATION_LOCK}
        )
    current = _current_revision(connection)
    if current is not None and not _known(current):
        raise SchemaTooNewError(current)
    if current == {"head": head_revision(), "base": None}.get(revision, revision):
        # Nothing to change (every boot of an up-to-date store): not worth an INFO line.
        logger.debug("%s is at revision %s already", redact_database_url(url), current)
        return
    logger.info(
        "migrating %s: %s from %s to %s",
        redact_database_url(url),
        direction,
        current or "empty",
        revision,
    )
    config = alembic_config()
    # The connection is already inside the transaction begun above; Alembic sees that and
    # leaves commit/rollback to us, so the version read and the migrations are one unit.
    config.attributes["connection"] = connection
    if direction == "upgrade":
        command.upgrade(config, revision)
    else:
        command.downgrade(config, revision)
    if connection.dialect.name == "sqlite":
        _check_foreign_keys(connection)
