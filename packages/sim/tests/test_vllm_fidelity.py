"""The strict vLLM behaviours: capacity, per-step gauges, deferred wait sleeps, a blocking
``/is_sleeping``, version shapes, ``--api-key``, reasoning answers and ``--disable-log-stats``.

Every test uses real sockets and injected latencies; none asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from haru_sim import SimConfigError, VllmSim, VllmSimConfig

StartSim = Callable[..., Awaitable[VllmSim]]
Eventually = Callable[..., Awaitable[None]]
ReadSse = Callable[[aiohttp.ClientResponse], AsyncIterator[Any]]

CHAT = {"messages": [{"role": "user", "content": "w1 w2 w3 w4"}]}
SLOW = 10_000.0  # an admin latency no test waits out: it holds the operation in progress


async def post(http: aiohttp.ClientSession, url: str, body: object | None = None) -> Any:
    async with http.post(url, json=body) as resp:
        text = await resp.text()
        return resp.status, (await resp.json()) if text else None


async def gauges(http: aiohttp.ClientSession, sim: VllmSim) -> tuple[float, float]:
    async with http.get(f"{sim.url}/metrics") as resp:
        text = await resp.text()
    values = []
    for name in ("num_requests_running", "num_requests_waiting"):
        match = re.search(
            rf'^vllm:{name}\{{engine="0",model_name="[^"]*"\}} (\S+)$', text, re.MULTILINE
        )
        assert match is not None, text
        values.append(float(match.group(1)))
    return values[0], values[1]


def chat_task(http: aiohttp.ClientSession, sim: VllmSim, **extra: Any) -> asyncio.Task[Any]:
    return asyncio.create_task(post(http, f"{sim.url}/v1/chat/completions", {**CHAT, **extra}))


# -- capacity and gauges -------------------------------------------------------------------------


async def test_max_num_seqs_makes_a_waiting_queue_while_awake(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(max_num_seqs=2, token_latency_ms=50.0)
    tasks = [chat_task(http, sim) for _ in range(5)]
    await eventually(lambda: (sim.num_running, sim.num_waiting) == (2, 3))
    assert sim.num_parked == 0  # queued for capacity, not held by a pause

    async def gauges_show_it() -> bool:
        return await gauges(http, sim) == (2.0, 3.0)

    await eventually(gauges_show_it)
    results = await asyncio.gather(*tasks)
    assert all(status == 200 for status, _ in results)
    # The step that finished the last request reported the final counts.
    assert await gauges(http, sim) == (0.0, 0.0)
    assert sim.parked_total == 0


async def test_a_request_being_tokenised_is_not_counted(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(tokenize_latency_ms=SLOW)
    task = chat_task(http, sim)
    await eventually(lambda: sim.num_tokenizing == 1)
    assert (sim.num_running, sim.num_waiting) == (0, 0)
    assert await gauges(http, sim) == (0.0, 0.0)
    state = sim.state()
    assert state["num_requests_tokenizing"] == 1
    task.cancel()


async def test_gauges_change_only_on_engine_steps(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    # A step period no test waits out: only a step that finishes a request refreshes them.
    sim = await start_sim(step_period_ms=SLOW, token_latency_ms=30.0)
    task = chat_task(http, sim)
    await eventually(lambda: sim.num_running == 1)
    assert await gauges(http, sim) == (0.0, 0.0)  # no step has reported it yet
    assert sim.gauges == (0, 0)
    status, _ = await task
    assert status == 200
    assert await gauges(http, sim) == (0.0, 0.0)


async def test_gauges_freeze_while_asleep_and_parked_requests_are_counted(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(max_num_seqs=1, token_latency_ms=40.0)
    tasks = [chat_task(http, sim) for _ in range(2)]

    async def one_running_one_waiting() -> bool:
        return await gauges(http, sim) == (1.0, 1.0)

    await eventually(one_running_one_waiting)
    # abort ends both without an engine step: the gauges keep the last step's values.
    assert await post(http, f"{sim.url}/sleep?level=1&mode=abort") == (
        200,
        {"status": "sleeping", "level": 1},
    )
    results = await asyncio.gather(*tasks)
    assert [body["choices"][0]["finish_reason"] for _, body in results] == ["abort", "abort"]
    assert all(status == 200 for status, _ in results)
    late = chat_task(http, sim)
    await eventually(lambda: sim.num_parked == 1)
    assert await gauges(http, sim) == (1.0, 1.0)
    assert sim.arrived_while_sleeping == 1
    assert sim.state()["counters"]["parked"] == 1  # type: ignore[index]

    await sim.wake_up()
    status, body = await late
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "stop"
    assert await gauges(http, sim) == (0.0, 0.0)


async def test_disable_log_stats_removes_the_vllm_metrics(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(log_stats=False)
    async with http.get(f"{sim.url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    assert "vllm:" not in text
    assert sim.gauges is None
    assert sim.state()["gauges"] is None


# -- sleep with mode=wait ------------------------------------------------------------------------


async def test_wait_drains_running_only_and_parks_queued_requests_until_wake(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(max_num_seqs=1, token_latency_ms=30.0)
    running = chat_task(http, sim)
    await eventually(lambda: sim.num_running == 1)
    queued = chat_task(http, sim)
    await eventually(lambda: sim.num_waiting == 1)

    sleep = asyncio.create_task(post(http, f"{sim.url}/sleep?level=1&mode=wait"))
    await eventually(lambda: sim.sleep_in_progress and sim.num_parked == 1)
    slipped_in = chat_task(http, sim)  # arrives during the drain
    await eventually(lambda: sim.num_parked == 2)
    assert sim.arrived_while_sleeping == 1

    assert (await running)[0] == 200  # the running one finished normally
    assert await sleep == (200, {"status": "sleeping", "level": 1})
    assert sim.sleeping
    # The drain's last step reported the two parked requests; asleep, nothing refreshes.
    assert await gauges(http, sim) == (0.0, 2.0)
    assert not queued.done()
    assert not slipped_in.done()
    assert sim.parked_total == 2

    await sim.wake_up()
    assert [
        r[1]["choices"][0]["finish_reason"] for r in await asyncio.gather(queued, slipped_in)
    ] == [
        "stop",
        "stop",
    ]


async def test_a_wake_during_a_deferred_wait_sleep_answers_awake_and_the_sleep_still_runs(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(token_latency_ms=40.0)
    running = chat_task(http, sim)
    await eventually(lambda: sim.num_running == 1)
    sleep = asyncio.create_task(post(http, f"{sim.url}/sleep?level=1&mode=wait"))
    await eventually(lambda: sim.sleep_in_progress)

    assert await post(http, f"{sim.url}/wake_up") == (200, {"status": "awake", "tags": None})
    assert not sleep.done()
    async with http.get(f"{sim.url}/is_sleeping") as resp:
        assert await resp.json() == {"is_sleeping": False}

    assert (await running)[0] == 200
    assert await sleep == (200, {"status": "sleeping", "level": 1})
    async with http.get(f"{sim.url}/is_sleeping") as resp:
        assert await resp.json() == {"is_sleeping": True}  # asleep after a successful wake
    assert sim.sleep_level == 1
    parked = chat_task(http, sim)
    await eventually(lambda: sim.num_parked == 1)
    await sim.wake_up()
    assert (await parked)[0] == 200


async def test_keep_freezes_and_abort_ends_queued_requests_too(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(max_num_seqs=1, token_latency_ms=30.0)
    tasks = [chat_task(http, sim) for _ in range(2)]
    await eventually(lambda: (sim.num_running, sim.num_waiting) == (1, 1))
    await sim.sleep(1, mode="keep")
    assert (sim.num_running, sim.num_parked) == (1, 1)
    await sim.sleep(1, mode="abort")  # already asleep: the pause still aborts everything
    results = await asyncio.gather(*tasks)
    assert sorted(body["choices"][0]["finish_reason"] for _, body in results) == [
        "abort",
        "abort",
    ]
    assert (sim.num_running, sim.num_waiting) == (0, 0)


# -- /is_sleeping blocks while the engine loop sleeps or wakes ------------------------------------


async def test_is_sleeping_does_not_answer_while_a_sleep_runs(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(sleep_latency_ms=SLOW)
    sleep = asyncio.create_task(post(http, f"{sim.url}/sleep?level=1"))
    await eventually(lambda: sim.state()["engine_busy"])
    probe = asyncio.create_task(http.get(f"{sim.url}/is_sleeping"))
    await eventually(lambda: sim.requests_served.get("/is_sleeping") == 1)
    # The handler has the request and waits for the engine loop, held for SLOW.
    assert not probe.done()
    async with http.get(f"{sim.url}/health") as resp:  # the frontend still answers
        assert resp.status == 200
    sleep.cancel()
    probe.cancel()


async def test_is_sleeping_does_not_answer_while_a_wake_runs_then_answers(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(start_asleep=True, wake_latency_ms=200.0)
    wake = asyncio.create_task(post(http, f"{sim.url}/wake_up"))
    await eventually(lambda: sim.state()["engine_busy"])
    probe = asyncio.create_task(http.get(f"{sim.url}/is_sleeping"))
    await eventually(lambda: sim.requests_served.get("/is_sleeping") == 1)
    assert not probe.done()
    assert not wake.done()
    resp = await probe
    assert await resp.json() == {"is_sleeping": False}  # answered only after the wake
    assert not sim.sleeping
    resp.release()
    assert await wake == (200, {"status": "awake", "tags": None})


# -- versions ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "sleep_body", "wake_body"),
    [
        ("0.16.0", None, None),
        ("0.31.0", None, None),
        ("0.33.0", {"status": "sleeping", "level": 1}, {"status": "awake", "tags": None}),
    ],
)
async def test_version_shapes(
    start_sim: StartSim,
    http: aiohttp.ClientSession,
    version: str,
    sleep_body: object,
    wake_body: object,
) -> None:
    sim = await start_sim(vllm_version=version, dev_mode=True)
    async with http.get(f"{sim.url}/version") as resp:
        assert (resp.status, await resp.json()) == (200, {"version": version})
    assert await post(http, f"{sim.url}/sleep?level=1&mode=wait") == (200, sleep_body)
    assert await post(http, f"{sim.url}/wake_up") == (200, wake_body)


async def test_version_is_served_without_dev_mode(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(dev_mode=False)
    async with http.get(f"{sim.url}/version") as resp:
        assert await resp.json() == {"version": "0.33.0"}


async def test_before_0_17_sleep_takes_no_mode_and_does_not_pause(
    start_sim: StartSim, http: aiohttp.ClientSession, eventually: Eventually
) -> None:
    sim = await start_sim(vllm_version="0.16.0", token_latency_ms=20.0)
    running = chat_task(http, sim)
    await eventually(lambda: sim.num_running == 1)
    # No mode parameter yet: a bad value is not even validated.
    assert await post(http, f"{sim.url}/sleep?level=1&mode=bogus") == (200, None)
    assert sim.sleeping
    # Nothing paused: the running request goes on and a new one is not parked.
    assert (await running)[1]["choices"][0]["finish_reason"] == "stop"
    status, body = await post(http, f"{sim.url}/v1/chat/completions", CHAT)
    assert (status, body["choices"][0]["finish_reason"]) == (200, "stop")
    assert sim.parked_total == 0
    assert sim.state()["pause_state"] == "unpaused"


async def test_0_33_rejects_a_bad_mode(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    status, body = await post(http, f"{sim.url}/sleep?level=1&mode=bogus")
    assert status == 400
    assert body["error"]["param"] == "mode"


def test_a_bad_version_is_a_config_error() -> None:
    with pytest.raises(SimConfigError, match="vllm_version"):
        VllmSimConfig(vllm_version="latest")
    with pytest.raises(SimConfigError, match="step_period_ms"):
        VllmSimConfig(step_period_ms=0)
    with pytest.raises(SimConfigError, match="max_num_seqs"):
        VllmSimConfig(max_num_seqs=0)


# -- --api-key -----------------------------------------------------------------------------------


async def test_api_key_guards_v1_only(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(api_key="s3cret")
    async with http.post(f"{sim.url}/v1/chat/completions", json=CHAT) as resp:
        assert (resp.status, await resp.json()) == (401, {"error": "Unauthorized"})
    async with http.get(f"{sim.url}/v1/models", headers={"Authorization": "Bearer wrong"}) as resp:
        assert resp.status == 401
    async with http.post(
        f"{sim.url}/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer s3cret"}
    ) as resp:
        assert resp.status == 200
    for method, path in (
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/version"),
        ("GET", "/is_sleeping"),
        ("POST", "/sleep?level=1"),
        ("POST", "/wake_up"),
    ):
        async with http.request(method, f"{sim.url}{path}") as resp:
            assert resp.status == 200, path
    assert len(sim.recorded_requests) == 1  # refused requests never reached the handler


# -- reasoning parser ----------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
async def test_a_short_answer_is_all_reasoning(
    start_sim: StartSim, http: aiohttp.ClientSession, field: str
) -> None:
    sim = await start_sim(reasoning_field=field, reasoning_tokens=6)
    status, body = await post(http, f"{sim.url}/v1/chat/completions", {**CHAT, "max_tokens": 4})
    assert status == 200
    choice = body["choices"][0]
    assert choice["message"]["content"] is None
    assert choice["message"][field] == "w1 w2 w3 w4"
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4


async def test_a_long_answer_has_reasoning_then_content(
    start_sim: StartSim, http: aiohttp.ClientSession, read_sse: ReadSse
) -> None:
    sim = await start_sim(reasoning_field="reasoning", reasoning_tokens=2)
    status, body = await post(http, f"{sim.url}/v1/chat/completions", CHAT)
    message = body["choices"][0]["message"]
    assert (status, message["reasoning"], message["content"]) == (200, "w1 w2", "w1 w2 w3 w4")
    async with http.post(f"{sim.url}/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        events = [e async for e in read_sse(resp)]
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == "w1 w2"
    assert "".join(d.get("content") or "" for d in deltas) == "w1 w2 w3 w4"
