"""Sleep mode of the emulated vLLM server: latency, idempotency, parking, abort/wait/keep."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from haru_sim import VllmSim

StartSim = Callable[..., Awaitable[VllmSim]]
Eventually = Callable[..., Awaitable[None]]
ReadSse = Callable[[aiohttp.ClientResponse], AsyncIterator[Any]]

CHAT = {"messages": [{"role": "user", "content": "w1 w2 w3 w4 w5 w6 w7 w8"}]}


async def drain(stream: AsyncIterator[Any], into: list[Any]) -> None:
    async for event in stream:
        into.append(event)


async def post_json(
    http: aiohttp.ClientSession, url: str, body: object | None = None
) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        text = await resp.text()
        return resp.status, (await resp.json()) if text else None


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200
        return await resp.json()


async def metric(http: aiohttp.ClientSession, sim: VllmSim, name: str) -> float:
    async with http.get(f"{sim.url}/metrics") as resp:
        text = await resp.text()
    match = re.search(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match is not None, text
    return float(match.group(1))


async def test_sleep_and_wake_take_their_latency_and_report_state(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(sleep_latency_ms=150.0, wake_latency_ms=120.0)
    assert await get_json(http, f"{sim.url}/is_sleeping") == {"is_sleeping": False}

    started = time.monotonic()
    assert await post_json(http, f"{sim.url}/sleep?level=1") == (
        200,
        {"status": "sleeping", "level": 1},
    )
    assert time.monotonic() - started >= 0.15
    assert await get_json(http, f"{sim.url}/is_sleeping") == {"is_sleeping": True}
    assert sim.sleep_level == 1
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200  # /health says nothing about being awake
    async with http.get(f"{sim.url}/v1/models") as resp:
        assert resp.status == 200  # a pure frontend route, served while asleep
    assert await metric(http, sim, "engine_sleep_state") == 0.0  # the "awake" line comes first

    started = time.monotonic()
    assert await post_json(http, f"{sim.url}/wake_up") == (200, {"status": "awake", "tags": None})
    assert time.monotonic() - started >= 0.12
    assert await get_json(http, f"{sim.url}/is_sleeping") == {"is_sleeping": False}
    assert (sim.sleeps, sim.wakes) == (1, 1)


async def test_sleep_and_wake_are_idempotent(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    # Latencies far above any round trip: an answer well before them skipped the work.
    awake = await start_sim(wake_latency_ms=3000.0)
    started = time.monotonic()
    assert await post_json(http, f"{awake.url}/wake_up") == (200, {"status": "awake", "tags": None})
    assert time.monotonic() - started < 3.0
    assert (awake.sleeps, awake.wakes) == (0, 0)

    asleep = await start_sim(sleep_latency_ms=3000.0, start_asleep=True)
    started = time.monotonic()
    # Sleeping while asleep echoes the requested level, and nothing changes.
    assert await post_json(http, f"{asleep.url}/sleep?level=2") == (
        200,
        {"status": "sleeping", "level": 2},
    )
    assert time.monotonic() - started < 3.0
    assert asleep.sleep_level == 1
    assert (asleep.sleeps, asleep.wakes) == (0, 0)


@pytest.mark.parametrize(
    ("query", "param"),
    [("level=3", "level"), ("level=-1", "level"), ("level=one", "level"), ("mode=nap", "mode")],
)
async def test_bad_sleep_parameters_are_400(
    start_sim: StartSim, http: aiohttp.ClientSession, query: str, param: str
) -> None:
    sim = await start_sim()
    status, body = await post_json(http, f"{sim.url}/sleep?{query}")
    assert status == 400
    assert body["error"]["type"] == "BadRequestError"
    assert body["error"]["param"] == param
    assert sim.sleeping is False


async def test_sleep_reads_the_query_string_only(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    # A JSON body is ignored, like vLLM (level defaults to 1).
    assert await post_json(http, f"{sim.url}/sleep", {"level": 2}) == (
        200,
        {"status": "sleeping", "level": 1},
    )
    assert sim.sleep_level == 1


async def test_level_zero_pauses_and_wake_resumes(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    assert await post_json(http, f"{sim.url}/sleep?level=0") == (
        200,
        {"status": "sleeping", "level": 0},
    )
    assert await get_json(http, f"{sim.url}/is_sleeping") == {"is_sleeping": True}
    assert await post_json(http, f"{sim.url}/wake_up") == (200, {"status": "awake", "tags": None})
    assert sim.sleeping is False


async def test_partial_wake_by_tags(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(start_asleep=True)
    assert await post_json(http, f"{sim.url}/wake_up?tags=weights") == (
        200,
        {"status": "sleeping", "tags": ["weights"]},
    )
    assert await get_json(http, f"{sim.url}/is_sleeping") == {"is_sleeping": True}
    assert await post_json(http, f"{sim.url}/wake_up?tags=kv_cache&tags=weights") == (
        200,
        {"status": "awake", "tags": ["kv_cache", "weights"]},
    )
    assert sim.sleeping is False


async def test_requests_while_asleep_are_parked_then_served_after_wake(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(start_asleep=True)
    assert sim.parked_total == 0
    parked = [
        asyncio.create_task(post_json(http, f"{sim.url}/v1/chat/completions", CHAT)),
        asyncio.create_task(post_json(http, f"{sim.url}/v1/embeddings", {"input": "x"})),
    ]
    await eventually(lambda: sim.num_waiting == 2)
    assert (sim.num_parked, sim.parked_total, sim.arrived_while_sleeping) == (2, 2, 2)
    # An asleep engine does not step, so the gauges stay frozen at their last value.
    assert await metric(http, sim, "num_requests_waiting") == 0.0
    assert await metric(http, sim, "num_requests_running") == 0.0
    assert not any(task.done() for task in parked)

    await sim.wake_up()
    (chat_status, chat), (emb_status, emb) = await asyncio.gather(*parked)
    assert (chat_status, emb_status) == (200, 200)
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert len(emb["data"][0]["embedding"]) == 8
    assert sim.num_parked == 0
    assert await metric(http, sim, "num_requests_waiting") == 0.0
    # The count of arrivals while asleep outlives the wake (and reaches other processes).
    status, _ = await post_json(http, f"{sim.url}/v1/chat/completions", CHAT)
    assert status == 200
    assert sim.parked_total == 2
    assert (await get_json(http, f"{sim.url}/_sim/state"))["counters"]["parked"] == 2


async def test_a_parked_stream_gets_headers_but_no_data_until_wake(
    start_sim: StartSim, http: aiohttp.ClientSession, read_sse: ReadSse, eventually: Eventually
) -> None:
    sim = await start_sim(start_asleep=True)
    async with http.post(f"{sim.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        # vLLM sends the streaming response's headers before the engine produces anything.
        assert resp.status == 200
        await eventually(lambda: sim.num_waiting == 1)
        await sim.wake_up()
        events = [e async for e in read_sse(resp)]
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_running_requests_show_in_metrics(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(token_latency_ms=100.0)
    task = asyncio.create_task(post_json(http, f"{sim.url}/v1/chat/completions", CHAT))
    await eventually(lambda: sim.num_running == 1)

    async def gauge_shows_it() -> bool:
        return await metric(http, sim, "num_requests_running") == 1.0

    await eventually(gauge_shows_it)  # at the next engine step
    status, _ = await task
    assert status == 200
    assert await metric(http, sim, "num_requests_running") == 0.0


async def test_mode_abort_ends_streams_with_finish_reason_abort(
    start_sim: StartSim, http: aiohttp.ClientSession, read_sse: ReadSse
) -> None:
    sim = await start_sim(token_latency_ms=100.0)
    async with http.post(f"{sim.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        events: list[Any] = []
        async for event in read_sse(resp):
            events.append(event)
            if len(events) == 2:
                status, _ = await post_json(http, f"{sim.url}/sleep?level=1&mode=abort")
                assert status == 200
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert 0 < len(content.split()) < 8
    assert sim.num_running == 0


async def test_mode_abort_also_aborts_parked_requests(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(start_asleep=True)
    task = asyncio.create_task(post_json(http, f"{sim.url}/v1/chat/completions", CHAT))
    await eventually(lambda: sim.num_waiting == 1)
    # Already asleep: vLLM still pauses with mode=abort, aborting what is queued.
    assert (await post_json(http, f"{sim.url}/sleep?mode=abort"))[0] == 200
    status, body = await task
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "abort"
    assert body["choices"][0]["message"]["content"] == ""
    assert sim.num_waiting == 0


async def test_mode_wait_drains_running_requests_before_sleeping(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(token_latency_ms=150.0)
    running = asyncio.create_task(post_json(http, f"{sim.url}/v1/chat/completions", CHAT))
    await eventually(lambda: sim.num_running == 1)
    sleeping = asyncio.create_task(post_json(http, f"{sim.url}/sleep?mode=wait"))
    await eventually(lambda: sim.sleeping)
    # A request arriving during the drain is parked, not admitted.
    late = asyncio.create_task(post_json(http, f"{sim.url}/v1/chat/completions", CHAT))
    await eventually(lambda: sim.num_waiting == 1)
    assert not sleeping.done()

    status, body = await running
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == CHAT["messages"][0]["content"]
    assert await sleeping == (200, {"status": "sleeping", "level": 1})
    assert not late.done()
    await sim.wake_up()
    assert (await late)[0] == 200


async def test_mode_keep_freezes_streams_until_wake(
    start_sim: StartSim, http: aiohttp.ClientSession, read_sse: ReadSse
) -> None:
    sim = await start_sim(token_latency_ms=100.0)
    async with http.post(f"{sim.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        events: list[Any] = []
        async for event in read_sse(resp):
            events.append(event)
            if len(events) == 2:
                break
        assert await post_json(http, f"{sim.url}/sleep?level=1&mode=keep") == (
            200,
            {"status": "sleeping", "level": 1},
        )
        # Take what was written before the freeze, then prove nothing more comes.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(drain(read_sse(resp), events), 0.2)
        frozen_at = len(events)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(drain(read_sse(resp), events), 0.3)
        assert len(events) == frozen_at
        assert "[DONE]" not in events
        assert sim.num_running == 1
        await sim.wake_up()
        events += [e async for e in read_sse(resp)]
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert content == CHAT["messages"][0]["content"]


async def test_start_asleep(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(start_asleep=True)
    assert await get_json(http, f"{sim.url}/is_sleeping") == {"is_sleeping": True}
    assert sim.sleep_level == 1


async def test_legacy_empty_bodies(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(legacy_empty_bodies=True)
    assert await post_json(http, f"{sim.url}/sleep?level=1") == (200, None)
    assert sim.sleeping is True
    assert await post_json(http, f"{sim.url}/wake_up") == (200, None)
    assert sim.sleeping is False


async def test_without_dev_mode_the_admin_routes_do_not_exist(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(dev_mode=False)
    for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        async with http.request(method, f"{sim.url}{path}") as resp:
            assert resp.status == 404
            assert await resp.json() == {"detail": "Not Found"}
    assert sim.sleeping is False


async def test_a_client_that_disconnects_aborts_its_parked_request(
    start_sim: StartSim, eventually: Eventually
) -> None:
    sim = await start_sim(start_asleep=True)
    async with aiohttp.ClientSession() as session:
        parked = asyncio.create_task(session.post(f"{sim.url}/v1/chat/completions", json=CHAT))
        await eventually(lambda: sim.num_waiting == 1)
        parked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await parked
    await eventually(lambda: sim.num_waiting == 0)
    await sim.wake_up()
    assert sim.num_running == 0


async def test_a_sleep_goes_on_when_its_client_gives_up(
    start_sim: StartSim, eventually: Eventually
) -> None:
    sim = await start_sim(sleep_latency_ms=300.0)
    timeout = aiohttp.ClientTimeout(total=0.05)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        with pytest.raises(TimeoutError):
            await session.post(f"{sim.url}/sleep?level=1")
    await eventually(lambda: sim.sleep_level == 1)
    assert sim.sleeps == 1


async def test_wait_on_an_engine_frozen_by_keep_does_not_deadlock(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(token_latency_ms=100.0)
    running = asyncio.create_task(post_json(http, f"{sim.url}/v1/chat/completions", CHAT))
    await eventually(lambda: sim.num_running == 1)
    await sim.sleep(1, mode="keep")
    async with asyncio.timeout(5):
        assert await post_json(http, f"{sim.url}/sleep?level=1&mode=wait") == (
            200,
            {"status": "sleeping", "level": 1},
        )
    assert not running.done()
    await sim.wake_up()
    status, body = await running
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "stop"
