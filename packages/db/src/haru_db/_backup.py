"""Online backups of the embedded SQLite store.

Copying ``haru.db`` while a server runs is not a backup: the store runs in WAL mode, so the
file alone holds only what the last checkpoint wrote, and the copy still passes
``PRAGMA integrity_check``. SQLite's online backup API (``sqlite3.Connection.backup``) reads a
consistent snapshot through a connection, WAL included, without blocking the writers.
PostgreSQL stores are backed up with ``pg_dump`` (the README says how).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url

from haru_db._errors import BackupError
from haru_db._urls import dialect_of, redact_database_url, resolve_database_url


@dataclass(frozen=True, slots=True)
class BackupResult:
    """What :func:`backup_sqlite` wrote.

    Attributes:
        source: The store's file.
        destination: The backup's file (a complete SQLite database, usable as a store).
        size_bytes: The backup's size.
        revision: Its schema revision (``None``: never migrated).
    """

    source: Path
    destination: Path
    size_bytes: int
    revision: str | None


def sqlite_file(url: str | None) -> Path | None:
    """The file of an SQLite store URL (``None`` for PostgreSQL)."""
    resolved = resolve_database_url(url)
    if dialect_of(resolved) != "sqlite":
        return None
    database = make_url(resolved).database
    return None if database is None else Path(database)


async def backup_sqlite(url: str | None, destination: Path) -> BackupResult:
    """Copy the SQLite store at ``url`` into the new file ``destination``, online.

    Writers keep running meanwhile; the backup is the store as of one instant. It is written
    next to ``destination`` and renamed into place once complete and checked, so a partial
    file never carries the final name.

    Raises:
        BackupError: A PostgreSQL URL, no store at ``url``, ``destination`` exists, or the copy
            failed (the message says which).
    """
    source = sqlite_file(url)
    if source is None:
        shown = redact_database_url(resolve_database_url(url))
        raise BackupError(
            f"{shown} is a PostgreSQL store: back it up with pg_dump (see the haru-db README)"
        )
    return await asyncio.to_thread(_copy, source, destination)


def _copy(source: Path, destination: Path) -> BackupResult:
    if not source.is_file():
        raise BackupError(f"no SQLite store at {source}")
    if destination.exists():
        raise BackupError(f"{destination} exists: a backup never overwrites a file")
    partial = destination.with_name(f".{destination.name}.partial")
    partial.unlink(missing_ok=True)
    try:
        # mode=ro: a backup never creates or changes the store.
        with (
            contextlib.closing(
                sqlite3.connect(f"{source.as_uri()}?mode=ro", uri=True, timeout=30)
            ) as src,
            contextlib.closing(sqlite3.connect(partial)) as dst,
        ):
            src.backup(dst)
            # The copy is a plain single-file database: no WAL beside it to lose.
            (mode,) = dst.execute("PRAGMA journal_mode=DELETE").fetchone()
            if mode != "delete":
                raise BackupError(f"the copy stayed in journal mode {mode!r}")
            (verdict,) = dst.execute("PRAGMA integrity_check").fetchone()
            if verdict != "ok":
                raise BackupError(f"the copy failed its integrity check: {verdict}")
            revision = _revision(dst)
        os.replace(partial, destination)
        return BackupResult(source, destination, destination.stat().st_size, revision)
    except sqlite3.Error as exc:
        raise BackupError(f"backup of {source} failed: {exc}") from exc
    finally:
        partial.unlink(missing_ok=True)


def _revision(connection: sqlite3.Connection) -> str | None:
    try:
        row = connection.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.OperationalError:  # no alembic_version table: never migrated
        return None
    return None if row is None else str(row[0])
