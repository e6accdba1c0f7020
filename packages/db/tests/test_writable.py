"""A database that would refuse writes is refused at start-up, with the reason."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from haru_db import StateStoreReadOnlyError, check_writable, upgrade
from haru_db.testing import DatabaseUrlFactory
from sqlalchemy.engine import make_url

_SCRIPT = """
import asyncio, sys
from haru_db import StateStoreReadOnlyError, check_writable
try:
    asyncio.run(check_writable(sys.argv[1]))
except StateStoreReadOnlyError as exc:
    print("READ-ONLY", exc)
    sys.exit(3)
print("WRITABLE")
"""


def _check_without_root_powers(path: Path) -> subprocess.CompletedProcess[str]:
    """Run check_writable in a process that file permissions bind (root loses its override)."""
    command = [sys.executable, "-c", _SCRIPT, str(path)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: permissions cannot bind the check")
        command = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def migrated_file(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    directory.mkdir()
    path = directory / "haru.db"
    asyncio.run(upgrade(str(path)))
    return path


def test_a_writable_file_passes(migrated_file: Path) -> None:
    result = _check_without_root_powers(migrated_file)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "WRITABLE"
    asyncio.run(check_writable(str(migrated_file)))


def test_a_read_only_file_is_refused(migrated_file: Path) -> None:
    migrated_file.chmod(0o444)
    result = _check_without_root_powers(migrated_file)
    assert result.returncode == 3, result.stderr
    assert "READ-ONLY" in result.stdout
    assert "the database file is not writable" in result.stdout


def test_a_read_only_directory_is_refused(migrated_file: Path) -> None:
    migrated_file.parent.chmod(0o555)
    try:
        result = _check_without_root_powers(migrated_file)
    finally:
        migrated_file.parent.chmod(0o755)
    assert result.returncode == 3, result.stderr
    assert f"the directory {str(migrated_file.parent)!r} is not writable" in result.stdout


async def test_a_read_only_postgres_session_is_refused(
    postgres_url_factory: DatabaseUrlFactory,
) -> None:
    url = await postgres_url_factory()
    await check_writable(url)
    parsed = make_url(url)
    admin = parsed.set(drivername="postgresql", database="postgres").render_as_string(
        hide_password=False
    )
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{parsed.database}" SET default_transaction_read_only = on')
    try:
        with pytest.raises(StateStoreReadOnlyError, match="read-only"):
            await check_writable(url)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{parsed.database}" RESET default_transaction_read_only')
