"""A rolling upgrade: a newer release migrates the shared store while this one still runs.

The newer release's migration is a schema revision this code does not know (what an old server
sees after the new one migrated). The old server must then stop acting, not only fail
``/readyz``: its reconcile ticks are refused before they read or write anything, and it resumes
once the store carries a known revision again (``haru db downgrade``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from haru_db import SchemaTooNewError, StateStore, head_revision
from haru_server._schema_gate import SchemaGate
from haru_server.api import Settings, create_app
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

NEWER = "ffffffffffff"
"""A revision no release of this code knows: the next release's migration."""

AiohttpClient = Callable[..., Awaitable[TestClient[web.Request, web.Application]]]


async def stamp(store: StateStore, revision: str) -> None:
    """Set the store's schema revision, as a migration of another release does."""
    engine = create_async_engine(store.url)
    try:
        async with engine.begin() as connection:
            await connection.execute(
                text("UPDATE alembic_version SET version_num = :rev"), {"rev": revision}
            )
    finally:
        await engine.dispose()


async def test_an_old_server_stops_reconciling_once_a_newer_release_migrated(
    store: StateStore, clock: Any, make_fleet: Any, helpers: Any, aiohttp_client: AiohttpClient
) -> None:
    fleet = await make_fleet()
    await helpers.seed(store, fleet, clock)
    old = await aiohttp_client(
        create_app(Settings(reconcile_interval_ms=None), store=store, clock=clock)
    )

    async def reconcile() -> tuple[int, dict[str, Any]]:
        clock.advance(seconds=1)
        response = await old.post("/v1/fleets/local/reconcile")
        body: dict[str, Any] = await response.json()
        return response.status, body

    assert (await reconcile())[0] == 200
    assert (await old.get("/readyz")).status == 200

    await stamp(store, NEWER)  # the new release's servers migrated the store
    readiness = await old.get("/readyz")
    assert readiness.status == 503
    before = await store.get_fleet_snapshot("local")
    status, body = await reconcile()
    assert status == 503
    assert body["error"]["code"] == "not_ready"
    assert "newer than this release" in body["error"]["message"]
    # Nothing was written: no heartbeat recorded, no state moved.
    assert await store.get_fleet_snapshot("local") == before

    await stamp(store, head_revision())  # rolled back: `haru db downgrade` to this release's
    assert (await old.get("/readyz")).status == 200
    assert (await reconcile())[0] == 200
    after = await store.get_fleet_snapshot("local")
    assert after is not None
    assert after != before


async def test_an_old_server_refuses_api_writes_once_a_newer_release_migrated(
    store: StateStore, clock: Any, make_fleet: Any, helpers: Any, aiohttp_client: AiohttpClient
) -> None:
    fleet = await make_fleet()
    seeded = await helpers.seed(store, fleet, clock)
    old = await aiohttp_client(
        create_app(Settings(reconcile_interval_ms=None), store=store, clock=clock)
    )
    beta = next(d for d in seeded.domains if d.slug == "beta")
    layout = {"layout": fleet.layout().model_dump(mode="json", by_alias=True)}
    writes: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v1/fleets/local/promote", {"targetDomainId": str(beta.id)}),
        ("POST", "/v1/fleets/local/demote", {"targetDomainId": str(beta.id)}),
        ("PATCH", "/v1/fleets/local/policy", {"heartbeatStaleMs": 9000}),
        ("POST", "/v1/fleets/local/apply", layout),
        ("POST", "/v1/fleets/local/domains/beta/up", {}),
        ("POST", "/v1/fleets/local/domains/beta/down", {}),
    ]

    await stamp(store, NEWER)  # the new release's servers migrated the store
    assert (await old.get("/readyz")).status == 503
    before = await store.get_fleet_snapshot("local")
    events = await store.list_events(seeded.id, limit=1000)
    for method, path, body in writes:
        response = await old.request(method, path, json=body)
        answer = await response.json()
        assert response.status == 503, (path, answer)
        assert answer["error"]["code"] == "not_ready", path
        assert "newer than this release" in answer["error"]["message"], path
    # Nothing was written: no operation, no policy, no event.
    assert await store.get_fleet_snapshot("local") == before
    assert await store.get_in_flight_operation(seeded.id) is None
    assert await store.list_events(seeded.id, limit=1000) == events
    # Reads still answer, a dry run included (it writes nothing).
    dry = await old.post("/v1/fleets/local/apply", json={**layout, "dryRun": True})
    assert dry.status == 200, await dry.text()

    await stamp(store, head_revision())  # rolled back: `haru db downgrade` to this release's
    assert (await old.get("/readyz")).status == 200
    policy = await old.patch("/v1/fleets/local/policy", json={"heartbeatStaleMs": 9000})
    assert policy.status == 200, await policy.text()


class _Now:
    def __init__(self) -> None:
        self.value = 0.0

    def __call__(self) -> float:
        return self.value


async def test_the_gate_rereads_the_revision_on_its_own_interval() -> None:
    now = _Now()
    answers: list[BaseException | None] = [None, SchemaTooNewError(NEWER), None]
    calls: list[str] = []

    async def check(url: str) -> None:
        calls.append(url)
        answer = answers[len(calls) - 1]
        if answer is not None:
            raise answer

    gate = SchemaGate("sqlite:///x.db", interval_s=5, monotonic=now, check=check)
    await gate.check()
    now.value = 4.9
    await gate.check()  # within the interval: not read again
    assert len(calls) == 1
    now.value = 5.0
    with pytest.raises(Exception, match="newer than this release") as refused:
        await gate.check()
    assert type(refused.value).__name__ == "SchemaNewerError"
    now.value = 7.0
    with pytest.raises(Exception, match="newer"):
        await gate.check()  # still refused, not read again
    now.value = 10.0
    await gate.check()  # known again
    assert gate.refusal is None
    assert len(calls) == 3
