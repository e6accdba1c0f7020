"""A SQLite state store never loads the PostgreSQL driver (resident memory of `haru serve`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import asyncio, sys
from datetime import UTC, datetime

from haru_db import RouteListener, StateStore, upgrade


async def main(url):
    await upgrade(url)
    store = StateStore.open(url)
    try:
        await store.list_fleets()
    finally:
        await store.close()
    await RouteListener(url, lambda payload: None).run()  # returns at once on SQLite


asyncio.run(main(sys.argv[1]))
print(sorted(m for m in sys.modules if m == "psycopg" or m.startswith("psycopg.")))
"""


def test_a_sqlite_store_does_not_import_psycopg(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, url], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]"
