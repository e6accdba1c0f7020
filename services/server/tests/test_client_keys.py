"""Client keys through the real proxy with the openai SDK, on both engines.

Two server apps share one database (each with its own store and caches, as two replicas do);
the proxy's monotonic clock is injected, so "within one lease" and the rate limit's refill are
stepped, never waited for.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp
import openai
import pytest
from haru_db import StateStore
from haru_db.testing import confirm_domains
from haru_protocol import FleetLayout
from haru_server._app import create_app
from haru_server._proxy import ProxyTuning
from haru_server._settings import Settings
from haru_sim import VllmSim, VllmSimConfig
from pydantic import SecretStr

ADMIN = "admin-token-0123456789abcdef"
MODELS = ("chat-small", "chat-large")
PLACEMENT = {"cloud": "aws", "region": "us-east-1", "accelerator": "EXAMPLE-GPU"}
LEASE_MS = 300
UrlFactory = Callable[[], Awaitable[str]]
ServeApp = Callable[..., Awaitable[str]]


class Mono:
    """The proxy's monotonic clock, stepped by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def layout(slug: str, url: str) -> FleetLayout:
    models = [{"name": m, "servingUrl": url} for m in MODELS]
    domain = {
        "slug": "alpha",
        "placement": PLACEMENT,
        "slots": [{"kind": "inference", "gpuIndex": 0, "models": models}],
    }
    return FleetLayout.model_validate(
        {"slug": slug, "activeDomainSlug": "alpha", "domains": [domain]}
    )


def sdk(stack: contextlib.AsyncExitStack, base: str, key: str, fleet: str = "prod") -> Any:
    client = openai.AsyncOpenAI(
        base_url=base + "/v1",
        api_key=key,
        max_retries=0,
        default_headers={"X-Haru-Fleet": fleet},
    )
    stack.push_async_callback(client.close)
    return client


async def chat(client: Any, model: str = "chat-small") -> str:
    answer = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    return str(answer.model)


