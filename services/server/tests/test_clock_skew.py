"""Wall clocks of different processes never meet: stored times are the database's clock.

Real ``haru serve`` processes on one store (SQLite file and PostgreSQL), real supervisors and
emulated vLLM servers; a replica's clock is pushed hours ahead only through the
``HARU_CLOCK_OFFSET_FILE`` hook, and a time from the future is written with plain SQL, as a
replica with a fast clock (or an older release) would have left it.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path
from typing import Any
from uuid import UUID

import aiohttp
import sqlalchemy as sa
from haru_db import StateStore, resolve_database_url
from haru_db.testing import confirm_domains
from haru_demo.localfleet import LocalFleet
from haru_protocol import EventType, OperationState, PolicyPatch
from sqlalchemy.ext.asyncio import create_async_engine

MakeFleet = Callable[..., Awaitable[LocalFleet]]
UrlFactory = Callable[[], Awaitable[str]]
HaruServe = Callable[..., AbstractAsyncContextManager[Any]]
"""The ``haru_serve`` fixture: ``async with haru_serve(env) as server`` (a ServerProcess)."""

THREE_HOURS_MS = 3 * 3600 * 1000


def set_offset(path: Path, offset_ms: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{offset_ms}\n", encoding="utf-8")
    os.replace(tmp, path)


def replica_env(url: str, offset_file: Path) -> dict[str, str]:
    return {
        "DATABASE_URL": url,
        "PORT": "0",
        "HARU_RECONCILE_INTERVAL_MS": "200",
        "HARU_CLOCK_OFFSET_FILE": str(offset_file),
    }


async def seeded(store: StateStore, fleet: LocalFleet, policy: PolicyPatch | None = None) -> UUID:
    await store.apply_fleet_layout(fleet.layout(policy=policy), at=await store.database_now())
    snapshot = await store.get_fleet_snapshot("local")
    assert snapshot is not None
    return snapshot.id


async def wait_for_event(
    store: StateStore, fleet_id: UUID, type_: EventType, *, timeout_s: float = 30
) -> Any:
    async with asyncio.timeout(timeout_s):
        while True:
            for event in await store.list_events(fleet_id, limit=1000):
                if event.type == type_:
                    return event
            await asyncio.sleep(0.05)


def standbys(snapshot: Any) -> list[Any]:
    """The standbys of ``snapshot`` (the domains a demote may target)."""
    assert snapshot is not None
    return [d for d in snapshot.domains if d.id != snapshot.active_domain_id]


async def wait_for(check: Callable[[], Awaitable[bool]], *, timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.05)


async def test_a_replica_hours_ahead_refuses_to_act_and_stores_database_time(
    haru_serve: HaruServe, database_url_factory: UrlFactory, make_fleet: MakeFleet, tmp_path: Path
) -> None:
    url = await database_url_factory()
    store = StateStore.open(url)
    offset = tmp_path / "offset"
    set_offset(offset, THREE_HOURS_MS)
    try:
        fleet = await make_fleet()
        fleet_id = await seeded(store, fleet)
        await confirm_domains(store, "local", at=await store.database_now())
        beta = standbys(await store.get_fleet_snapshot("local"))[0].id
        async with AsyncExitStack() as stack:
            skewed = await stack.enter_async_context(haru_serve(replica_env(url, offset)))
            http = await stack.enter_async_context(aiohttp.ClientSession())
            # (a) It records that it stopped, once, and says why on /readyz and /metrics.
            skew_event = await wait_for_event(store, fleet_id, EventType.SERVER_CLOCK_SKEWED)
            assert skew_event.payload["skewMs"] > THREE_HOURS_MS - 60_000
            assert skew_event.payload["maxSkewMs"] == 2000
            async with http.get(f"{skewed.url}/readyz") as response:
                assert response.status == 503
                body = await response.json()
            assert body["error"]["code"] == "not_ready"
            assert "clock differs from the database's" in body["error"]["message"]
            async with http.get(f"{skewed.url}/metrics") as response:
                metrics = await response.text()
            gauge = re.search(r"^haru_clock_skew_seconds (\S+)$", metrics, re.MULTILINE)
            assert gauge is not None
            assert float(gauge.group(1)) > THREE_HOURS_MS / 1000 - 60
            async with http.post(f"{skewed.url}/v1/fleets/local/reconcile") as response:
                assert response.status == 503
                assert (await response.json())["error"]["code"] == "not_ready"
            # (b) What it writes carries the database's time, not its own.
            async with http.post(
                f"{skewed.url}/v1/fleets/local/demote", json={"targetDomainId": str(beta)}
            ) as response:
                assert response.status == 202, await response.text()
                operation_id = (await response.json())["operation"]["id"]
            db_now = await store.database_now()
            operation = await store.get_operation(UUID(operation_id))
            assert operation is not None
            assert operation.state is OperationState.PENDING  # nobody drives it: it refuses
            assert operation.created_at <= db_now
            assert skew_event.created_at <= db_now
            # Back within bounds: it says so once, and acts again (drives the demote).
            set_offset(offset, 0)
            await wait_for_event(store, fleet_id, EventType.SERVER_CLOCK_RECOVERED)

            async def ready() -> bool:
                async with http.get(f"{skewed.url}/readyz") as response:
                    return response.status == 200

            await wait_for(ready)

            async def driven() -> bool:
                fresh = await store.get_operation(UUID(operation_id))
                return fresh is not None and fresh.state is not OperationState.PENDING

            await wait_for(driven)
        types = [e.type for e in await store.list_events(fleet_id, limit=1000)]
        assert types.count(EventType.SERVER_CLOCK_SKEWED) == 1
        assert types.count(EventType.SERVER_CLOCK_RECOVERED) == 1
        assert "Traceback" not in skewed.log
    finally:
        await store.close()


async def test_a_skewed_replica_never_times_out_a_step_another_started(
    haru_serve: HaruServe, database_url_factory: UrlFactory, make_fleet: MakeFleet, tmp_path: Path
) -> None:
    url = await database_url_factory()
    store = StateStore.open(url)
    on_time, ahead = tmp_path / "offset-0", tmp_path / "offset-1"
    set_offset(on_time, 0)
    set_offset(ahead, THREE_HOURS_MS)
    try:
        # A wake that takes seconds: the skewed replica ticks while the step is in flight.
        fleet = await make_fleet(wake_latency_ms=3000)
        fleet_id = await seeded(store, fleet)
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(haru_serve(replica_env(url, on_time)))
            await stack.enter_async_context(haru_serve(replica_env(url, ahead)))
            http = await stack.enter_async_context(aiohttp.ClientSession())

            async def confirmed() -> bool:
                async with http.get(f"{first.url}/v1/fleets/local") as response:
                    body = await response.json()
                return all(d["state"] == "ready" for d in body["domains"])

            await wait_for(confirmed)
            snapshot = await store.get_fleet_snapshot("local")
            beta = standbys(snapshot)[0].id
            async with http.post(
                f"{first.url}/v1/fleets/local/promote", json={"targetDomainId": str(beta)}
            ) as response:
                assert response.status == 202, await response.text()
                operation_id = UUID((await response.json())["operation"]["id"])

            async def finished() -> bool:
                operation = await store.get_operation(operation_id)
                assert operation is not None
                return operation.state not in (OperationState.PENDING, OperationState.RUNNING)

            await wait_for(finished, timeout_s=60)
        operation = await store.get_operation(operation_id)
        assert operation is not None
        assert operation.state is OperationState.SUCCEEDED, operation.error
        types = [e.type for e in await store.list_events(fleet_id, limit=1000)]
        assert EventType.OPERATION_STEP_TIMEOUT_BEST_EFFORT not in types
        # No stored time lies ahead of the database's clock.
        db_now = await store.database_now()
        after = await store.get_fleet_snapshot("local")
        assert after is not None
        for domain in after.domains:
            assert domain.last_seen_at is None or domain.last_seen_at <= db_now
            assert domain.state_updated_at <= db_now
        assert operation.finished_at is not None
        assert operation.finished_at <= db_now
    finally:
        await store.close()


async def test_a_heartbeat_stored_hours_ahead_does_not_delay_failover(
    haru_serve: HaruServe, database_url_factory: UrlFactory, make_fleet: MakeFleet, tmp_path: Path
) -> None:
    url = await database_url_factory()
    store = StateStore.open(url)
    offset = tmp_path / "offset"
    set_offset(offset, 0)
    # Escalation of a degraded active is far off: only staleness can fail it over.
    policy = PolicyPatch(auto_failover=True, heartbeat_stale_ms=1500, degraded_grace_ms=600_000)
    try:
        fleet = await make_fleet()
        fleet_id = await seeded(store, fleet, policy)
        async with AsyncExitStack() as stack:
            server = await stack.enter_async_context(haru_serve(replica_env(url, offset)))
            http = await stack.enter_async_context(aiohttp.ClientSession())

            async def confirmed() -> bool:
                async with http.get(f"{server.url}/v1/fleets/local") as response:
                    body = await response.json()
                return all(d["state"] == "ready" for d in body["domains"])

            await wait_for(confirmed)
            # The active goes down, and its last heartbeat was stored by a clock 3 h fast.
            await fleet.stop_supervisor("alpha")
            await write_future_heartbeat(url, "alpha")
            stored = await store.get_fleet_snapshot("local")
            assert stored is not None
            alpha = next(d for d in stored.domains if d.slug == "alpha")
            assert alpha.last_seen_at is not None
            assert alpha.last_seen_at > await store.database_now()
            event = await wait_for_event(store, fleet_id, EventType.OPERATION_AUTO_FAILOVER)
        assert event.payload["reason"] == "active_stale"
        assert event.payload["activeDomainId"] == str(alpha.id)
        assert "Traceback" not in server.log
    finally:
        await store.close()


async def write_future_heartbeat(url: str, slug: str) -> None:
    """``lastSeenAt`` three hours ahead of the database's clock, in the database's own SQL."""
    resolved = resolve_database_url(url)
    if resolved.startswith("sqlite"):
        # SQLAlchemy's stored form: microseconds, six digits (SQLite's %f has three).
        value = "strftime('%Y-%m-%d %H:%M:%f000', 'now', '+3 hours')"
    else:
        value = "clock_timestamp() + interval '3 hours'"
    engine = create_async_engine(resolved)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                # ``value`` is one of the two constant expressions above.
                sa.text(f"UPDATE domains SET last_seen_at = {value} WHERE slug = :slug"),  # noqa: S608
                {"slug": slug},
            )
    finally:
        await engine.dispose()
