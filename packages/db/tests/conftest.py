"""Shared fixtures of haru-db's tests (the database fixtures come from haru_db.testing)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from datetime import UTC, datetime
from typing import Any

import pytest
import pytest_asyncio
from haru_db import StateStore
from haru_db._engine import create_engine
from haru_protocol import DomainState, FleetLayout, FleetSnapshot
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

LayoutFactory = Callable[..., FleetLayout]


def _inference(gpu: int, *models: str) -> dict[str, Any]:
    return {
        "kind": "inference",
        "gpuIndex": gpu,
        "models": [{"name": m, "servingUrl": f"http://127.0.0.1:9000/{m}"} for m in models],
    }


def _training(gpu: int) -> dict[str, Any]:
    return {
        "kind": "training",
        "gpuIndex": gpu,
        "command": ["python", "-m", "trainer"],
        "checkpointDir": f"/var/lib/haru/ckpt-{gpu}",
    }


def _domain(
    slug: str, *, provider: str = "static", slots: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    document: dict[str, Any] = {
        "slug": slug,
        "provider": provider,
        "placement": {"cloud": "aws", "region": "us-east-1", "accelerator": "EXAMPLE-GPU"},
        "supervisorUrl": f"http://{slug}.internal:8701",
        "servingBaseUrl": f"http://{slug}.internal:8000",
        "slots": slots
        if slots is not None
        else [
            _inference(0, f"{slug}-small", f"{slug}-medium"),
            _training(0),
            _inference(1, f"{slug}-large"),
            _training(1),
        ],
    }
    if provider != "static":
        # Haru records a provisioned domain's URLs once its machine is up.
        del document["supervisorUrl"], document["servingBaseUrl"]
        for slot in document["slots"]:
            for model in slot.get("models", ()):
                model.pop("servingUrl", None)
    return document


@pytest.fixture
def now() -> datetime:
    """The app clock of a test (fixed: the database clock is never used)."""
    return datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


@pytest.fixture
def make_layout() -> LayoutFactory:
    """``make_layout(slug="f", active="alpha", domains=[...], policy=None)`` -> FleetLayout.

    ``domains`` items are slugs (a default static domain with four slots) or raw dicts.
    """

    def factory(
        slug: str = "fleet",
        *,
        active: str | None = "alpha",
        domains: list[str | dict[str, Any]] | None = None,
        policy: dict[str, Any] | None = None,
        display_name: str | None = "Test fleet",
    ) -> FleetLayout:
        items = domains if domains is not None else ["alpha", "beta"]
        document: dict[str, Any] = {
            "slug": slug,
            "domains": [_domain(d) if isinstance(d, str) else d for d in items],
        }
        if active is not None:
            document["activeDomainSlug"] = active
        if policy is not None:
            document["policy"] = policy
        if display_name is not None:
            document["displayName"] = display_name
        return FleetLayout.model_validate(document)

    return factory


@pytest.fixture
def domain_document() -> Callable[..., dict[str, Any]]:
    """``domain_document(slug, provider=..., slots=[...])`` -> a raw layout domain."""
    return _domain


@pytest.fixture
def slot_document() -> Callable[..., dict[str, Any]]:
    """``slot_document("inference", gpu, *models)`` or ``slot_document("training", gpu)``."""

    def factory(kind: str, gpu: int, *models: str) -> dict[str, Any]:
        return _inference(gpu, *models) if kind == "inference" else _training(gpu)

    return factory


@pytest.fixture
def fleet_layout(make_layout: LayoutFactory) -> FleetLayout:
    """The default two-domain layout (slug ``fleet``, alpha declared active)."""
    return make_layout()


@pytest_asyncio.fixture
async def fleet(store: StateStore, make_layout: LayoutFactory, now: datetime) -> FleetSnapshot:
    """A two-domain fleet (alpha active and serving, beta standby asleep), applied and then
    confirmed ready (what the first good heartbeat of each domain does)."""
    await store.apply_fleet_layout(make_layout(), at=now)
    applied = await store.get_fleet_snapshot("fleet")
    assert applied is not None
    for domain in applied.domains:
        assert await store.transition_domain(
            domain.id, from_states=[DomainState.PROVISIONING], to=DomainState.READY, at=now
        )
    snapshot = await store.get_fleet_snapshot("fleet")
    assert snapshot is not None
    return snapshot


@pytest_asyncio.fixture
async def raw_engine(store: StateStore) -> AsyncIterator[AsyncEngine]:
    """A second engine on the store's database, to force rows the API would never write."""
    engine = create_engine(store.url)
    try:
        yield engine
    finally:
        await engine.dispose()


