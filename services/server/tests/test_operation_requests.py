"""A requested operation and the event that says who asked for it are one statement: through
the API, a request whose event the database refuses leaves no operation behind, and a joined
request adds no event. Both engines."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from haru_db import StateStore
from haru_db.testing import confirm_domains
from haru_protocol import FleetSnapshot, load_example_layout
from haru_server._app import create_app
from haru_server._clock import ManualClock
from haru_server._settings import Settings
from pydantic import SecretStr
from pytest_aiohttp import AiohttpClient
from sqlalchemy.ext.asyncio import create_async_engine

TOKEN = "api-token-123-0123456789"
REQUESTED = "operation.requested.promote"


@pytest.fixture
async def api(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> TestClient[web.Request, web.Application]:
    app = create_app(
        Settings(api_token=SecretStr(TOKEN), reconcile_interval_ms=None), store=store, clock=clock
    )
    return await aiohttp_client(app, headers={"Authorization": f"Bearer {TOKEN}"})


@pytest.fixture
async def example(store: StateStore, clock: ManualClock) -> FleetSnapshot:
    await store.apply_fleet_layout(load_example_layout(), at=clock())
    await confirm_domains(store, "example", at=clock())
    snapshot = await store.get_fleet_snapshot("example")
    assert snapshot is not None
    return snapshot


@pytest.fixture
async def events_refused(store: StateStore) -> AsyncIterator[None]:
    """The database refuses ``operation.requested.promote`` events while the test runs."""
    postgres = store.dialect == "postgresql"
    create = (
        [
            "CREATE FUNCTION test_refuse_event() RETURNS trigger LANGUAGE plpgsql AS $$ "
            "BEGIN RAISE EXCEPTION 'event refused'; END $$",
            "CREATE TRIGGER test_refuse_event BEFORE INSERT ON events FOR EACH ROW "
            f"WHEN (NEW.type = '{REQUESTED}') EXECUTE FUNCTION test_refuse_event()",
        ]
        if postgres
        else [
            "CREATE TRIGGER test_refuse_event BEFORE INSERT ON events FOR EACH ROW "
            f"WHEN NEW.type = '{REQUESTED}' BEGIN SELECT RAISE(ABORT, 'event refused'); END"
        ]
    )
    drop = (
        ["DROP TRIGGER test_refuse_event ON events", "DROP FUNCTION test_refuse_event()"]
        if postgres
        else ["DROP TRIGGER test_refuse_event"]
    )
    engine = create_async_engine(store.url)
    try:
        async with engine.begin() as conn:
            for ddl in create:
                await conn.exec_driver_sql(ddl)
        yield
        async with engine.begin() as conn:
            for ddl in drop:
                await conn.exec_driver_sql(ddl)
    finally:
        await engine.dispose()


async def _requested(store: StateStore, fleet: FleetSnapshot) -> list[dict[str, object]]:
    return [e.payload for e in await store.list_events(fleet.id) if e.type == REQUESTED]


async def test_a_request_whose_event_is_refused_creates_no_operation(
    api: TestClient[web.Request, web.Application],
    store: StateStore,
    example: FleetSnapshot,
    events_refused: None,
) -> None:
    beta = next(d.id for d in example.domains if d.slug == "beta")
    response = await api.post("/v1/fleets/example/promote", json={"targetDomainId": str(beta)})
    assert response.status >= 500
    # Before, the operation was inserted first and its event appended by a second statement.
    assert await store.get_in_flight_operation(example.id) is None
    assert await _requested(store, example) == []


async def test_a_created_request_has_its_event_and_a_joined_one_adds_none(
    api: TestClient[web.Request, web.Application], store: StateStore, example: FleetSnapshot
) -> None:
    beta = next(d.id for d in example.domains if d.slug == "beta")
    first = await api.post("/v1/fleets/example/promote", json={"targetDomainId": str(beta)})
    assert first.status == 202
    operation_id = (await first.json())["operation"]["id"]
    joined = await api.post("/v1/fleets/example/promote", json={"targetDomainId": str(beta)})
    assert joined.status == 202
    assert (await joined.json())["operation"]["id"] == operation_id
    events = [e for e in await store.list_events(example.id) if e.type == REQUESTED]
    assert [(str(e.operation_id), e.domain_id, e.payload) for e in events] == [
        (
            operation_id,
            beta,
            {
                "kind": "promote",
                "targetDomainId": str(beta),
                "sourceDomainId": str(example.active_domain_id),
            },
        )
    ]
