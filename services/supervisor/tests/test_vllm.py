"""The vLLM admin client against emulated vLLM servers and scripted peers, over real sockets."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from haru_protocol import SupervisorModel
from haru_supervisor.api import VllmAdminClient, VllmAdminError, VllmTimeouts, sum_metrics

FAST = VllmTimeouts(admin_s=2.0, read_s=1.0, drain_poll_s=0.02, drain_quiet_s=0.05)


@pytest.fixture
async def client() -> AsyncIterator[VllmAdminClient]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        yield VllmAdminClient(session, timeouts=FAST)


def _model(port: int, name: str = "chat-small") -> SupervisorModel:
    return SupervisorModel(name=name, port=port)


@dataclass
class Scripted:
    """A peer that answers each route with a scripted (status, body) and records requests."""

    answers: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    seen: list[tuple[str, str, str]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.path, request.query_string))
        status, body = self.answers.get(request.path, (404, b'{"detail":"Not Found"}'))
        return web.Response(status=status, body=body)


ScriptedFactory = Callable[..., Awaitable[tuple[Scripted, int]]]


@pytest.fixture
def scripted(aiohttp_server: Any) -> ScriptedFactory:
    async def make(
        **answers: tuple[int, bytes | str | dict[str, object] | list[object]],
    ) -> tuple[Scripted, int]:
        peer = Scripted()
        for route, (status, body) in answers.items():
            raw = (
                body
                if isinstance(body, bytes)
                else (body if isinstance(body, str) else json.dumps(body)).encode()
            )
            peer.answers["/" + route] = (status, raw)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", peer.handle)
        server: TestServer = await aiohttp_server(app)
        assert server.port is not None
        return peer, server.port

    return make


# -- sleep and wake --------------------------------------------------------------------------


async def test_sleep_puts_the_level_in_the_query_string(
    client: VllmAdminClient, scripted: ScriptedFactory
) -> None:
    peer, port = await scripted(sleep=(200, {"status": "sleeping", "level": 1}))
    await client.sleep(_model(port))
    assert [seen for seen in peer.seen if seen[1] != "/version"] == [
        ("POST", "/sleep", "level=1&mode=abort")
    ]


async def test_sleep_and_wake_against_the_emulated_server(
    client: VllmAdminClient, sims: Any
) -> None:
    sim = await sims("chat-small")
    model = _model(sim.port)
    assert await client.is_sleeping(model) is False
    await client.sleep(model)
    assert sim.sleeping
    assert sim.sleep_level == 1
    assert await client.is_sleeping(model) is True
    await client.wake(model)
    assert not sim.sleeping
    assert await client.is_sleeping(model) is False


async def test_old_releases_answer_an_empty_200(client: VllmAdminClient, sims: Any) -> None:
    sim = await sims("chat-small", legacy_empty_bodies=True)
    await client.sleep(_model(sim.port))
    assert sim.sleeping
    await client.wake(_model(sim.port))
    assert not sim.sleeping


@pytest.mark.parametrize(
    ("route", "answer", "call", "match"),
    [
        ("sleep", (500, "engine exploded"), "sleep", "/sleep: HTTP 500: engine exploded"),
        ("sleep", (200, {"status": "awake"}), "sleep", "unexpected status 'awake'"),
        ("wake_up", (200, {"status": "sleeping", "tags": ["weights"]}), "wake", "partial wake"),
        ("wake_up", (200, {"status": "confused"}), "wake", "unexpected status"),
        ("wake_up", (404, {"detail": "Not Found"}), "wake", "HTTP 404"),
        ("sleep", (400, "x" * 5000), "sleep", r"HTTP 400: x+\.\.\.$"),
    ],
)
async def test_admin_failures_name_the_model(
    client: VllmAdminClient,
    scripted: ScriptedFactory,
    route: str,
    answer: tuple[int, Any],
    call: str,
    match: str,
) -> None:
    _, port = await scripted(**{route: answer})
    with pytest.raises(VllmAdminError, match=match) as caught:
        await getattr(client, call)(_model(port, "chat-x"))
    assert caught.value.model == "chat-x"
    assert len(caught.value.reason) < 300


async def test_wake_accepts_an_awake_body_and_an_unparsable_one(
    client: VllmAdminClient, scripted: ScriptedFactory
) -> None:
    # Recent vLLM answers a JSON status, older releases an empty or plain body: both mean the
    # call returned after the wake, and each reached the server exactly once.
    for body in ({"status": "awake", "tags": None}, "OK", ""):
        peer, port = await scripted(wake_up=(200, body))
        await client.wake(_model(port))
        assert [seen[:2] for seen in peer.seen if seen[1] != "/version"] == [("POST", "/wake_up")]
    # A body that reports the engine still asleep (a partial wake) is not a success.
    peer, port = await scripted(wake_up=(200, {"status": "sleeping", "level": 1}))
    with pytest.raises(VllmAdminError):
        await client.wake(_model(port))


async def test_a_refused_connection_is_an_admin_error(
    client: VllmAdminClient, unused_port: Callable[[], int]
) -> None:
    port = unused_port()
    with pytest.raises(VllmAdminError, match=f"cannot connect to 127.0.0.1:{port}"):
        await client.sleep(_model(port))


async def test_a_hung_server_is_bounded(sims: Any) -> None:
    sim = await sims("chat-small")
    await sim.set_faults(hang=True)
    timeouts = VllmTimeouts(admin_s=0.3, read_s=0.2)
    async with aiohttp.ClientSession() as session:
        client = VllmAdminClient(session, timeouts=timeouts)
        with pytest.raises(VllmAdminError, match=r"no answer within 0\.3 s"):
            await client.wake(_model(sim.port))
        assert await client.is_sleeping(_model(sim.port)) is None
        await sim.set_faults(hang=False)


# -- is_sleeping --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        (200, {"is_sleeping": "yes"}),
        (200, {"sleeping": True}),
        (200, [True]),
        (200, "true"),
        (200, ""),
        (500, {"is_sleeping": False}),
        (404, {"detail": "Not Found"}),
    ],
)
async def test_any_other_is_sleeping_body_proves_nothing(
    client: VllmAdminClient, scripted: ScriptedFactory, answer: tuple[int, Any]
) -> None:
    _, port = await scripted(is_sleeping=answer)
    assert await client.is_sleeping(_model(port)) is None


async def test_is_sleeping_garbage_fault_and_refusal(
    client: VllmAdminClient, sims: Any, unused_port: Callable[[], int]
) -> None:
    sim = await sims("chat-small")
    await sim.set_faults(is_sleeping_garbage=True)
    assert await client.is_sleeping(_model(sim.port)) is None
    assert await client.is_sleeping(_model(unused_port())) is None


async def test_status_says_down_only_when_nothing_listens(sims: Any) -> None:
    """Refused is proof the server is gone; a hang, a garbage answer, a live server are not."""
    sim = await sims("chat-small")
    model = _model(sim.port)
    timeouts = VllmTimeouts(admin_s=0.3, read_s=0.2)
    async with aiohttp.ClientSession() as session:
        client = VllmAdminClient(session, timeouts=timeouts)
        alive = await client.status(model)
        assert (alive.sleeping, alive.down) == (False, False)
        assert "down" not in alive.model_dump(by_alias=True)  # older peers never see it
        await sim.set_faults(hang=True)
        slow = await client.status(model)
        assert (slow.sleeping, slow.down) == (None, False)
        await sim.set_faults(hang=False, is_sleeping_garbage=True)
        garbage = await client.status(model)
        assert (garbage.sleeping, garbage.down) == (None, False)
        await sim.set_faults(is_sleeping_garbage=False, refuse=True)
        refused = await client.status(model)
        assert (refused.sleeping, refused.down) == (None, True)
        assert refused.model_dump(by_alias=True)["down"] is True
        await sim.set_faults(refuse=False)
        back = await client.status(model)
        assert (back.sleeping, back.down) == (False, False)
        # Killed while the supervisor holds a pooled connection to it: the very first
        # status already proves it gone (the dropped connection is asked again, fresh).
        await sim.set_faults(refuse=True)
        killed = await client.status(model)
        assert (killed.sleeping, killed.down) == (None, True)
        await sim.set_faults(refuse=False)


# -- metrics and drain -----------------------------------------------------------------------


def test_sum_metrics_adds_every_sample_and_skips_the_rest() -> None:
    text = "\n".join(
        [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="a"} 2.0',
            'vllm:num_requests_running{engine="1",model_name="we{ird} \\"x\\""} 3.0 1700000000000',
            "vllm:num_requests_waiting 1",
            'vllm:num_requests_waiting_total{engine="0"} 100.0',
            'vllm:num_requests_waiting{engine="1"} NaN',
            'vllm:num_requests_running{engine="2" 9.0',
            "vllm:num_requests_running",
            "garbage line",
        ]
    )
    names = frozenset({"vllm:num_requests_running", "vllm:num_requests_waiting"})
    assert sum_metrics(text, names) == {
        "vllm:num_requests_running": 5.0,
        "vllm:num_requests_waiting": 1.0,
    }
    assert sum_metrics("", names) == {}


async def test_requests_in_flight_reads_the_emulated_metrics(
    client: VllmAdminClient, sims: Any
) -> None:
    sim = await sims("chat-small", token_latency_ms=40.0)
    model = _model(sim.port)
    assert await client.requests_in_flight(model, timeout_s=1.0) == 0
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(_chat(session, sim.url, words=10))
        # The gauges change per engine step (like vLLM's), not when the request arrives.
        await _until(lambda: sim.gauges == (1, 0))
        assert await client.requests_in_flight(model, timeout_s=1.0) == 1
        await request


async def test_metrics_without_the_gauges_cannot_drain(
    client: VllmAdminClient, scripted: ScriptedFactory, caplog: pytest.LogCaptureFixture
) -> None:
    _, port = await scripted(
        is_sleeping=(200, {"is_sleeping": False}),
        metrics=(200, 'vllm:rl_num_requests_running{engine="0"} 0.0\n'),
    )
    assert await client.drain(_model(port), timeout_s=5.0) is False
    assert "cannot tell whether requests are in flight" in caplog.text


async def _chat(session: aiohttp.ClientSession, url: str, *, words: int) -> dict[str, Any]:
    prompt = " ".join(f"w{i}" for i in range(words))
    async with session.post(
        url + "/v1/chat/completions",
        json={"model": "chat-small", "messages": [{"role": "user", "content": prompt}]},
    ) as response:
        assert response.status == 200
        data: dict[str, Any] = await response.json()
        return data


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.01)


async def test_drain_waits_for_the_request_in_flight_then_sleeps(
    client: VllmAdminClient, sims: Any
) -> None:
    sim = await sims("chat-small", token_latency_ms=30.0)
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(_chat(session, sim.url, words=12))
        await _until(lambda: sim.num_running == 1)
        await client.sleep(_model(sim.port), drain_timeout_s=10.0)
        assert request.done()  # the sleep came after the request finished
        completion = await request
    assert completion["choices"][0]["finish_reason"] == "stop"
    assert sim.sleeping


async def test_drain_is_bounded_and_the_sleep_happens_anyway(
    client: VllmAdminClient, sims: Any
) -> None:
    sim = await sims("chat-small", token_latency_ms=200.0)
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(_chat(session, sim.url, words=50))
        await _until(lambda: sim.num_running == 1)
        started = time.monotonic()
        await client.sleep(_model(sim.port), drain_timeout_s=0.2)
        assert time.monotonic() - started < 3
        completion = await request
    # vLLM's default sleep mode aborts what is still running.
    assert completion["choices"][0]["finish_reason"] == "abort"
    assert sim.sleeping


async def test_draining_a_sleeping_server_does_not_wait(client: VllmAdminClient, sims: Any) -> None:
    sim = await sims("chat-small", start_asleep=True)
    async with aiohttp.ClientSession() as session:
        parked = asyncio.create_task(_chat(session, sim.url, words=3))
        await _until(lambda: sim.num_waiting == 1)
        started = time.monotonic()
        assert await client.drain(_model(sim.port), timeout_s=10.0) is True
        assert time.monotonic() - started < 3
        parked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await parked


# -- probe -------------------------------------------------------------------------------------


async def test_probe_ok_with_content(client: VllmAdminClient, sims: Any) -> None:
    sim = await sims("chat-small")
    result = await client.probe(_model(sim.port), prompt="ping", max_tokens=4, timeout_s=2.0)
    assert result.ok
    assert result.error is None
    assert result.latency_ms >= 0
    (recorded,) = sim.recorded_requests
    body = json.loads(recorded.body)
    assert body["model"] == "chat-small"
    assert body["max_tokens"] == 4
    assert body["stream"] is False
    assert body["messages"] == [{"role": "user", "content": "ping"}]


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (
            (200, {"choices": [{"message": {"role": "assistant", "content": ""}}]}),
            "no content, no reasoning",
        ),
        (
            (200, {"choices": [{"message": {"role": "assistant", "content": None}}]}),
            "no content, no reasoning",
        ),
        ((200, {"choices": []}), "no content, no reasoning"),
        ((200, "not json"), "no content, no reasoning"),
        ((500, {"error": {"message": "boom"}}), "HTTP 500"),
    ],
)
async def test_probe_failures(
    client: VllmAdminClient, scripted: ScriptedFactory, answer: tuple[int, Any], match: str
) -> None:
    _, port = await scripted(**{"v1/chat/completions": answer})
    result = await client.probe(_model(port), prompt="ping", max_tokens=4, timeout_s=2.0)
    assert not result.ok
    assert result.error is not None
    assert match in result.error


async def test_probe_of_a_sleeping_server_times_out(client: VllmAdminClient, sims: Any) -> None:
    sim = await sims("chat-small", start_asleep=True)
    result = await client.probe(_model(sim.port), prompt="ping", max_tokens=4, timeout_s=0.3)
    assert not result.ok
    assert result.error == "no answer within 0.3 s"
    assert result.latency_ms >= 250


async def test_drain_ends_only_after_a_quiet_period(scripted: ScriptedFactory) -> None:
    peer, port = await scripted(
        is_sleeping=(200, {"is_sleeping": False}),
        metrics=(200, "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"),
    )
    timeouts = VllmTimeouts(admin_s=2.0, read_s=1.0, drain_poll_s=0.02, drain_quiet_s=0.15)
    async with aiohttp.ClientSession() as session:
        quiet_client = VllmAdminClient(session, timeouts=timeouts)
        started = time.monotonic()
        assert await quiet_client.drain(_model(port), timeout_s=5.0) is True
        elapsed = time.monotonic() - started
    metrics_reads = [seen for seen in peer.seen if seen[1] == "/metrics"]
    assert len(metrics_reads) >= 2
    assert elapsed >= 0.15


async def test_a_request_arriving_during_the_quiet_period_is_drained_too(sims: Any) -> None:
    sim = await sims("chat-small", token_latency_ms=30.0)
    timeouts = VllmTimeouts(admin_s=5.0, read_s=1.0, drain_poll_s=0.02, drain_quiet_s=0.3)
    async with aiohttp.ClientSession() as session:
        quiet_client = VllmAdminClient(session, timeouts=timeouts)
        sleeping = asyncio.create_task(quiet_client.sleep(_model(sim.port), drain_timeout_s=10.0))
        await asyncio.sleep(0.05)  # the drain has read zero once and is waiting for quiet
        late = asyncio.create_task(_chat(session, sim.url, words=10))
        await sleeping
        assert late.done()  # the sleep waited for the late request
        completion = await late
    assert completion["choices"][0]["finish_reason"] == "stop"
    assert sim.sleeping


async def test_every_sleep_asks_vllm_to_abort(scripted: ScriptedFactory) -> None:
    peer, port = await scripted(
        is_sleeping=(200, {"is_sleeping": False}),
        metrics=(200, "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"),
        sleep=(200, {"status": "sleeping", "level": 1}),
    )
    async with aiohttp.ClientSession() as session:
        quiet_client = VllmAdminClient(session, timeouts=FAST)
        await quiet_client.sleep(_model(port), drain_timeout_s=5.0)
        await quiet_client.sleep(_model(port))
    sleeps = [query for _, path, query in peer.seen if path == "/sleep"]
    # After a drain too: what is left at the pause ends now instead of parking until a wake.
    assert sleeps == ["level=1&mode=abort", "level=1&mode=abort"]
