"""The demo's SDK traffic against real HTTP servers: an emulated vLLM and small stubs."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from haru_demo._traffic import ChatTraffic, RequestRecord, TrafficSummary
from haru_sim import VllmSim, VllmSimConfig

ServerFactory = Callable[[web.Application], Awaitable[TestServer]]


async def until(predicate: Callable[[], bool], *, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_streaming_and_plain_requests_through_the_sdk_are_recorded_as_good() -> None:
    async with VllmSim(VllmSimConfig(served_model_names=("chat-a", "chat-b"))) as sim:
        seen: list[RequestRecord] = []
        async with ChatTraffic(
            sim.url, fleet="example", models=("chat-a", "chat-b"), clients=2, on_record=seen.append
        ) as traffic:
            await until(lambda: len(traffic.records) >= 8)
        assert not traffic.running
        assert seen == traffic.records
        assert all(r.ok and not r.stale and r.error is None for r in traffic.records)
        assert {r.stream for r in traffic.records} == {True, False}
        assert {r.model for r in traffic.records} == {"chat-a", "chat-b"}
        assert {r.client for r in traffic.records} == {0, 1}
        assert all(r.started_at <= r.ended_at for r in traffic.records)
        # The fleet header rides on every request; the SDK's retries are off.
        request = sim.recorded_requests[-1]
        headers = {k.lower(): v for k, v in request.headers}
        assert headers["x-haru-fleet"] == "example"
        assert headers["x-stainless-retry-count"] == "0"
        body = json.loads(request.body)
        assert body["max_tokens"] == 8
        summary = traffic.summary()
        assert summary == TrafficSummary(
            total=len(traffic.records), ok=summary.total, failed=0, stale=0
        )


async def test_failed_requests_are_counted_with_their_reason() -> None:
    async with VllmSim(VllmSimConfig(served_model_names=("chat",))) as sim:
        await sim.set_faults(error_500=True)
        async with ChatTraffic(sim.url, fleet=None, models=("chat",), clients=1) as traffic:
            await until(lambda: len(traffic.records) >= 2)
        assert traffic.records
        assert [r.error for r in traffic.records] == ["HTTP 500"] * len(traffic.records)
        port = sim.port
    # Nothing listens there any more.
    async with ChatTraffic(
        f"http://127.0.0.1:{port}", fleet=None, models=("chat",), clients=1
    ) as traffic:
        await until(lambda: len(traffic.records) >= 2)
    assert all(
        not r.ok and r.error is not None and r.error.startswith("connection failed")
        for r in traffic.records
    )


def _completion(content: str, finish: str) -> dict[str, object]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "chat",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish,
            }
        ],
    }


def _chunk(delta: dict[str, str], finish: str | None) -> str:
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "chat",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(chunk)}\n\n"


def stub_app(
    *, content: str, finish: str, stale: bool, held_ms: int | None = None
) -> web.Application:
    """A stand-in for the proxy: fixed answers, optionally marked as served stale."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        headers = {"X-Haru-Routing": "stale"} if stale else {}
        if held_ms is not None:
            headers["X-Haru-Held-Ms"] = str(held_ms)
        if not body.get("stream"):
            return web.json_response(_completion(content, finish), headers=headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await response.prepare(request)
        await response.write(_chunk({"role": "assistant", "content": ""}, None).encode())
        if content:
            await response.write(_chunk({"content": content}, None).encode())
        await response.write(_chunk({}, finish).encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.mark.parametrize(
    ("content", "finish", "stale", "ok"),
    [
        ("fine", "stop", True, True),
        ("cut", "length", False, True),
        ("", "abort", False, False),
        ("half", "abort", False, False),
        ("", "stop", False, False),
    ],
)
async def test_answers_are_judged_and_stale_routing_is_noticed(
    aiohttp_server: ServerFactory, content: str, finish: str, stale: bool, ok: bool
) -> None:
    server = await aiohttp_server(stub_app(content=content, finish=finish, stale=stale))
    async with ChatTraffic(
        str(server.make_url("/")), fleet="example", models=("chat",), clients=2
    ) as traffic:
        await until(lambda: {r.stream for r in traffic.records} == {True, False})
    assert all(r.ok is ok for r in traffic.records)
    assert all(r.stale is stale for r in traffic.records)
    if not ok:
        assert all(r.error is not None and "bad answer" in r.error for r in traffic.records)


def record(started: float, ended: float, *, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        client=0, model="m", stream=False, started_at=started, ended_at=ended, ok=ok
    )


def test_windows_count_requests_alive_during_them() -> None:
    traffic = ChatTraffic("http://127.0.0.1:1", fleet=None, models=("m",))
    traffic.records = [
        record(1.0, 2.0),
        record(2.5, 4.0, ok=False),  # in flight at 3.0
        record(3.5, 3.6),
        record(5.0, 9.0),
        record(3.2, 3.3, ok=False),
    ]
    assert [r.started_at for r in traffic.window(since=3.0, until=5.0)] == [2.5, 3.5, 3.2]
    assert traffic.summary(since=3.0, until=5.0) == TrafficSummary(3, 1, 2, 0)
    assert traffic.first_good_after(3.0) == traffic.records[2]
    assert traffic.first_good_after(6.0) is None
    with pytest.raises(ValueError, match="model"):
        ChatTraffic("http://x", fleet=None, models=())
    with pytest.raises(ValueError, match="client"):
        ChatTraffic("http://x", fleet=None, models=("m",), clients=0)


async def test_held_answers_are_counted_with_the_longest_hold(
    aiohttp_server: ServerFactory,
) -> None:
    server = await aiohttp_server(stub_app(content="ok", finish="stop", stale=False, held_ms=1234))
    async with ChatTraffic(
        str(server.make_url("/")), fleet="example", models=("chat",), clients=2
    ) as traffic:
        await until(lambda: {r.stream for r in traffic.records} == {True, False})
    assert all(r.held_ms == 1234 for r in traffic.records)
    summary = TrafficSummary.of(traffic.records)
    assert summary.held == summary.total
    assert summary.longest_hold_ms == 1234
    assert TrafficSummary.of([record(1.0, 2.0)]).held == 0


@pytest.mark.parametrize(
    ("faults", "cut"),
    [
        ({"cut_stream_after_chunks": 3}, True),  # the body broke off after some content
        ({"cut_stream_after_chunks": 0}, True),  # right after the status and headers
        ({"error_500": True}, False),  # no response started: a failure
    ],
)
async def test_a_stream_cut_after_its_response_started_is_counted_apart(
    faults: dict[str, Any], cut: bool
) -> None:
    async with VllmSim(VllmSimConfig(served_model_names=("chat",))) as sim:
        await sim.set_faults(**faults)
        async with ChatTraffic(sim.url, fleet=None, models=("chat",), clients=1) as traffic:
            await until(lambda: any(r.stream for r in traffic.records))
    record = next(r for r in traffic.records if r.stream)
    assert not record.ok
    assert record.error is not None
    assert record.cut is cut
    assert ("connection failed" in record.error) is cut
    summary = TrafficSummary.of([record])
    assert (summary.failed, summary.cut) == ((0, 1) if cut else (1, 0))