async def test_keys_open_the_proxy_within_their_limits_and_revocation_reaches_every_replica(
    database_url_factory: UrlFactory,
    stack: contextlib.AsyncExitStack,
    serve_app: ServeApp,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="haru_server.access")
    url = await database_url_factory()
    now = datetime.now(UTC)
    sim = VllmSim(VllmSimConfig(served_model_names=MODELS))
    await stack.enter_async_context(sim)
    stores = [StateStore.open(url), StateStore.open(url)]
    for store in stores:
        stack.push_async_callback(store.close)
    for slug in ("prod", "other"):
        result = await stores[0].apply_fleet_layout(layout(slug, sim.url), at=now)
        await confirm_domains(stores[0], str(result.fleet_id), at=now)
    mono = Mono()
    settings = Settings(
        api_token=SecretStr(ADMIN), reconcile_interval_ms=None, route_lease_ms=LEASE_MS
    )
    first, second = [
        await serve_app(create_app(settings, store=store, proxy_tuning=ProxyTuning(monotonic=mono)))
        for store in stores
    ]
    admin = await stack.enter_async_context(
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"})
    )

    async def create(body: dict[str, Any]) -> tuple[str, str]:
        async with admin.post(f"{first}/v1/keys", json=body) as response:
            assert response.status == 201, await response.text()
            made = await response.json()
        assert made["secret"].startswith("hk_")
        return made["key"]["id"], made["secret"]

    limited_id, limited = await create(
        {"name": "billing", "fleets": ["prod"], "models": ["chat-small"]}
    )
    paced_id, paced = await create({"name": "batch", "rpm": 2})
    async with admin.post(f"{first}/v1/keys", json={"name": "x", "fleets": ["nope"]}) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "fleet_not_found"
    for bad in ({"name": "x", "rpm": 0}, {"name": "x", "fleets": []}, {"name": "a b"}):
        async with admin.post(f"{first}/v1/keys", json=bad) as r:
            assert r.status == 400, bad
            assert (await r.json())["error"]["code"] == "invalid_request"
    async with admin.get(f"{second}/v1/keys") as response:
        listing = await response.text()
    assert limited_id in listing
    assert paced_id in listing
    assert limited not in listing
    assert paced not in listing

    # A key opens the proxy of every replica, for its fleets and models only.
    assert await chat(sdk(stack, first, limited)) == "chat-small"
    assert await chat(sdk(stack, second, limited)) == "chat-small"
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await chat(sdk(stack, first, limited), "chat-large")
    assert "may not use model" in str(denied.value)
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await chat(sdk(stack, first, limited, fleet="other"))
    assert "may not use fleet" in str(denied.value)
    listed = await sdk(stack, first, limited).models.list()
    assert [m.id for m in listed.data] == ["chat-small"]

    # The admin token does not open the proxy (HARU_PROXY_ACCEPT_ADMIN_TOKEN is off); an
    # unknown key is a 401.
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await chat(sdk(stack, first, ADMIN))
    assert "HARU_PROXY_ACCEPT_ADMIN_TOKEN" in str(denied.value)
    with pytest.raises(openai.AuthenticationError):
        await chat(sdk(stack, first, "hk_" + "x" * 43))

    # rpm 2: two requests, then 429 with Retry-After until the bucket refills.
    paced_client = sdk(stack, first, paced, fleet="other")
    await chat(paced_client)
    await chat(paced_client)
    with pytest.raises(openai.RateLimitError) as limited_error:
        await chat(paced_client)
    assert limited_error.value.response.headers["Retry-After"] == "30"
    assert limited_error.value.body["code"] == "rate_limited"  # type: ignore[index]
    mono.now += 30
    await chat(paced_client)

    # Revocation: the replica that cached the key refuses it once its lease ran out.
    async with admin.delete(f"{first}/v1/keys/{limited_id}") as response:
        assert response.status == 200
        assert (await response.json())["revokedAt"] is not None
    mono.now += LEASE_MS / 1000
    for base in (first, second):
        with pytest.raises(openai.AuthenticationError):
            await chat(sdk(stack, base, limited))
    async with admin.delete(f"{first}/v1/keys/00000000-0000-4000-8000-000000000000") as r:
        assert r.status == 404
    async with admin.delete(f"{first}/v1/keys/not-a-key") as response:
        assert response.status == 404

    # The upstream never saw a client credential; logs and metrics name key ids only.
    for recorded in sim.recorded_requests:
        assert all(limited not in v and paced not in v for _, v in recorded.headers)
    access = "\n".join(r.getMessage() for r in caplog.records if r.name == "haru_server.access")
    assert f"key={limited_id}" in access
    assert f"key={paced_id}" in access
    assert limited not in caplog.text
    assert paced not in caplog.text
    async with admin.get(f"{first}/metrics") as response:
        exposition = await response.text()
    assert f'haru_proxy_key_requests_total{{key="{paced_id}",status="429"}} 1.0' in exposition


async def test_the_admin_token_opens_the_proxy_only_when_configured(
    sqlite_store: StateStore, stack: contextlib.AsyncExitStack, serve_app: ServeApp
) -> None:
    now = datetime.now(UTC)
    sim = VllmSim(VllmSimConfig(served_model_names=MODELS))
    await stack.enter_async_context(sim)
    result = await sqlite_store.apply_fleet_layout(layout("prod", sim.url), at=now)
    await confirm_domains(sqlite_store, str(result.fleet_id), at=now)
    settings = Settings(
        api_token=SecretStr(ADMIN), reconcile_interval_ms=None, proxy_accept_admin_token=True
    )
    base = await serve_app(create_app(settings, store=sqlite_store))
    assert await chat(sdk(stack, base, ADMIN)) == "chat-small"
    with pytest.raises(openai.AuthenticationError):
        await chat(sdk(stack, base, "not-the-admin-token-at-all"))
    assert all(ADMIN not in v for r in sim.recorded_requests for _, v in r.headers)
