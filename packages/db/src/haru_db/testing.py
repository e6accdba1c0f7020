"""pytest plugin: a freshly migrated Haru database per test, on SQLite and on PostgreSQL.

Registered as a ``pytest11`` entry point of haru-db, so any package whose tests run with
haru-db installed (``pip install haru-db[testing]``) gets these fixtures without importing
anything:

- ``store``: a :class:`~haru_db.StateStore` on a fresh database, parametrized over the two
  lanes (test ids ``[sqlite]`` and ``[postgres]``; the latter carries the ``postgres`` mark).
- ``sqlite_store`` / ``postgres_store``: one lane only.
- ``database_url_factory``: ``url = await database_url_factory()`` returns the URL of another
  fresh migrated database of the test's lane (for separate engines or processes); every
  database it handed out is released after the test. ``sqlite_url_factory`` and
  ``postgres_url_factory`` are the single-lane versions.
- ``haru_db_lane``: ``"sqlite"`` or ``"postgres"``, the parametrized lane.

PostgreSQL comes from ``HARU_TEST_DATABASE_URL`` (a server URL whose user may create
databases; its database is only used for maintenance). The migrations run once per test
session, into a template database; a test's database is a ``CREATE DATABASE ... TEMPLATE``
copy of it. After the test the copy is emptied (milliseconds) and pooled for the next test,
or dropped when the test changed its schema; every copy and the template are dropped at the
end of the session. (Creating and dropping a database per test costs about two seconds on a
server with fsync on, which would dominate any suite.) Without the variable, where ``initdb``
and ``pg_ctl`` are on PATH (and the user is not root, which initdb refuses), a throwaway
cluster is started in a temporary directory on a free port and stopped at the end of the
session. Otherwise the PostgreSQL lane is skipped with the reason; ``HARU_REQUIRE_POSTGRES=1``
turns that skip into a failure (CI must run the lane).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar, cast

import psycopg
import pytest
from haru_protocol import DomainState
from psycopg import sql
from sqlalchemy.engine import make_url

from haru_db._migrate import head_revision, upgrade
from haru_db._store import StateStore
from haru_db._tables import metadata
from haru_db._urls import redact_database_url, resolve_database_url

TEST_DATABASE_URL_ENV = "HARU_TEST_DATABASE_URL"
REQUIRE_POSTGRES_ENV = "HARU_REQUIRE_POSTGRES"

Lane = Literal["sqlite", "postgres"]
DatabaseUrlFactory = Callable[[], Awaitable[str]]
"""``await factory()`` -> the URL of a fresh, migrated database."""

_T = TypeVar("_T")

_F = TypeVar("_F", bound=Callable[..., Any])


def _async_fixture(fn: _F) -> _F:
    # Loading this plugin must never break a pytest run, even one without pytest-asyncio
    # (haru-db installed without its [testing] extra): only these fixtures need it.
    if importlib.util.find_spec("pytest_asyncio") is None:  # pragma: no cover
        return cast("_F", pytest.fixture(fn))
    import pytest_asyncio

    return cast("_F", pytest_asyncio.fixture(fn))


_LANES = (
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
)
_POSTGRES_FIXTURES = frozenset({"postgres_store", "postgres_url_factory"})
_CLUSTER_TIMEOUT_S = 120


def pytest_configure(config: pytest.Config) -> None:
    """Declare the ``postgres`` marker (for packages whose config does not)."""
    config.addinivalue_line(
        "markers",
        "postgres: runs against PostgreSQL (HARU_TEST_DATABASE_URL or a throwaway cluster)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests that use a PostgreSQL-only fixture ``postgres`` (so ``-m`` selects them)."""
    for item in items:
        if _POSTGRES_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.postgres)


def _run_coroutine(coro: Coroutine[Any, Any, _T]) -> _T:
    # Session set-up runs outside any test's event loop; a private thread keeps asyncio.run
    # from touching the loop state pytest-asyncio manages on the main thread.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="haru-db-setup") as pool:
        return pool.submit(asyncio.run, coro).result()


