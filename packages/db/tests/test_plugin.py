"""The pytest plugin other packages use (haru_db.testing)."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import psycopg
import pytest
from _pytest.outcomes import Failed, Skipped
from haru_db import StateStore, current_revision, head_revision
from haru_db.testing import (
    REQUIRE_POSTGRES_ENV,
    DatabaseUrlFactory,
    Lane,
    _start_cluster,
    _unavailable,
)


async def test_each_lane_gets_a_fresh_migrated_database(
    haru_db_lane: Lane,
    database_url_factory: DatabaseUrlFactory,
    store: StateStore,
    request: pytest.FixtureRequest,
) -> None:
    on_postgres = request.node.get_closest_marker("postgres") is not None
    assert on_postgres == (haru_db_lane == "postgres")
    assert store.dialect == ("sqlite" if haru_db_lane == "sqlite" else "postgresql")
    assert await store.list_fleets() == []
    first, second = await database_url_factory(), await database_url_factory()
    assert len({first, second, store.url}) == 3
    for url in (first, second):
        assert await current_revision(url) == head_revision()


async def test_postgres_only_fixtures_mark_their_tests(
    postgres_store: StateStore, sqlite_store: StateStore, request: pytest.FixtureRequest
) -> None:
    assert request.node.get_closest_marker("postgres") is not None
    assert (postgres_store.dialect, sqlite_store.dialect) == ("postgresql", "sqlite")


def test_an_unavailable_lane_skips_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REQUIRE_POSTGRES_ENV, raising=False)
    with pytest.raises(Skipped, match="PostgreSQL lane skipped: no initdb here"):
        _unavailable("no initdb here")
    monkeypatch.setenv(REQUIRE_POSTGRES_ENV, "0")
    with pytest.raises(Skipped):
        _unavailable("no initdb here")


def test_haru_require_postgres_turns_the_skip_into_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(REQUIRE_POSTGRES_ENV, "1")
    with pytest.raises(Failed, match=r"HARU_REQUIRE_POSTGRES is set .*: no initdb here"):
        _unavailable("no initdb here")


def test_without_initdb_there_is_no_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert _start_cluster(tmp_path) == (
        "HARU_TEST_DATABASE_URL is unset and initdb/pg_ctl are not on PATH"
    )


@pytest.mark.slow
def test_a_throwaway_cluster_starts_and_stops(tmp_path: Path) -> None:
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        assert "root" in str(_start_cluster(tmp_path))
        pytest.skip("initdb refuses to run as root")
    started = _start_cluster(tmp_path)
    if isinstance(started, str):
        pytest.skip(started)
    try:
        with psycopg.connect(started.admin_url, connect_timeout=10) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        started.stop()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(started.admin_url, connect_timeout=2)


def test_the_plugin_in_a_fresh_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A project asks for the plugin in its root conftest (nothing loads it by itself); with no
    # PostgreSQL and HARU_REQUIRE_POSTGRES the sqlite lane passes and the postgres lane errors
    # with the reason.
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["haru_db.testing"]\n')
    (tmp_path / "test_inner.py").write_text(
        "async def test_store(store):\n"
        "    await store.ping()\n"
        "    assert await store.list_fleets() == []\n"
    )
    monkeypatch.delenv("HARU_TEST_DATABASE_URL", raising=False)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv(REQUIRE_POSTGRES_ENV, "1")
    monkeypatch.chdir(tmp_path)
    code = pytest.main(
        [
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            "-o",
            "asyncio_mode=auto",
            "-o",
            "asyncio_default_fixture_loop_scope=function",
            "--rootdir",
            str(tmp_path),
            "-rA",
            "-q",
        ]
    )
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert code == pytest.ExitCode.TESTS_FAILED, output
    assert "PASSED test_inner.py::test_store[sqlite]" in output
    assert "ERROR test_inner.py::test_store[postgres]" in output
    assert "HARU_REQUIRE_POSTGRES is set but the PostgreSQL lane is unavailable" in output


def test_the_plugin_is_not_loaded_unless_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Installing haru-db registers no pytest11 entry point: a project that does not ask for
    # the plugin never imports it.
    (tmp_path / "test_unasked.py").write_text("def test_store(store):\n    pass\n")
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    monkeypatch.chdir(tmp_path)
    code = pytest.main(
        [
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            "-o",
            "asyncio_default_fixture_loop_scope=function",
            "--rootdir",
            str(tmp_path),
            "-rA",
            "-q",
        ]
    )
    output = "".join(capsys.readouterr())
    assert code == pytest.ExitCode.TESTS_FAILED, output
    assert "fixture 'store' not found" in output
    assert not any(
        ep.value.startswith("haru_db") for ep in importlib.metadata.entry_points(group="pytest11")
    )
