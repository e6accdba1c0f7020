"""Requests through an unplanned failover: none that no server answered fails.

Real processes: the topology's server (reconcile loop, autoFailover on), supervisors,
emulated vLLM servers; the active's vLLM servers are SIGKILLed while requests are in flight.

- Every request that had received no byte (non-streamed, and streams whose headers had not
  come) is sent once more to the new active after the flip, and succeeds; the client is the
  official ``openai`` SDK with its own retries off, so any failure would reach the test.
- A second ``haru serve`` process (a pure router) holds requests while a slow promotion runs,
  past ``HARU_FAILOVER_HOLD_MS``; past its hold cap (half of ``HARU_HTTP_MAX_CONNECTIONS``)
  requests are refused at once with 503 and ``Retry-After``, and ``/healthz``, ``/readyz`` and
  the control API keep answering over fresh connections meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from haru_demo import DemoTopology, active_slug
from haru_demo._procs import ChildProcess, spawn
from haru_protocol import OperationKind, OperationState, OperationStep

Launch = Callable[..., Awaitable[DemoTopology]]
Eventually = Callable[..., Awaitable[Any]]

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
_LISTENING = re.compile(r"haru-server listening on [^\s:]+:(\d+)")


async def set_faults(url: str, **faults: object) -> None:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
        http.post(f"{url}/_sim/faults", json=faults) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def chat_requests(topology: DemoTopology, slug: str) -> int:
    """Chat requests domain ``slug``'s vLLM servers received (hung ones included)."""
    total = 0
    for state in (await topology.vllm_states(slug)).values():
        if state is not None:
            counters = state["counters"]
            assert isinstance(counters, dict)
            total += int(counters["requests"].get(CHAT, 0))
    return total


async def test_requests_in_flight_on_a_killed_active_are_served_by_the_new_active(
    launch: Launch, eventually: Eventually
) -> None:
    topology = await launch()
    assert active_slug(await topology.fleet()) == "alpha"
    models = topology.domains["alpha"].models
    # Every request to alpha is taken and left without an answer (no header, no byte), as
    # by a vLLM busy with a long prefill when it dies.
    for server in topology.domains["alpha"].vllm.values():
        await set_faults(server.url, hang=True)
    client = openai.AsyncOpenAI(
        base_url=f"{topology.server_url}/v1",
        api_key="unused",
        max_retries=0,  # the SDK's own retries would hide a failed request
        timeout=120,
    )

    async def whole(model: str, number: int) -> str:
        answer = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"whole {number}"}]
        )
        return answer.choices[0].message.content or ""

    async def streamed(model: str, number: int) -> str:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"streamed {number}"}], stream=True
        )
        parts = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        return "".join(parts)

    try:
        sent = [
            asyncio.create_task((whole if i % 2 == 0 else streamed)(models[i % len(models)], i))
            for i in range(8)
        ]
        await eventually(
            lambda: _at_least(chat_requests(topology, "alpha"), len(sent)),
            what="every request in flight on alpha",
        )
        await topology.kill_vllm("alpha")
        answers = await asyncio.wait_for(asyncio.gather(*sent), timeout=120)
    finally:
        await client.close()

    expected = [f"{('whole', 'streamed')[i % 2]} {i}" for i in range(8)]
    assert answers == expected  # the emulated vLLM echoes the prompt
    assert active_slug(await topology.fleet()) == "beta"
    assert await chat_requests(topology, "beta") >= len(sent)


async def _at_least(count: Awaitable[int], wanted: int) -> bool:
    return await count >= wanted


# -- holds past the fixed bound, their cap, and the health checks ---------------------------------

MAX_CONNECTIONS = 40
HELD_CAP = MAX_CONNECTIONS // 2
REQUESTS = MAX_CONNECTIONS + 20
WAVE = 10
HOLD_MS = 3_000


