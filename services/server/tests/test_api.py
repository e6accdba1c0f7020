"""The control API of DESIGN 7.2 over a real aiohttp server: every route, status and envelope."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from uuid import UUID, uuid4

import pytest
import sqlalchemy as sa
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient
from haru_core import lease_guard_ms
from haru_db import StateStore
from haru_db.testing import DatabaseUrlFactory, confirm_domains
from haru_demo.localfleet import LocalFleet
from haru_protocol import (
    DomainState,
    EventList,
    EventType,
    FleetLayoutApplied,
    FleetSnapshot,
    OperationKind,
    UntypedEventPayload,
    load_example_layout,
)
from haru_server._app import create_app
from haru_server._clock import ManualClock
from haru_server._keys import store_key
from haru_server._settings import Settings
from haru_server.cli import format_event
from haru_web import error_middleware
from pydantic import SecretStr
from pytest_aiohttp import AiohttpClient, AiohttpServer
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import QueuePool

MakeFleet = Callable[..., Awaitable[LocalFleet]]

TOKEN = "api-token-123-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}


async def example(store: StateStore, clock: ManualClock) -> FleetSnapshot:
    await store.apply_fleet_layout(load_example_layout(), at=clock())
    await confirm_domains(store, "example", at=clock())
    snapshot = await store.get_fleet_snapshot("example")
    assert snapshot is not None
    return snapshot


def domain_id(snapshot: FleetSnapshot, slug: str) -> UUID:
    return next(d.id for d in snapshot.domains if d.slug == slug)


@pytest.fixture
async def api(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> TestClient[web.Request, web.Application]:
    app = create_app(
        Settings(api_token=SecretStr(TOKEN), reconcile_interval_ms=None), store=store, clock=clock
    )
    return await aiohttp_client(app, headers=AUTH)


async def error_of(response: ClientResponse) -> tuple[int, str, str]:
    body = await response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message"}
    return response.status, body["error"]["code"], body["error"]["message"]


# ---- health and auth -------------------------------------------------------------------------


async def test_healthz_is_open_and_never_touches_the_database(
    aiohttp_client: AiohttpClient, clock: ManualClock
) -> None:
    broken = StateStore.open("postgresql://haru@127.0.0.1:1/haru")
    app = create_app(
        Settings(api_token=SecretStr(TOKEN), reconcile_interval_ms=None), store=broken, clock=clock
    )
    client = await aiohttp_client(app)
    response = await client.get("/healthz")
    assert response.status == 200
    assert await response.json() == {"ok": True}
    # The same store fails every real route: healthz answered without it.
    response = await client.get("/v1/fleets", headers=AUTH)
    assert await error_of(response) == (
        503,
        "state_store_unavailable",
        "the state store is unavailable",
    )
    await broken.close()
    response = await client.get("/healthz")
    assert response.status == 200


async def test_healthz_answers_with_the_store_closed(
    api: TestClient[web.Request, web.Application], store: StateStore
) -> None:
    await store.close()
    response = await api.get("/healthz")
    assert response.status == 200


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"Authorization": "Bearer"},
    ],
)
async def test_v1_requires_the_bearer_token(
    store: StateStore, clock: ManualClock, headers: dict[str, str], aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(
        create_app(
            Settings(api_token=SecretStr(TOKEN), reconcile_interval_ms=None),
            store=store,
            clock=clock,
        )
    )
    for method, path in [
        ("GET", "/v1/fleets"),
        ("GET", "/v1/fleets/example"),
        ("POST", "/v1/fleets/example/promote"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/nope"),
    ]:
        response = await client.request(method, path, headers=headers)
        status, code, message = await error_of(response)
        assert (status, code) == (401, "unauthorized")
        assert TOKEN not in message
        assert response.headers["WWW-Authenticate"].startswith("Bearer")


async def test_bearer_scheme_is_case_insensitive(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(
        create_app(
            Settings(api_token=SecretStr(TOKEN), reconcile_interval_ms=None),
            store=store,
            clock=clock,
        )
    )
    response = await client.get("/v1/fleets", headers={"Authorization": f"bEaReR {TOKEN}"})
    assert response.status == 200


async def test_without_a_token_the_api_is_open(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    settings = Settings(reconcile_interval_ms=None)
    assert settings.host == "127.0.0.1"
    client = await aiohttp_client(create_app(settings, store=store, clock=clock))
    response = await client.get("/v1/fleets")
    assert response.status == 200


# ---- unknown routes, methods, faults ---------------------------------------------------------


async def test_unknown_route_and_method_get_the_envelope(
    api: TestClient[web.Request, web.Application],
) -> None:
    response = await api.get("/v1/no-such-route")
    assert (await error_of(response))[:2] == (404, "not_found")
    response = await api.get("/nothing-here")
    assert (await error_of(response))[:2] == (404, "not_found")
    response = await api.delete("/v1/fleets")
    assert (await error_of(response))[:2] == (405, "method_not_allowed")
    assert "GET" in response.headers["Allow"]


async def test_unexpected_fault_is_500_without_a_trace_and_logged_once(
    store: StateStore,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    aiohttp_client: AiohttpClient,
) -> None:
    async def explode() -> None:
        raise RuntimeError("secret internals")

    client = await aiohttp_client(
        create_app(Settings(reconcile_interval_ms=None), store=store, clock=clock)
    )
    monkeypatch.setattr(store, "list_fleets", explode)
    with caplog.at_level(logging.ERROR):
        response = await client.get("/v1/fleets")
    status, code, message = await error_of(response)
    assert (status, code) == (500, "internal_error")
    assert "secret internals" not in message
    assert "Traceback" not in await response.text()
    logged = [r for r in caplog.records if r.name == "haru_web"]
    assert len(logged) == 1
    assert logged[0].exc_info is not None


async def test_client_disconnect_is_logged_as_499(
    aiohttp_server: AiohttpServer, caplog: pytest.LogCaptureFixture
) -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        started.set()
        await release.wait()
        return web.json_response({"late": True})

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/slow", slow)
    server = await aiohttp_server(app)
    with caplog.at_level(logging.INFO, logger="haru_web"):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        await started.wait()
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.05)
        release.set()
        for _ in range(100):
            if any("499" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.01)
    assert any("499 GET /slow" in r.getMessage() for r in caplog.records)
    del reader


# ---- fleets ----------------------------------------------------------------------------------


async def test_list_and_get_fleets_by_slug_and_by_id(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock
) -> None:
    assert await (await api.get("/v1/fleets")).json() == {"fleets": []}
    snapshot = await example(store, clock)
    listing = await (await api.get("/v1/fleets")).json()
    assert listing == {
        "fleets": [
            {
                "id": str(snapshot.id),
                "slug": "example",
                "activeDomainId": str(snapshot.active_domain_id),
                "routeRevision": snapshot.route_revision,
                "promotionInFlight": False,
            }
        ]
    }
    by_slug = await (await api.get("/v1/fleets/example")).json()
    by_id = await (await api.get(f"/v1/fleets/{snapshot.id}")).json()
    by_upper = await (await api.get(f"/v1/fleets/{str(snapshot.id).upper()}")).json()
    assert by_slug == by_id == by_upper
    assert by_slug["slug"] == "example"
    assert by_slug["policy"]["autoFailover"] is True
    assert by_slug["policy"]["wakeTimeoutMs"] == 120_000
    assert {d["slug"] for d in by_slug["domains"]} == {"alpha", "beta"}
    first_slot = by_slug["domains"][0]["slots"][0]
    assert set(first_slot) >= {"id", "domainId", "gpuIndex", "kind", "state", "spec"}


@pytest.mark.parametrize("ref", ["nope", str(uuid4()), "EXAMPLE", "a/b"])
async def test_unknown_fleet_is_404(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock, ref: str
) -> None:
    await example(store, clock)
    response = await api.get(f"/v1/fleets/{ref}")
    if "/" in ref:
        assert (await error_of(response))[:2] == (404, "not_found")
    else:
        assert (await error_of(response))[:2] == (404, "fleet_not_found")
    for path in ("route-intent", "events"):
        response = await api.get(f"/v1/fleets/{ref}/{path}")
        assert response.status == 404


@pytest.mark.parametrize(
    "suffix", ["%0A", "%0D", "%20", "%00", "%09", "%C3%A9", "x", "0", "%3A", "%0A%0A"]
)
async def test_a_uuid_with_a_trailing_character_is_404_not_500(
    api: TestClient[web.Request, web.Application],
    store: StateStore,
    clock: ManualClock,
    suffix: str,
) -> None:
    # GET /v1/fleets/<uuid>%0A answered 500 internal_error: a `$` regex accepted the newline
    # and uuid.UUID() then raised. The one fleet-reference rule names no fleet with it.
    snapshot = await example(store, clock)
    for ref in (str(snapshot.id), str(snapshot.id).upper()):
        for path in ("", "/route-intent", "/events", f"/operations/{uuid4()}"):
            response = await api.get(f"/v1/fleets/{ref}{suffix}{path}")
            assert (await error_of(response))[:2] == (404, "fleet_not_found"), (ref, path)
        response = await api.post(f"/v1/fleets/{ref}{suffix}/reconcile")
        assert (await error_of(response))[:2] == (404, "fleet_not_found")
        response = await api.post(
            f"/v1/fleets/{ref}{suffix}/promote", json={"targetDomainId": str(uuid4())}
        )
        assert (await error_of(response))[:2] == (404, "fleet_not_found")
    # The same id without the suffix still names the fleet.
    assert (await api.get(f"/v1/fleets/{snapshot.id}")).status == 200


async def test_an_overlong_reference_is_404_and_not_echoed_in_full(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock
) -> None:
    await example(store, clock)
    response = await api.get("/v1/fleets/" + "a" * 5000)
    status, code, message = await error_of(response)
    assert (status, code) == (404, "fleet_not_found")
    assert len(message) < 200


async def test_route_intent(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock
) -> None:
    snapshot = await example(store, clock)
    intent = await (await api.get("/v1/fleets/example/route-intent")).json()
    assert intent["fleetId"] == str(snapshot.id)
    assert intent["fleetSlug"] == "example"
    assert intent["revision"] == snapshot.route_revision
    assert intent["active"]["domainSlug"] == "alpha"
    assert intent["active"]["eligible"] is True
    assert intent["active"]["weight"] == 1
    assert intent["active"]["endpointUrl"] == "http://127.0.0.1:8800"
    assert [s["domainSlug"] for s in intent["standbys"]] == ["beta"]
    assert intent["standbys"][0]["eligible"] is False
    assert intent["standbys"][0]["weight"] == 0


# ---- promote / demote ------------------------------------------------------------------------


async def test_promote_the_active_is_already_active(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock
) -> None:
    snapshot = await example(store, clock)
    response = await api.post(
        "/v1/fleets/example/promote", json={"targetDomainId": str(snapshot.active_domain_id)}
    )
    assert response.status == 200
    assert await response.json() == {
        "status": "already_active",
        "routeRevision": snapshot.route_revision,
    }


async def test_promote_accepted_joined_and_conflicting(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock
) -> None:
    snapshot = await example(store, clock)
    beta = domain_id(snapshot, "beta")
    response = await api.post(
        "/v1/fleets/example/promote", json={"targetDomainId": str(beta).upper()}
    )
    assert response.status == 202
    body = await response.json()
    assert body["status"] == "accepted"
    operation = body["operation"]
    assert operation["kind"] == "promote"
    assert operation["state"] == "pending"
    assert operation["targetDomainId"] == str(beta)
    assert operation["fleetId"] == str(snapshot.id)
    for key in ("currentStep", "stepStartedAt", "error", "createdAt", "finishedAt"):
        assert key in operation
    # The same intent joins the in-flight operation (by id too, any case).
    again = await api.post(f"/v1/fleets/{snapshot.id}/promote", json={"targetDomainId": str(beta)})
    assert again.status == 202
    assert (await again.json())["operation"]["id"] == operation["id"]
    # A different operation while one is in flight: 409.
    conflict = await api.post("/v1/fleets/example/demote", json={"targetDomainId": str(beta)})
    status, code, message = await error_of(conflict)
    assert (status, code) == (409, "operation_conflict")
    assert operation["id"] in message
    events = await (await api.get("/v1/fleets/example/events")).json()
    requested = [e for e in events["events"] if e["type"] == EventType.OPERATION_REQUESTED_PROMOTE]
    assert len(requested) == 1
    assert requested[0]["operationId"] == operation["id"]
    fetched = await api.get(f"/v1/fleets/example/operations/{operation['id'].upper()}")
    assert fetched.status == 200
    assert (await fetched.json())["id"] == operation["id"]


async def test_promote_invalid_targets_are_422(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock
) -> None:
    snapshot = await example(store, clock)
    response = await api.post("/v1/fleets/example/promote", json={"targetDomainId": str(uuid4())})
    status, code, message = await error_of(response)
    assert (status, code) == (422, "invalid_target")
    assert "not part of fleet" in message
    beta = domain_id(snapshot, "beta")
    assert await store.transition_domain(
        beta, from_states=[DomainState.READY], to=DomainState.FAILED, at=clock()
    )
    response = await api.post("/v1/fleets/example/promote", json={"targetDomainId": str(beta)})
    status, code, message = await error_of(response)
    assert (status, code) == (422, "invalid_target")
    assert "failed" in message
    assert await store.get_in_flight_operation(snapshot.id) is None


async def test_demote_of_the_active_is_422_and_of_a_standby_accepted(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock
) -> None:
    snapshot = await example(store, clock)
    response = await api.post(
        "/v1/fleets/example/demote", json={"targetDomainId": str(snapshot.active_domain_id)}
    )
    assert (await error_of(response))[:2] == (422, "invalid_target")
    beta = domain_id(snapshot, "beta")
    response = await api.post("/v1/fleets/example/demote", json={"targetDomainId": str(beta)})
    assert response.status == 202
    operation = (await response.json())["operation"]
    assert operation["kind"] == "demote"
    in_flight = await store.get_in_flight_operation(snapshot.id)
    assert in_flight is not None
    assert in_flight.kind is OperationKind.DEMOTE


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "empty"),
        (b"{not json", "Invalid JSON"),
        (b"[]", "body"),
        (b"{}", "targetDomainId"),
        (b'{"targetDomainId": "not-a-uuid"}', "targetDomainId"),
        (b'{"targetDomainId": 42}', "targetDomainId"),
        (b'{"targetDomainId": "%s", "force": true}' % str(uuid4()).encode(), "force"),
        (b'{"target_domain_id": "%s", "extra": 1}' % str(uuid4()).encode(), "extra"),
    ],
)
async def test_strict_bodies_are_400(
    api: TestClient[web.Request, web.Application],
    store: StateStore,
    clock: ManualClock,
    body: bytes,
    fragment: str,
) -> None:
    await example(store, clock)
    for route in ("promote", "demote"):
        response = await api.post(
            f"/v1/fleets/example/{route}",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        status, code, message = await error_of(response)
        assert (status, code) == (400, "invalid_request")
        assert fragment in message


async def test_control_bodies_over_16_kib_are_413(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock
) -> None:
    await example(store, clock)
    big = b'{"targetDomainId": "' + b"a" * (16 * 1024) + b'"}'
    response = await api.post("/v1/fleets/example/promote", data=big, headers=JSON)
    assert (await error_of(response))[:2] == (413, "payload_too_large")

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b" " * 1024

    response = await api.post("/v1/fleets/example/reconcile", data=chunks(), headers=JSON)
    assert (await error_of(response))[:2] == (413, "payload_too_large")


async def test_413_comes_after_the_bearer_check(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(
        create_app(
            Settings(api_token=SecretStr(TOKEN), reconcile_interval_ms=None),
            store=store,
            clock=clock,
        )
    )
    response = await client.post("/v1/fleets/example/promote", data=b"x" * 20_000)
    assert (await error_of(response))[:2] == (401, "unauthorized")


# ---- browsers driving an open API ------------------------------------------------------------


@pytest.mark.parametrize("route", ["promote", "demote", "reconcile"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
async def test_control_bodies_must_be_json(
    store: StateStore,
    clock: ManualClock,
    aiohttp_client: AiohttpClient,
    route: str,
    content_type: str,
) -> None:
    snapshot = await example(store, clock)
    client = await aiohttp_client(
        create_app(Settings(reconcile_interval_ms=None), store=store, clock=clock)
    )
    body = b'{"targetDomainId": "%s"}' % str(snapshot.active_domain_id).encode()
    response = await client.post(
        f"/v1/fleets/example/{route}", data=body, headers={"Content-Type": content_type}
    )
    assert (await error_of(response))[:2] == (415, "unsupported_media_type")
    assert await store.get_in_flight_operation(snapshot.id) is None


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://evil.example", "Host": "127.0.0.1"},
        {"Origin": "null"},
        {"Origin": "http://localhost:3000", "Host": "localhost:8700"},
        {"Host": "evil.example"},
        {"Host": "rebind.evil.example:8700"},
    ],
)
async def test_an_open_api_refuses_foreign_origins_and_hosts(
    store: StateStore,
    clock: ManualClock,
    aiohttp_client: AiohttpClient,
    headers: dict[str, str],
) -> None:
    snapshot = await example(store, clock)
    client = await aiohttp_client(
        create_app(Settings(reconcile_interval_ms=None), store=store, clock=clock)
    )
    body = b'{"targetDomainId": "%s"}' % str(snapshot.domains[1].id).encode()
    response = await client.post(
        "/v1/fleets/example/promote", data=body, headers={**JSON, **headers}
    )
    assert (await error_of(response))[:2] == (403, "forbidden")
    assert await store.get_in_flight_operation(snapshot.id) is None
    response = await client.get("/v1/fleets", headers=headers)
    assert (await error_of(response))[:2] == (403, "forbidden")


@pytest.mark.parametrize(
    "headers",
    [
        {"Host": "127.0.0.1:8700", "Origin": "http://127.0.0.1:8700"},
        {"Host": "localhost:8700"},
        {"Host": "[::1]:8700"},
        {"Host": "127.0.0.2"},
    ],
)
async def test_an_open_api_serves_loopback_clients(
    store: StateStore,
    clock: ManualClock,
    aiohttp_client: AiohttpClient,
    headers: dict[str, str],
) -> None:
    client = await aiohttp_client(
        create_app(Settings(reconcile_interval_ms=None), store=store, clock=clock)
    )
    assert (await client.get("/v1/fleets", headers=headers)).status == 200


async def test_with_a_token_origin_and_host_are_not_checked(
    store: StateStore, clock: ManualClock, aiohttp_client: AiohttpClient
) -> None:
    client = await aiohttp_client(
        create_app(
            Settings(api_token=SecretStr(TOKEN), reconcile_interval_ms=None),
            store=store,
            clock=clock,
        )
    )
    headers = {**AUTH, "Host": "haru.internal:8700", "Origin": "https://console.internal"}
    assert (await client.get("/v1/fleets", headers=headers)).status == 200
    response = await client.get("/v1/fleets", headers={"Host": "haru.internal"})
    assert response.status == 401
    assert response.headers["WWW-Authenticate"] == 'Bearer realm="haru"'


# ---- reconcile, operations, events -----------------------------------------------------------


async def test_reconcile_runs_one_tick(
    store: StateStore,
    clock: ManualClock,
    make_fleet: MakeFleet,
    helpers: Any,
    api: TestClient[web.Request, web.Application],
) -> None:
    fleet = await make_fleet(training_gpus=())
    snapshot = await helpers.seed(store, fleet, clock)
    response = await api.post("/v1/fleets/local/reconcile")
    assert response.status == 200
    assert await response.json() == {"fleetId": str(snapshot.id), "operation": None}
    beta = domain_id(snapshot, "beta")
    accepted = await api.post("/v1/fleets/local/promote", json={"targetDomainId": str(beta)})
    operation_id = (await accepted.json())["operation"]["id"]
    response = await api.post(f"/v1/fleets/{snapshot.id}/reconcile", json={})
    body = await response.json()
    assert body["operation"]["id"] == operation_id
    # Routing flipped; the old active sleeps only once every route lease has run out.
    assert body["operation"]["state"] == "running"
    assert body["operation"]["currentStep"] == "demote_old_sleep"
    clock.advance(ms=lease_guard_ms(Settings().route_lease_ms))
    response = await api.post(f"/v1/fleets/{snapshot.id}/reconcile", json={})
    body = await response.json()
    assert body["operation"]["id"] == operation_id
    assert body["operation"]["state"] == "succeeded"
    response = await api.post("/v1/fleets/local/reconcile", json={"force": True})
    assert (await error_of(response))[:2] == (400, "invalid_request")
    response = await api.post("/v1/fleets/missing/reconcile")
    assert (await error_of(response))[:2] == (404, "fleet_not_found")


async def test_operations_route(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock
) -> None:
    snapshot = await example(store, clock)
    response = await api.get(f"/v1/fleets/example/operations/{uuid4()}")
    assert (await error_of(response))[:2] == (404, "not_found")
    response = await api.get("/v1/fleets/example/operations/not-a-uuid")
    assert (await error_of(response))[:2] == (404, "not_found")
    # An operation of another fleet is not found through this one.
    other = load_example_layout().model_copy(update={"slug": "other"})
    await store.apply_fleet_layout(other, at=clock())
    other_snapshot = await store.get_fleet_snapshot("other")
    assert other_snapshot is not None
    operation, _ = await store.create_operation(
        fleet_id=other_snapshot.id,
        kind=OperationKind.DEMOTE,
        target_domain_id=domain_id(other_snapshot, "beta"),
        at=clock(),
    )
    response = await api.get(f"/v1/fleets/example/operations/{operation.id}")
    assert response.status == 404
    response = await api.get(f"/v1/fleets/other/operations/{operation.id}")
    assert (await response.json())["id"] == str(operation.id)
    assert snapshot.id != other_snapshot.id


async def test_events_paginate_oldest_first(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock
) -> None:
    snapshot = await example(store, clock)
    for index in range(5):
        await store.append_event(
            fleet_id=snapshot.id, type="test.event", payload={"n": index}, at=clock()
        )
    everything = await (await api.get("/v1/fleets/example/events")).json()
    ids = [e["id"] for e in everything["events"]]
    assert ids == sorted(ids)
    assert everything["nextAfter"] is None
    page = await (await api.get("/v1/fleets/example/events?limit=2")).json()
    assert len(page["events"]) == 2
    assert page["nextAfter"] == page["events"][-1]["id"]
    rest = await (await api.get(f"/v1/fleets/example/events?after={page['nextAfter']}")).json()
    assert [e["id"] for e in rest["events"]] == ids[2:]
    bad = ("after=-1", "after=x", "limit=0", "limit=1001", "limit=1.5", "after=9" * 30)
    # ASCII digits only: no sign, no digit separator, no other script's digits.
    strict = ("after=%2B1", "after=1_0", "after=%D9%A1", "limit=%EF%BC%91", "after=%201")
    for query in bad + strict:
        response = await api.get(f"/v1/fleets/example/events?{query}")
        assert (await error_of(response))[:2] == (400, "invalid_request")


async def test_events_of_unknown_types_and_misfit_payloads_are_served_as_stored(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock
) -> None:
    snapshot = await example(store, clock)
    await store.append_event(
        fleet_id=snapshot.id, type="future.event", payload={"x": [1, None]}, at=clock()
    )
    misfit = await store.append_event(
        fleet_id=snapshot.id, type="test.placeholder", payload={"step": 5}, at=clock()
    )
    # A row an older or buggy writer left: a known type whose payload does not fit its model.
    engine = create_async_engine(store.url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                sa.text("UPDATE events SET type = 'operation.step.done' WHERE id = :id"),
                {"id": misfit},
            )
    finally:
        await engine.dispose()
    response = await api.get("/v1/fleets/example/events")
    assert response.status == 200
    events = EventList.model_validate_json(await response.text()).events
    by_type = {e.type: e for e in events}
    assert by_type["future.event"].payload == {"x": [1, None]}
    assert by_type["operation.step.done"].payload == {"step": 5}
    assert isinstance(by_type["operation.step.done"].data, UntypedEventPayload)
    line = format_event(by_type["operation.step.done"])
    assert '{"step":5}' in line
    assert "malformed operation.step.done payload" in line
    assert '{"x":[1,null]}' in format_event(by_type["future.event"])
    assert isinstance(by_type["fleet.layout.applied"].data, FleetLayoutApplied)
    assert '"slotsCreated":' in format_event(by_type["fleet.layout.applied"])


async def test_malformed_stored_state_is_reported_not_served(
    api: TestClient[web.Request, web.Application], store: StateStore, clock: ManualClock
) -> None:
    snapshot = await example(store, clock)
    engine = create_async_engine(store.url)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                sa.text("UPDATE slots SET spec = :spec WHERE id = :id"),
                {
                    "spec": '{"kind": "inference", "gpuIndex": 0, "models": []}',
                    "id": snapshot.domains[0].slots[0].id
                    if store.dialect == "postgresql"
                    else snapshot.domains[0].slots[0].id.hex,
                },
            )
    finally:
        await engine.dispose()
    response = await api.get("/v1/fleets/example")
    status, code, message = await error_of(response)
    assert (status, code) == (503, "state_store_unavailable")
    assert "malformed" in message


async def test_the_server_opens_a_store_connection_before_it_listens(
    database_url_factory: DatabaseUrlFactory, aiohttp_server: AiohttpServer
) -> None:
    # docs/FAULTS.md finding 4: the first request's route read is bounded (250 ms); a process
    # that still had to connect to the database then could only answer 503. The connection
    # is opened while the app starts, before the socket is bound.
    url = await database_url_factory()
    # With a reconcile loop and no HARU_RECONCILE_FLEETS nothing else reads at start-up.
    settings = Settings(api_token=SecretStr(TOKEN), database_url=url, reconcile_interval_ms=60_000)
    app = create_app(settings)
    pooled: list[int] = []

    async def before_listening(app: web.Application) -> None:
        # Runs right after the app's own start-up contexts, before the socket is bound and
        # before the reconcile loop's first tick had a chance to read anything.
        pool = app[store_key]._ex.engine.pool
        assert isinstance(pool, QueuePool)  # both engines pool with a queue (its subclasses)
        pooled.append(pool.checkedin())

    app.on_startup.append(before_listening)
    await aiohttp_server(app)
    assert pooled
    assert pooled[0] >= 1