RefuseEvents = Callable[[str], AbstractAsyncContextManager[None]]
"""``refuse_events(type_)``: while it is entered the database refuses any event of ``type_``."""


@pytest.fixture
def refuse_events(raw_engine: AsyncEngine) -> RefuseEvents:
    """A failure injected into the event write: a trigger that refuses one event type."""

    @asynccontextmanager
    async def refused(type_: str) -> AsyncIterator[None]:
        postgres = raw_engine.dialect.name == "postgresql"
        create = (
            [
                "CREATE FUNCTION test_refuse_event() RETURNS trigger LANGUAGE plpgsql AS $$ "
                "BEGIN RAISE EXCEPTION 'event refused'; END $$",
                "CREATE TRIGGER test_refuse_event BEFORE INSERT ON events FOR EACH ROW "
                f"WHEN (NEW.type = '{type_}') EXECUTE FUNCTION test_refuse_event()",
            ]
            if postgres
            else [
                "CREATE TRIGGER test_refuse_event BEFORE INSERT ON events FOR EACH ROW "
                f"WHEN NEW.type = '{type_}' BEGIN SELECT RAISE(ABORT, 'event refused'); END"
            ]
        )
        drop = (
            ["DROP TRIGGER test_refuse_event ON events", "DROP FUNCTION test_refuse_event()"]
            if postgres
            else ["DROP TRIGGER test_refuse_event"]
        )
        async with raw_engine.begin() as conn:
            for ddl in create:
                await conn.exec_driver_sql(ddl)
        try:
            yield
        finally:
            async with raw_engine.begin() as conn:
                for ddl in drop:
                    await conn.exec_driver_sql(ddl)

    return refused


StatementWrites = Callable[[StateStore], AbstractContextManager[list[str]]]
"""``with statement_writes(store) as seen``: the first word of each statement that is no read."""


@pytest.fixture
def statement_writes() -> StatementWrites:
    """Records the statements a store runs that are not a plain ``SELECT``, while entered."""

    @contextmanager
    def recorded(store: StateStore) -> Iterator[list[str]]:
        seen: list[str] = []
        target = store._ex.engine.sync_engine

        def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            word = statement.split()[0].upper()
            if word != "SELECT":
                seen.append(word)

        event.listen(target, "before_cursor_execute", record)
        try:
            yield seen
        finally:
            event.remove(target, "before_cursor_execute", record)

    return recorded


WriteStarted = Callable[[StateStore], AbstractContextManager[asyncio.Event]]
"""``with write_started(store) as started``: set once a store's write began inside SQLite."""


@pytest.fixture
def write_started() -> WriteStarted:
    """An event set when one of the store's writes has begun running inside SQLite itself.

    SQLite calls its trace callback as a statement starts to run, before the statement takes
    any lock (``sqlite3_trace_v2``, ``SQLITE_TRACE_STMT``). A lock holder that lets go only
    after this event knows the write met its lock: it can only finish by waiting for it. The
    callback runs in aiosqlite's thread, so it sets the event through the loop.
    """

    @contextmanager
    def watched(store: StateStore) -> Iterator[asyncio.Event]:
        started = asyncio.Event()
        loop = asyncio.get_running_loop()
        pool = store._ex.engine.sync_engine.pool

        def traced(statement: str) -> None:
            if statement.split()[0].upper() in {"BEGIN", "INSERT", "UPDATE", "DELETE", "WITH"}:
                loop.call_soon_threadsafe(started.set)

        def trace(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
            dbapi_connection.run_async(lambda conn: conn.set_trace_callback(traced))

        def untrace(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.run_async(lambda conn: conn.set_trace_callback(None))

        event.listen(pool, "checkout", trace)
        event.listen(pool, "checkin", untrace)
        try:
            yield started
        finally:
            event.remove(pool, "checkout", trace)
            event.remove(pool, "checkin", untrace)

    return watched
