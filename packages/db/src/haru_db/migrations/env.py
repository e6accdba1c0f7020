"""Alembic environment of haru-db.

:func:`haru_db.upgrade` runs this with an open connection in ``config.attributes["connection"]``
that is already inside one transaction: Alembic then leaves transaction control to the caller,
so the version read and every migration commit (or roll back) together. Without a connection
(the ``alembic`` command line, e.g. ``alembic revision --autogenerate`` while developing), it
connects to ``HARU_DATABASE_URL`` or the ``sqlalchemy.url`` option itself.
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy.engine import Connection

from haru_db._engine import create_engine, writer
from haru_db._tables import metadata
from haru_db._urls import resolve_database_url


def _configure_and_run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        # SQLite cannot ALTER most things; batch mode recreates the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_standalone() -> None:
    url = os.environ.get("HARU_DATABASE_URL") or context.config.get_main_option("sqlalchemy.url")
    engine = create_engine(resolve_database_url(url))
    try:
        async with writer(engine).begin() as connection:
            await connection.run_sync(_configure_and_run)
    finally:
        await engine.dispose()


def _main() -> None:
    if context.is_offline_mode():
        raise RuntimeError("haru-db migrations run online only (use haru_db.upgrade)")
    connection = context.config.attributes.get("connection")
    if isinstance(connection, Connection):
        _configure_and_run(connection)
    else:
        asyncio.run(_run_standalone())


_main()