def _require_postgres() -> bool:
    return os.environ.get(REQUIRE_POSTGRES_ENV, "").strip() not in ("", "0", "false", "no")


def _unavailable(reason: str) -> NoReturn:
    if _require_postgres():
        pytest.fail(
            f"{REQUIRE_POSTGRES_ENV} is set but the PostgreSQL lane is unavailable: {reason}"
        )
    pytest.skip(f"PostgreSQL lane skipped: {reason}")


# ---- SQLite -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def haru_sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file, built once per session; tests get copies of it."""
    path = tmp_path_factory.mktemp("haru-sqlite-template") / "template.db"
    _run_coroutine(upgrade(str(path)))
    return path


@pytest.fixture
def sqlite_url_factory(haru_sqlite_template: Path, tmp_path: Path) -> DatabaseUrlFactory:
    """An async factory of fresh migrated SQLite files in ``tmp_path`` (returns the URL)."""
    counter = iter(range(1_000_000))

    async def factory() -> str:
        target = tmp_path / f"haru-{next(counter)}.db"
        # The template was closed cleanly (no -wal file), so the main file is the database.
        await asyncio.to_thread(shutil.copyfile, haru_sqlite_template, target)
        return resolve_database_url(str(target))

    return factory


# ---- PostgreSQL -------------------------------------------------------------------------------


@dataclass
class _Cluster:
    pg_ctl: str
    data_dir: Path
    admin_url: str

    def stop(self) -> None:
        subprocess.run(
            [self.pg_ctl, "-D", str(self.data_dir), "-m", "immediate", "-w", "stop"],
            check=False,
            capture_output=True,
            timeout=_CLUSTER_TIMEOUT_S,
        )


@dataclass
class PostgresProvision:
    """The session's PostgreSQL server and its pool of migrated test databases."""

    admin_url: str | None = None
    """libpq URL of the maintenance database (may carry a password: never log it raw)."""
    template: str | None = None
    """Name of the migrated template database."""
    server_version: int = 0
    unavailable_reason: str | None = None
    cluster: _Cluster | None = field(default=None, repr=False)
    free: list[str] = field(default_factory=list)
    """Clean databases ready for the next test."""
    databases: set[str] = field(default_factory=set)
    """Every database created this session (dropped at its end)."""

    def database_url(self, name: str) -> str:
        """The haru-db URL of database ``name`` on this server."""
        if self.admin_url is None:  # pragma: no cover - guarded by callers
            raise RuntimeError("no PostgreSQL server")
        return resolve_database_url(
            make_url(self.admin_url).set(database=name).render_as_string(hide_password=False)
        )

    async def acquire(self) -> str:
        """A clean migrated database: a recycled one, or a new copy of the template."""
        if self.free:
            return self.free.pop()
        name = f"haru_test_{secrets.token_hex(8)}"
        conn = await psycopg.AsyncConnection.connect(
            _libpq_url(str(self.admin_url)), autocommit=True, connect_timeout=10
        )
        async with conn:
            await conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(str(self.template))
                )
            )
        self.databases.add(name)
        return name

    def release(self, name: str) -> None:
        """Empty a database a test used and pool it, or drop it when its schema changed."""
        admin_url = str(self.admin_url)
        with _admin(admin_url) as conn:
            # A test that leaked an engine must not see the next test's rows.
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
        try:
            reset = _reset(self.database_url(name))
        except psycopg.Error:
            reset = False
        if not reset:
            # Downgraded, or tables dropped: not worth repairing, a fresh copy is cheaper.
            with _admin(admin_url) as conn:
                _drop_database(conn, name, server_version=self.server_version)
            self.databases.discard(name)
            return
        self.free.append(name)


