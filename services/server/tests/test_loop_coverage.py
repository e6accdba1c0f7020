"""Fleets outside the reconcile loop: refused operations, boot and snapshot warnings."""

from __future__ import annotations

import logging
from uuid import UUID

import pytest
from haru_db import StateStore
from haru_db.testing import confirm_domains
from haru_protocol import FleetSnapshot, PolicyPatch, load_example_layout
from haru_server._app import create_app
from haru_server._clock import ManualClock
from haru_server._settings import Settings
from pydantic import SecretStr
from pytest_aiohttp import AiohttpClient

TOKEN = "api-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def seed_two_fleets(store: StateStore, clock: ManualClock) -> tuple[UUID, UUID]:
    layout = load_example_layout()
    await store.apply_fleet_layout(layout, at=clock())
    second = layout.model_copy(update={"slug": "second", "policy": PolicyPatch(auto_failover=True)})
    await store.apply_fleet_layout(second, at=clock())
    for ref in ("example", "second"):
        await confirm_domains(store, ref, at=clock())
    ids = []
    for ref in ("example", "second"):
        snapshot = await store.get_fleet_snapshot(ref)
        assert snapshot is not None
        ids.append(next(d.id for d in snapshot.domains if d.id != snapshot.active_domain_id))
    return ids[0], ids[1]


async def test_operations_of_a_fleet_no_loop_drives_are_refused(
    store: StateStore,
    clock: ManualClock,
    aiohttp_client: AiohttpClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    example_standby, second_standby = await seed_two_fleets(store, clock)
    settings = Settings(
        api_token=SecretStr(TOKEN),
        default_fleet="example",
        reconcile_interval_ms=3_600_000,
        reconcile_fleets=("example",),
    )
    with caplog.at_level(logging.WARNING, logger="haru_server"):
        client = await aiohttp_client(create_app(settings, store=store, clock=clock), headers=AUTH)
    boot = [r.getMessage() for r in caplog.records if r.name == "haru_server._startup_checks"]
    assert any("second" in m and "autoFailover" in m for m in boot), boot
    # Accepting it would leave a 202 pending forever and block every other operation.
    response = await client.post(
        "/v1/fleets/second/promote", json={"targetDomainId": str(second_standby)}
    )
    assert response.status == 409
    body = await response.json()
    assert body["error"]["code"] == "fleet_not_reconciled"
    assert "HARU_RECONCILE_FLEETS" in body["error"]["message"]
    response = await client.post(
        "/v1/fleets/second/demote", json={"targetDomainId": str(second_standby)}
    )
    assert response.status == 409
    snapshot = FleetSnapshot.model_validate_json(
        await (await client.get("/v1/fleets/second")).read()
    )
    assert await store.get_in_flight_operation(snapshot.id) is None
    assert snapshot.reconciled is False
    assert len(snapshot.warnings) == 1
    assert "nothing fails over" in snapshot.warnings[0]
    # The fleet the loop drives is unaffected.
    response = await client.post(
        "/v1/fleets/example/promote", json={"targetDomainId": str(example_standby)}
    )
    assert response.status == 202
    snapshot = FleetSnapshot.model_validate_json(
        await (await client.get("/v1/fleets/example")).read()
    )
    assert snapshot.reconciled is True
    assert snapshot.warnings == ()


async def test_every_fleet_is_driven_by_default(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    _, second_standby = await seed_two_fleets(store, clock)
    settings = Settings.from_env(
        {
            "HARU_API_TOKEN": TOKEN,
            "HARU_DEFAULT_FLEET": "example",
            "HARU_RECONCILE_INTERVAL_MS": "3600000",
        }
    )
    client = await aiohttp_client(create_app(settings, store=store, clock=clock), headers=AUTH)
    snapshot = FleetSnapshot.model_validate_json(
        await (await client.get("/v1/fleets/second")).read()
    )
    assert snapshot.reconciled is True
    assert snapshot.warnings == ()
    response = await client.post(
        "/v1/fleets/second/promote", json={"targetDomainId": str(second_standby)}
    )
    assert response.status == 202


async def test_auto_failover_without_any_loop_is_flagged_in_the_snapshot(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    await seed_two_fleets(store, clock)
    client = await aiohttp_client(
        create_app(
            Settings(api_token=SecretStr(TOKEN), reconcile_interval_ms=None),
            store=store,
            clock=clock,
        ),
        headers=AUTH,
    )
    second = FleetSnapshot.model_validate_json(await (await client.get("/v1/fleets/second")).read())
    assert second.reconciled is None
    assert len(second.warnings) == 1
    assert "HARU_RECONCILE_INTERVAL_MS" in second.warnings[0]
    # The example layout has autoFailover on too.
    example = FleetSnapshot.model_validate_json(
        await (await client.get("/v1/fleets/example")).read()
    )
    assert example.warnings == second.warnings
