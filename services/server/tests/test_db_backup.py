"""``haru db backup`` / ``downgrade`` / ``current`` on real SQLite files, through the real CLI.

The backup is taken while another process keeps writing (WAL mode, as a running server
writes); a plain file copy taken at the same time misses what the WAL holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sqlite3
import sys
from pathlib import Path

from haru_db import head_revision, upgrade
from haru_protocol import example_layout_json
from haru_server.cli import app
from typer.testing import CliRunner

WRITER = """
import sqlite3, sys, time, uuid
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("PRAGMA journal_mode=WAL")
# A long-running writer: nothing checkpoints the WAL into the file while it runs.
conn.execute("PRAGMA wal_autocheckpoint=0")
fleet = conn.execute("SELECT id FROM fleets").fetchone()[0]
n = 0
while True:
    conn.execute(
        "INSERT INTO events (fleet_id, type, payload, created_at) VALUES (?, ?, ?, ?)",
        (fleet, "load.test", '{"n": %d}' % n, "2026-12-03 00:00:00.000000"),
    )
    n += 1
    if n == 200:
        print("WARM", flush=True)
    time.sleep(0.001)
"""


async def haru(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "haru_server",
        *args,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200", **(env or {})},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(60):
        out, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode()


def rows(path: Path, table: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True) as conn:
        return conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()  # noqa: S608


async def test_a_backup_under_load_is_a_consistent_store(tmp_path: Path) -> None:
    store = tmp_path / "haru.db"
    url = f"sqlite:///{store}"
    layout = tmp_path / "layout.json"
    layout.write_text(example_layout_json())
    code, out = await haru("seed", str(layout), "--database-url", url)
    assert code == 0, out
    writer = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WRITER, str(store), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert writer.stdout is not None
        async with asyncio.timeout(30):
            assert (await writer.stdout.readline()).strip() == b"WARM"
        copied = tmp_path / "copied.db"
        shutil.copyfile(store, copied)  # what an operator might do: the wrong way
        backup = tmp_path / "backup.db"
        code, out = await haru("db", "backup", str(backup), "--database-url", url)
        assert code == 0, out
        assert "backed up" in out
        assert head_revision() in out
        after_backup = len(rows(store, "events"))
    finally:
        writer.send_signal(signal.SIGTERM)
        await writer.wait()
    # The file copy has none of the WAL's rows; the backup has every row written before it.
    assert len(rows(copied, "events")) < 200
    backed_up = rows(backup, "events")
    assert len(backed_up) >= 200
    source = rows(store, "events")
    assert len(source) >= after_backup >= len(backed_up)
    # A prefix of the store's events, row for row, and every other table identical.
    assert backed_up == source[: len(backed_up)]
    for table in ("fleets", "domains", "slots", "operations"):
        assert rows(backup, table) == rows(store, table), table
    with sqlite3.connect(backup) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        # A plain single-file database: no WAL that a later file copy could miss.
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    # The backup is a store this release opens as is.
    code, out = await haru("db", "current", "--database-url", f"sqlite:///{backup}")
    assert code == 0, out
    assert "at head" in out


def invoke(*args: str) -> tuple[int, str]:
    """The CLI in this process (the load test above runs it as a real subprocess)."""
    result = CliRunner().invoke(app, list(args), env={"NO_COLOR": "1", "COLUMNS": "200"})
    return result.exit_code, result.output


def test_current_never_creates_a_missing_sqlite_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    code, out = invoke("db", "current", "--json", "--database-url", f"sqlite:///{missing}")
    assert code == 1, out
    assert json.loads(out)["revision"] is None
    assert not missing.exists()


def test_backup_refusals(tmp_path: Path) -> None:
    store = tmp_path / "haru.db"
    asyncio.run(upgrade(f"sqlite:///{store}"))
    existing = tmp_path / "existing.db"
    existing.write_text("keep me")
    code, out = invoke("db", "backup", str(existing), "--database-url", str(store))
    assert code == 1
    assert "never overwrites" in out
    assert existing.read_text() == "keep me"
    code, out = invoke("db", "backup", str(tmp_path / "b.db"), "--database-url", "nope.db")
    assert code == 1
    assert "no SQLite store" in out
    assert not (tmp_path / "nope.db").exists()
    code, out = invoke(
        "db",
        "backup",
        str(tmp_path / "b.db"),
        "--database-url",
        "postgresql://haru:secret-password@127.0.0.1:1/haru",
    )
    assert code == 1
    assert "pg_dump" in out
    assert "secret-password" not in out


def test_downgrade_asks_for_confirmation_then_goes_back(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'haru.db'}"
    asyncio.run(upgrade(url))
    code, out = invoke("db", "downgrade", "base", "--database-url", url)
    assert code == 2
    assert "--yes" in out
    code, out = invoke("db", "current", "--database-url", url)
    assert code == 0, out
    code, out = invoke("db", "downgrade", "base", "--yes", "--database-url", url)
    assert code == 0, out
    code, out = invoke("db", "current", "--json", "--database-url", url)
    assert code == 1
    assert json.loads(out)["revision"] is None