def _reset(url: str) -> bool:
    """Empty a test database; False when its schema is no longer the head revision."""
    with (
        psycopg.connect(_libpq_url(url), autocommit=True, connect_timeout=10) as conn,
        conn.transaction(),
    ):
        revision = conn.execute("SELECT version_num FROM alembic_version").fetchall()
        if revision != [(head_revision(),)]:
            return False
        conn.execute(_RESET_SQL)
    return True


# Emptying five small tables costs milliseconds; CREATE/DROP DATABASE costs about a second
# each on a server with fsync on, which would dominate the suite. The pointer is cleared first
# because fleets and domains reference each other.
# Table names come from the package's own metadata, never from input.
_RESET_SQL = " ".join(
    [
        "UPDATE fleets SET active_domain_id = NULL;",
        *(f"DELETE FROM {t.name};" for t in reversed(metadata.sorted_tables)),  # noqa: S608
        "SELECT setval(pg_get_serial_sequence('events', 'id'), 1, false);",
    ]
)


def _libpq_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_cluster(base: Path) -> _Cluster | str:
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb is None or pg_ctl is None:
        return f"{TEST_DATABASE_URL_ENV} is unset and initdb/pg_ctl are not on PATH"
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return f"{TEST_DATABASE_URL_ENV} is unset and initdb refuses to run as root"
    data_dir, socket_dir = base / "data", base / "socket"
    socket_dir.mkdir()
    init = subprocess.run(
        [
            initdb,
            "-D",
            str(data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=_CLUSTER_TIMEOUT_S,
    )
    if init.returncode != 0:
        return f"initdb failed: {init.stderr.strip()[-500:]}"
    port = _free_port()
    options = (
        f"-p {port} -k {socket_dir} -c listen_addresses=127.0.0.1 -c fsync=off "
        "-c synchronous_commit=off -c full_page_writes=off"
    )
    start = subprocess.run(
        [
            pg_ctl,
            "-D",
            str(data_dir),
            "-l",
            str(base / "postgres.log"),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=_CLUSTER_TIMEOUT_S,
    )
    cluster = _Cluster(pg_ctl, data_dir, f"postgresql://postgres@127.0.0.1:{port}/postgres")
    if start.returncode != 0:
        cluster.stop()
        log = (base / "postgres.log").read_text(errors="replace")[-500:]
        return f"pg_ctl start failed: {start.stderr.strip()[-300:]} {log}"
    return cluster


def _admin(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(_libpq_url(url), autocommit=True, connect_timeout=10)


def _drop_database(conn: psycopg.Connection[Any], name: str, *, server_version: int) -> None:
    ident = sql.Identifier(name)
    if server_version >= 130000:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
        return
    conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
    )
    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(ident))


def _provision(base: Path) -> PostgresProvision:
    configured = os.environ.get(TEST_DATABASE_URL_ENV, "").strip()
    cluster: _Cluster | None = None
    if configured:
        admin_url = resolve_database_url(configured)
        if not admin_url.startswith("postgresql"):
            raise pytest.UsageError(f"{TEST_DATABASE_URL_ENV} must be a PostgreSQL URL")
    else:
        started = _start_cluster(base)
        if isinstance(started, str):
            return PostgresProvision(unavailable_reason=started)
        cluster = started
        admin_url = started.admin_url
    template = f"haru_template_{secrets.token_hex(6)}"
    try:
        with _admin(admin_url) as conn:
            version = conn.info.server_version
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(template)))
        provision = PostgresProvision(
            admin_url=admin_url, template=template, server_version=version, cluster=cluster
        )
        _run_coroutine(upgrade(provision.database_url(template)))
        with _admin(admin_url) as conn:
            # No connection may touch a template while it is being copied.
            conn.execute(
                sql.SQL("ALTER DATABASE {} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false").format(
                    sql.Identifier(template)
                )
            )
    except BaseException as exc:
        if cluster is not None:
            cluster.stop()
        if isinstance(exc, psycopg.OperationalError):
            raise pytest.UsageError(
                f"cannot use PostgreSQL at {redact_database_url(admin_url)}: {exc}"
            ) from exc
        raise
    return provision