async def start_router(topology: DemoTopology) -> tuple[ChildProcess, str]:
    env = topology.server_env()
    env.update(
        PORT="0",
        # A pure router: its loop reconciles no fleet of this database.
        HARU_RECONCILE_FLEETS="not-a-fleet-of-this-test",
        HARU_RECONCILE_INTERVAL_MS="1000",
        HARU_HTTP_MAX_CONNECTIONS=str(MAX_CONNECTIONS),
        HARU_FAILOVER_HOLD_MS=str(HOLD_MS),
        HARU_ROUTE_LEASE_MS="300",
    )
    env.pop("HARU_FAILOVER_HOLD_MAX", None)  # the default: half the connection cap
    process = await spawn(
        "router",
        [sys.executable, "-m", "haru_server", "serve"],
        env=env,
        cwd=topology.workdir,
        log_path=topology.workdir / "logs" / "router.log",
    )
    match = await process.wait_for_line(_LISTENING, timeout_s=60)
    return process, f"http://127.0.0.1:{match.group(1)}"


@pytest.fixture
async def one_connection_each() -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as http:
        yield http


Answer = tuple[int, dict[str, str], bytes]


async def chat(http: aiohttp.ClientSession, url: str, model: str) -> Answer:
    body = {"model": model, "messages": [{"role": "user", "content": "held?"}]}
    async with http.post(f"{url}{CHAT}", json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def _answered_at_least(sent: list[asyncio.Task[Answer]], count: int) -> bool:
    return sum(t.done() for t in sent) >= count


async def get(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url) as resp:
        await resp.read()
        return resp.status


async def test_held_requests_outlast_the_fixed_bound_and_never_starve_the_health_checks(
    launch: Launch,
    e2e_timings: Callable[..., Any],
    eventually: Eventually,
    one_connection_each: aiohttp.ClientSession,
) -> None:
    # A slow promotion: waking beta's vLLM takes longer than HARU_FAILOVER_HOLD_MS.
    topology = await launch(timings=e2e_timings(wake_latency_ms=3 * HOLD_MS))
    http = one_connection_each
    model = topology.domains["alpha"].models[0]
    router, url = await start_router(topology)
    try:
        for _ in range(5):  # the router routes the fleet and keeps its lease
            assert (await chat(http, url, model))[0] == 200
        operation = await topology.request(OperationKind.PROMOTE, "beta")
        assert operation is not None

        async def waking() -> bool:
            async with topology.control() as control:
                current = await control.operation(topology.fleet_slug, operation.id)
            assert current.state in (OperationState.PENDING, OperationState.RUNNING)
            return current.current_step is OperationStep.WAKE_VLLM

        await eventually(waking, what="the promotion waking beta", timeout_s=60)
        # The active dies mid-promotion: its connections are refused from now on.
        await topology.kill_vllm("alpha")
        # In waves that stay under the listener's own cap: past the hold cap, each request is
        # refused at once, so the held ones never take more than half the connections.
        sent: list[asyncio.Task[Answer]] = []
        over = REQUESTS - HELD_CAP
        while len(sent) < REQUESTS:
            sent += [asyncio.create_task(chat(http, url, model)) for _ in range(WAVE)]
            refused_by_now = max(0, len(sent) - HELD_CAP)
            await eventually(
                functools.partial(_answered_at_least, sent, refused_by_now),
                what="over-cap answers",
            )
        # While HELD_CAP requests are held, the router still answers its health checks and
        # its control API, each on a fresh connection.
        assert await get(http, f"{url}/healthz") == 200
        assert await get(http, f"{url}/readyz") == 200
        assert await get(http, f"{url}/v1/fleets/{topology.fleet_slug}") == 200
        assert sum(t.done() for t in sent) == over  # the held ones still wait for beta
        answers = await asyncio.wait_for(asyncio.gather(*sent), timeout=120)
    finally:
        await router.stop(grace_s=5)

    refused = [a for a in answers if a[0] == 503]
    held = [a for a in answers if a[0] == 200]
    assert (len(refused), len(held)) == (over, HELD_CAP), [a[0] for a in answers]
    for _, headers, body in refused:
        assert b'"overloaded"' in body
        assert headers["Retry-After"] == "1"
    for _, headers, _ in held:
        # Held past HARU_FAILOVER_HOLD_MS: the promotion in flight bounds the hold.
        assert int(headers["X-Haru-Held-Ms"]) > HOLD_MS
    final = await topology.wait_for_operation(operation.id, timeout_s=60)
    assert final.state is OperationState.SUCCEEDED, final.error
