"""The proxy's refused connects, recorded in the store and seen by another server process.

A real proxy app on 127.0.0.1 in front of emulated vLLM servers, driven with the official
``openai`` SDK, over both store engines. The active's server refuses connections (its
listening socket gone, as a SIGKILLed vLLM leaves it). A second reconciler, with its own
store connection and no shared memory with the proxy (another replica), must see the record.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp
import httpx2
import openai
import pytest
from haru_db import StateStore
from haru_db.testing import confirm_domains
from haru_protocol import FleetLayout, FleetSnapshot
from haru_server._clock import ManualClock
from haru_server._metrics import ServerMetrics
from haru_server._proxy import ProxyTuning
from haru_server._reconciler import Reconciler
from haru_server._settings import Settings
from haru_sim import VllmSim, VllmSimConfig
from haru_supervisor_client import SupervisorClient
from prometheus_client import CollectorRegistry

MODELS = ("chat-small",)
PLACEMENT = {"cloud": "aws", "region": "us-east-1", "accelerator": "EXAMPLE-GPU"}
NOW = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)
SETTINGS = Settings(route_lease_ms=0, failover_hold_ms=0)

ServeProxy = Callable[..., Awaitable[str]]


def layout(alpha: VllmSim, beta: VllmSim) -> FleetLayout:
    def domain(slug: str, sim: VllmSim) -> dict[str, Any]:
        return {
            "slug": slug,
            "placement": PLACEMENT,
            "slots": [
                {
                    "kind": "inference",
                    "gpuIndex": 0,
                    "models": [{"name": m, "servingUrl": sim.url} for m in MODELS],
                }
            ],
        }

    return FleetLayout.model_validate(
        {
            "slug": "prod",
            "activeDomainSlug": "alpha",
            "domains": [domain("alpha", alpha), domain("beta", beta)],
        }
    )


async def stamped(store: StateStore) -> FleetSnapshot:
    for _ in range(500):
        snapshot = await store.get_fleet_snapshot("prod")
        assert snapshot is not None
        if snapshot.active_domain is not None and snapshot.active_domain.connect_failed_at:
            return snapshot
        await asyncio.sleep(0.01)
    raise AssertionError("the proxy never recorded the refused connect")


async def test_a_refused_upstream_connect_is_stamped_once_a_second_and_seen_by_another_replica(
    store: StateStore, stack: contextlib.AsyncExitStack, serve_proxy: ServeProxy
) -> None:
    alpha = await stack.enter_async_context(VllmSim(VllmSimConfig(served_model_names=MODELS)))
    beta = await stack.enter_async_context(VllmSim(VllmSimConfig(served_model_names=MODELS)))
    applied = await store.apply_fleet_layout(layout(alpha, beta), at=NOW)
    await confirm_domains(store, str(applied.fleet_id), at=NOW)
    metrics = ServerMetrics(CollectorRegistry())
    # The proxy's monotonic clock moves only as the test says (a loaded machine may take more
    # than a second for three requests).
    mono = [1000.0]
    tuning = ProxyTuning(disconnect_poll_ms=20, outage_memo_ms=50, monotonic=lambda: mono[0])
    base_url = await serve_proxy(store, SETTINGS, clock=lambda: NOW, metrics=metrics, tuning=tuning)
    client = openai.AsyncOpenAI(
        base_url=base_url,
        api_key="sk-client",
        default_headers={"X-Haru-Fleet": "prod"},
        max_retries=0,
        http_client=httpx2.AsyncClient(),
    )
    stack.push_async_callback(client.close)

    async def refused(after_s: float) -> None:
        mono[0] += after_s
        with pytest.raises(openai.APIStatusError) as failed:
            await client.chat.completions.create(
                model="chat-small", messages=[{"role": "user", "content": "hi"}]
            )
        assert failed.value.status_code == 502

    def stamps() -> float | None:
        return metrics.registry.get_sample_value(
            "haru_proxy_connect_failed_stamps_total", {"fleet": "prod"}
        )

    await alpha.set_faults(refuse=True)  # the active's server is gone: connects refused
    for _ in range(3):
        await refused(0.3)  # past the outage memo, within the stamp interval
    snapshot = await stamped(store)
    assert snapshot.active_domain is not None
    assert snapshot.active_domain.connect_failed_at == NOW
    # Three failures within a second: one write.
    assert stamps() == 1
    await refused(0.5)  # more than a second after the first: stamped again
    async with asyncio.timeout(10):
        while stamps() != 2:
            await asyncio.sleep(0.01)
    beta_row = next(d for d in snapshot.domains if d.slug == "beta")
    assert beta_row.connect_failed_at is None

    # Another replica: its own store connection, its own memory.
    other = StateStore.open(store.url)
    stack.push_async_callback(other.close)
    session = aiohttp.ClientSession()
    stack.push_async_callback(session.close)
    replica = Reconciler(other, SupervisorClient(session, token=None), clock=ManualClock(NOW))
    first = await replica.tick("prod")
    # A kick: come back at once for a fresh heartbeat. Never a failover by itself.
    assert first.confirming
    assert first.operation is None
    second = await replica.tick("prod")
    assert not second.confirming  # the same record kicks once
    after = await other.get_fleet_snapshot("prod")
    assert after is not None
    assert after.active_domain_id == snapshot.active_domain_id