def _release(provision: PostgresProvision) -> None:
    try:
        if provision.admin_url is not None and provision.template is not None:
            with _admin(provision.admin_url) as conn:
                for name in sorted(provision.databases):
                    _drop_database(conn, name, server_version=provision.server_version)
                conn.execute(
                    sql.SQL("ALTER DATABASE {} WITH IS_TEMPLATE false").format(
                        sql.Identifier(provision.template)
                    )
                )
                _drop_database(conn, provision.template, server_version=provision.server_version)
    finally:
        if provision.cluster is not None:
            provision.cluster.stop()


@pytest.fixture(scope="session")
def haru_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresProvision]:
    """The session's PostgreSQL server and migrated template (lazily, on first use)."""
    provision = _provision(tmp_path_factory.mktemp("haru-postgres"))
    try:
        yield provision
    finally:
        _release(provision)


@pytest.fixture
def postgres_url_factory(haru_postgres: PostgresProvision) -> Iterator[DatabaseUrlFactory]:
    """An async factory of clean migrated PostgreSQL databases (returns the URL).

    Skips (or fails, with ``HARU_REQUIRE_POSTGRES=1``) when no server is available.
    """
    if haru_postgres.unavailable_reason is not None or haru_postgres.admin_url is None:
        _unavailable(haru_postgres.unavailable_reason or "no server")
    used: list[str] = []

    async def factory() -> str:
        name = await haru_postgres.acquire()
        used.append(name)
        return haru_postgres.database_url(name)

    yield factory
    for name in used:
        haru_postgres.release(name)


# ---- lanes and stores -------------------------------------------------------------------------


@pytest.fixture(params=_LANES)
def haru_db_lane(request: pytest.FixtureRequest) -> Lane:
    """The engine this test runs on: ``"sqlite"`` or ``"postgres"``."""
    lane: Lane = request.param
    return lane


@pytest.fixture
def database_url_factory(haru_db_lane: Lane, request: pytest.FixtureRequest) -> DatabaseUrlFactory:
    """An async factory of fresh migrated databases of the test's lane (returns the URL)."""
    factory: DatabaseUrlFactory = request.getfixturevalue(f"{haru_db_lane}_url_factory")
    return factory


@contextlib.asynccontextmanager
async def _open_store(factory: DatabaseUrlFactory) -> AsyncIterator[StateStore]:
    store = StateStore.open(await factory())
    try:
        yield store
    finally:
        await store.close()


@_async_fixture
async def store(database_url_factory: DatabaseUrlFactory) -> AsyncIterator[StateStore]:
    """A :class:`~haru_db.StateStore` on a fresh migrated database, on each lane."""
    async with _open_store(database_url_factory) as opened:
        yield opened


@_async_fixture
async def sqlite_store(sqlite_url_factory: DatabaseUrlFactory) -> AsyncIterator[StateStore]:
    """A :class:`~haru_db.StateStore` on a fresh migrated SQLite file."""
    async with _open_store(sqlite_url_factory) as opened:
        yield opened


@_async_fixture
async def postgres_store(postgres_url_factory: DatabaseUrlFactory) -> AsyncIterator[StateStore]:
    """A :class:`~haru_db.StateStore` on a fresh migrated PostgreSQL database."""
    async with _open_store(postgres_url_factory) as opened:
        yield opened


async def confirm_domains(store: StateStore, fleet_ref: str, *, at: datetime) -> None:
    """Move every ``provisioning`` domain of the fleet to ``ready``.

    What the first good heartbeat of each domain does; for tests that route or promote right
    after applying a layout without running supervisors.
    """
    snapshot = await store.get_fleet_snapshot(fleet_ref)
    if snapshot is None:
        raise LookupError(f"fleet {fleet_ref!r} not found")
    for domain in snapshot.domains:
        await store.transition_domain(
            domain.id, from_states=[DomainState.PROVISIONING], to=DomainState.READY, at=at
        )
