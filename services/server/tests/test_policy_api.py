"""``PATCH /v1/fleets/{ref}/policy``: validated, one CAS, evented, used by the next tick."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp.test_utils import TestClient
from haru_db import StateStore
from haru_demo.localfleet import LocalFleet
from haru_protocol import (
    DomainState,
    EventType,
    FleetPolicyChanged,
    FleetPolicyResponse,
    FleetSnapshot,
    Policy,
    PolicyPatch,
    ProbeSettings,
)
from haru_server._app import create_app
from haru_server._clock import ManualClock
from haru_server._settings import Settings
from pydantic import SecretStr
from pytest_aiohttp import AiohttpClient

TOKEN = "policy-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MakeFleet = Callable[..., Awaitable[LocalFleet]]


async def _client(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> TestClient[Any, Any]:
    # The test ticks itself (POST .../reconcile): no background loop.
    settings = Settings(api_token=SecretStr(TOKEN), reconcile_interval_ms=None)
    return await aiohttp_client(create_app(settings, store=store, clock=clock), headers=AUTH)


def _state(snapshot: FleetSnapshot, slug: str) -> DomainState:
    return next(d.state for d in snapshot.domains if d.slug == slug)


async def _policy_events(store: StateStore, fleet_id: Any) -> list[FleetPolicyChanged]:
    events = await store.list_events(fleet_id, limit=1000)
    found = [e.data for e in events if e.type == EventType.FLEET_POLICY_CHANGED]
    assert all(isinstance(e, FleetPolicyChanged) for e in found)
    return found  # type: ignore[return-value]


async def test_a_patch_sets_and_clears_keys_and_records_the_change(
    store: StateStore,
    clock: ManualClock,
    aiohttp_client: AiohttpClient,
    make_fleet: MakeFleet,
    helpers: Any,
) -> None:
    fleet = await make_fleet()
    seeded = await helpers.seed(
        store, fleet, clock, policy=PolicyPatch(auto_failover=True, wake_timeout_ms=5000)
    )
    client = await _client(store, clock, aiohttp_client)
    response = await client.patch(
        "/v1/fleets/local/policy",
        json={"degradedGraceMs": 2000, "wakeTimeoutMs": None, "probe": {"maxTokens": 8}},
    )
    assert response.status == 200, await response.text()
    answer = FleetPolicyResponse.model_validate_json(await response.read())
    expected = Policy(auto_failover=True, degraded_grace_ms=2000, probe=ProbeSettings(max_tokens=8))
    assert answer.policy == expected
    assert answer.patch == {
        "autoFailover": True,
        "degradedGraceMs": 2000,
        "probe": {"maxTokens": 8},
    }
    assert answer.changed == ("degradedGraceMs", "probe", "wakeTimeoutMs")
    shown = FleetSnapshot.model_validate_json(await (await client.get("/v1/fleets/local")).read())
    assert shown.policy == expected
    [event] = await _policy_events(store, seeded.id)
    assert event.old == {"autoFailover": True, "wakeTimeoutMs": 5000}
    assert event.new == answer.patch
    assert event.changed == answer.changed

    # The same values again: nothing changes, no event.
    again = await client.patch("/v1/fleets/local/policy", json={"degradedGraceMs": 2000})
    assert again.status == 200
    assert FleetPolicyResponse.model_validate_json(await again.read()).changed == ()
    assert len(await _policy_events(store, seeded.id)) == 1


async def test_bad_keys_and_values_are_refused_with_the_envelope(
    store: StateStore,
    clock: ManualClock,
    aiohttp_client: AiohttpClient,
    make_fleet: MakeFleet,
    helpers: Any,
) -> None:
    fleet = await make_fleet()
    seeded = await helpers.seed(store, fleet, clock)
    client = await _client(store, clock, aiohttp_client)
    for body, status in [
        ({"degradedGraceMS": 1000}, 400),  # misspelled key
        ({"degradedGraceMs": "1000"}, 400),  # a string, not an integer
        ({"degradedGraceMs": 0}, 400),
        ({"degradedGraceMs": -5}, 400),
        ({"autoFailover": "yes"}, 400),
        ({"probe": {"maxTokens": 100_000}}, 400),
        ([1, 2], 400),
    ]:
        response = await client.patch("/v1/fleets/local/policy", json=body)
        assert response.status == status, (body, await response.text())
        error = (await response.json())["error"]
        assert set(error) == {"code", "message"}
        assert error["code"] == "invalid_request"
    empty = await client.patch(
        "/v1/fleets/local/policy", data=b"", headers={"Content-Type": "application/json"}
    )
    assert empty.status == 400
    missing = await client.patch("/v1/fleets/nope/policy", json={"autoFailover": True})
    assert missing.status == 404
    assert (await missing.json())["error"]["code"] == "fleet_not_found"
    unauthenticated = await client.patch(
        "/v1/fleets/local/policy", json={"autoFailover": True}, headers={"Authorization": ""}
    )
    assert unauthenticated.status == 401
    assert await _policy_events(store, seeded.id) == []
    stored = await store.get_fleet_policy(seeded.id)
    assert stored is not None
    assert stored.patch == {}


async def test_the_next_tick_uses_the_new_policy(
    store: StateStore,
    clock: ManualClock,
    aiohttp_client: AiohttpClient,
    make_fleet: MakeFleet,
    helpers: Any,
) -> None:
    # The active degrades; without autoFailover nothing happens, and with the default grace
    # (60 s) it would wait a minute: a patch turning both on escalates it on the next tick.
    fleet = await make_fleet(training_gpus=())
    await helpers.seed(store, fleet, clock)
    client = await _client(store, clock, aiohttp_client)

    async def tick() -> FleetSnapshot:
        assert (await client.post("/v1/fleets/local/reconcile", json={})).status == 200
        snapshot = await store.get_fleet_snapshot("local")
        assert snapshot is not None
        return snapshot

    await tick()
    for sim in fleet.domain("alpha").sims.values():
        await sim.set_faults(refuse=True)
    await tick()
    clock.advance(ms=5_000)
    snapshot = await tick()
    assert _state(snapshot, "alpha") is DomainState.DEGRADED
    response = await client.patch(
        "/v1/fleets/local/policy", json={"autoFailover": True, "degradedGraceMs": 1000}
    )
    assert response.status == 200
    snapshot = await tick()
    assert _state(snapshot, "alpha") is DomainState.FAILED
    types = [e.type for e in await store.list_events(snapshot.id, limit=1000)]
    assert EventType.OPERATION_AUTO_FAILOVER in types
