"""Fault injection of the emulated vLLM server, from Python and through ``/_sim/faults``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from haru_sim import (
    Faults,
    SimConfigError,
    SimStateError,
    VllmSim,
    VllmSimConfig,
    create_vllm_app,
)

StartSim = Callable[..., Awaitable[VllmSim]]
Eventually = Callable[..., Awaitable[None]]
ReadSse = Callable[[aiohttp.ClientResponse], AsyncIterator[Any]]

CHAT = {"messages": [{"role": "user", "content": "a b c d e f"}]}


async def drain(stream: AsyncIterator[Any], into: list[Any]) -> None:
    async for event in stream:
        into.append(event)


async def fresh_get(url: str) -> int:
    """GET over a brand-new connection (no pooled keep-alive)."""
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session,
        session.get(url) as resp,
    ):
        return resp.status


async def test_refuse_closes_the_listener_and_clearing_reopens_it(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    async with http.get(f"{sim.url}/health") as resp:  # leaves a pooled keep-alive connection
        assert resp.status == 200
    port = sim.port

    assert (await sim.set_faults(refuse=True)).refuse is True
    with pytest.raises(aiohttp.ClientConnectorError) as refused:
        await fresh_get(f"{sim.url}/health")
    assert isinstance(refused.value.os_error, ConnectionRefusedError)
    # The pooled connection is not served either: the client ends up refused or disconnected.
    with pytest.raises((aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError)):
        async with http.get(f"{sim.url}/health") as resp:
            await resp.read()

    await sim.set_faults(refuse=False)
    assert sim.port == port
    assert await fresh_get(f"{sim.url}/health") == 200
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200


async def test_refuse_at_construction_binds_then_refuses(start_sim: StartSim) -> None:
    sim = await start_sim(faults=Faults(refuse=True))
    with pytest.raises(aiohttp.ClientConnectorError):
        await fresh_get(f"{sim.url}/health")
    await sim.clear_faults()
    assert await fresh_get(f"{sim.url}/health") == 200


async def test_refuse_cleared_over_the_control_listener(http: aiohttp.ClientSession) -> None:
    async with VllmSim() as unused:  # the plain form has no control listener
        assert unused.control_url is None
    sim = VllmSim()
    await sim.start(control_port=0)
    try:
        assert sim.control_url is not None
        async with http.post(f"{sim.control_url}/_sim/faults", json={"refuse": True}) as resp:
            assert resp.status == 200
            assert (await resp.json())["faults"]["refuse"] is True
        with pytest.raises(aiohttp.ClientConnectorError):
            await fresh_get(f"{sim.url}/health")
        async with http.delete(f"{sim.control_url}/_sim/faults") as resp:
            assert (await resp.json())["faults"] == Faults().to_json()
        assert await fresh_get(f"{sim.url}/health") == 200
        # The control listener serves only /_sim/*.
        async with http.get(f"{sim.control_url}/health") as resp:
            assert resp.status == 404
    finally:
        await sim.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
async def test_error_500(start_sim: StartSim, http: aiohttp.ClientSession, path: str) -> None:
    sim = await start_sim()
    await sim.set_faults(error_500=True)
    body = {**CHAT, "prompt": "x", "input": "x"}
    async with http.post(f"{sim.url}{path}", json=body) as resp:
        assert resp.status == 500
        error = (await resp.json())["error"]
    assert error["type"] == "InternalServerError"
    assert error["code"] == 500
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200  # only inference routes fail
    await sim.set_faults(error_500=False)
    async with http.post(f"{sim.url}{path}", json=body) as resp:
        assert resp.status == 200


async def test_hang_holds_requests_until_cleared(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim()
    await sim.set_faults(hang=True)

    async def get(path: str) -> int:
        async with http.get(f"{sim.url}{path}") as resp:
            await resp.read()
            return resp.status

    hung = asyncio.create_task(get("/is_sleeping"))
    await eventually(lambda: sim.requests_served.get("/is_sleeping") == 1)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await asyncio.shield(hung)
    async with http.get(f"{sim.url}/_sim/state") as resp:  # control routes never hang
        assert (await resp.json())["faults"]["hang"] is True
    await sim.set_faults(hang=False)
    assert await hung == 200


async def test_hung_requests_drop_when_the_server_stops(
    http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = VllmSim(VllmSimConfig(faults=Faults(hang=True)))
    await sim.start()
    hung = asyncio.create_task(http.get(f"{sim.url}/health"))
    await eventually(lambda: sim.requests_served.get("/health") == 1)
    await sim.stop()
    # Disconnected; aiohttp retries an idempotent GET once, which is then refused.
    with pytest.raises(aiohttp.ClientConnectionError):
        await hung


async def test_parked_requests_drop_when_the_server_stops(
    http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = VllmSim(VllmSimConfig(start_asleep=True))
    await sim.start()
    parked = asyncio.create_task(http.post(f"{sim.url}/v1/chat/completions", json=CHAT))
    await eventually(lambda: sim.num_waiting == 1)
    await sim.stop()
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await parked
    with pytest.raises(SimStateError):
        await sim.start()


@pytest.mark.parametrize("cut_after", [0, 1, 3])
async def test_cut_stream_closes_the_connection_mid_stream(
    start_sim: StartSim, http: aiohttp.ClientSession, read_sse: ReadSse, cut_after: int
) -> None:
    sim = await start_sim(faults=Faults(cut_stream_after_chunks=cut_after))
    events: list[Any] = []
    async with http.post(f"{sim.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await drain(read_sse(resp), events)
    assert len(events) == cut_after
    assert "[DONE]" not in events
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    assert sim.num_running == 0


async def test_cut_stream_leaves_json_responses_alone(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(faults=Faults(cut_stream_after_chunks=0))
    async with http.post(f"{sim.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["finish_reason"] == "stop"


async def test_slow_first_token(
    start_sim: StartSim, http: aiohttp.ClientSession, read_sse: ReadSse
) -> None:
    sim = await start_sim()
    await sim.set_faults(slow_first_token_ms=400)
    started = time.monotonic()
    async with http.post(f"{sim.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        headers_at = time.monotonic() - started
        async for _event in read_sse(resp):
            break
        first_token_at = time.monotonic() - started
    assert first_token_at >= 0.4
    assert first_token_at - headers_at >= 0.1  # the headers did not wait for the token


async def test_is_sleeping_garbage(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    await sim.set_faults(is_sleeping_garbage=True)
    async with http.get(f"{sim.url}/is_sleeping") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert not isinstance(body.get("is_sleeping"), bool)


async def test_sleep_and_wake_failures(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    await sim.set_faults(sleep_fails=True)
    async with http.post(f"{sim.url}/sleep?level=1") as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["code"] == 500
    assert sim.sleeping is False
    await sim.set_faults(sleep_fails=False, wake_fails=True)
    await sim.sleep(1)
    async with http.post(f"{sim.url}/wake_up") as resp:
        assert resp.status == 500
    assert sim.state()["sleeping"] is True
    await sim.clear_faults()
    async with http.post(f"{sim.url}/wake_up") as resp:
        assert resp.status == 200
    assert sim.state()["sleeping"] is False


async def test_python_fault_api_validates(start_sim: StartSim) -> None:
    sim = await start_sim()
    with pytest.raises(SimConfigError):
        await sim.set_faults(cut_stream_after_chunks=-1)
    with pytest.raises(SimConfigError):
        await sim.set_faults(explode=True)  # type: ignore[call-arg]
    assert sim.faults == Faults()
    assert (await sim.set_faults(hang=True, slow_first_token_ms=5)) == Faults(
        hang=True, slow_first_token_ms=5
    )
    assert sim.state()["faults"] == {**Faults().to_json(), "hang": True, "slow_first_token_ms": 5}


async def test_control_routes_on_a_bare_app(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_vllm_app())
    resp = await client.post("/_sim/faults", json={"error_500": True, "slow_first_token_ms": 3})
    assert resp.status == 200
    faults = (await resp.json())["faults"]
    assert faults["error_500"] is True
    assert faults["slow_first_token_ms"] == 3
    assert (await (await client.get("/_sim/faults")).json())["faults"] == faults
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 500

    for bad in ({"explode": True}, {"hang": "yes"}, {"cut_stream_after_chunks": 1.5}, [1]):
        resp = await client.post("/_sim/faults", json=bad)
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "invalid_request"
    resp = await client.post("/_sim/faults", data=b"{oops")
    assert resp.status == 400

    # Only a VllmSim owns its listening socket.
    resp = await client.post("/_sim/faults", json={"refuse": True})
    assert resp.status == 409
    assert (await resp.json())["error"]["code"] == "unsupported"

    resp = await client.delete("/_sim/faults")
    assert (await resp.json())["faults"] == Faults().to_json()
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 200

    state = await (await client.get("/_sim/state")).json()
    assert state["counters"]["requests"]["/v1/chat/completions"] == 2
    assert state["counters"]["finished"] == {"stop": 1}
    assert state["sleeping"] is False
    assert state["served_model_names"] == ["haru-sim-model"]


def test_config_validation() -> None:
    for bad in (
        {"served_model_names": ()},
        {"served_model_names": ("a", "a")},
        {"served_model_names": "a"},
        {"served_model_names": ("",)},
        {"sleep_latency_ms": -1},
        {"token_latency_ms": True},
        {"max_model_len": 0},
        {"model": ""},
    ):
        with pytest.raises(SimConfigError):
            VllmSimConfig(**bad)
    with pytest.raises(SimConfigError):
        Faults(hang=1)  # type: ignore[arg-type]
    with pytest.raises(SimStateError):
        _ = VllmSim().port
