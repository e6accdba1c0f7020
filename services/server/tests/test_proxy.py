"""The inference proxy over real sockets: emulated vLLM upstreams, a real SQLite store.

Each test runs a minimal app (the proxy plus a middleware rendering ``ApiError``) on
127.0.0.1, a fleet applied from a layout whose servingUrls point at :class:`VllmSim`
instances (or at tiny raw upstreams where the sim cannot show what is tested), and talks to
it with aiohttp, raw sockets or the official ``openai`` SDK.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import aiohttp
import httpx2
import openai
import pytest
from aiohttp import web
from haru_db import StateStore, StateStoreUnavailableError
from haru_db.testing import confirm_domains
from haru_protocol import (
    DomainState,
    FleetLayout,
    FleetRef,
    FleetRoutePointer,
    FleetSnapshot,
    InferenceSlotState,
    OperationError,
    OperationKind,
    OperationStep,
    PolicyPatch,
    SlotKind,
)
from haru_server._app import create_app
from haru_server._async_utils import KickDebouncer
from haru_server._hold import held_cap
from haru_server._metrics import ServerMetrics, metrics_key
from haru_server._proxy import (
    ProxyTuning,
    _Proxy,
    proxy_key,
)
from haru_server._route_cache import RouteCache
from haru_server._settings import Settings
from haru_sim import VllmSim, VllmSimConfig
from haru_web import connection_cap
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from pytest_aiohttp import AiohttpServer

MODELS = ("chat-small", "chat-large", "embed-small")
PLACEMENT = {"cloud": "aws", "region": "us-east-1", "accelerator": "EXAMPLE-GPU"}
FAST_TUNING = ProxyTuning(disconnect_poll_ms=20, outage_memo_ms=50)


def now() -> datetime:
    return datetime.now(UTC)


def served(sim: VllmSim) -> int:
    """Inference requests ``sim`` received (a function, so no assertion narrows the count)."""
    return len(sim.recorded_requests)


# -- fixtures ----------------------------------------------------------------------------------


@dataclass
class Proxy:
    url: str = ""
    app: web.Application = field(init=False)
    kicks: list[UUID] = field(default_factory=list)

    def kick(self, fleet_id: UUID) -> None:
        self.kicks.append(fleet_id)

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


ProxyFactory = Callable[..., Awaitable[Proxy]]


@pytest.fixture
def make_proxy(
    sqlite_store: StateStore,
    proxy_app: Callable[..., web.Application],
    serve_app: Callable[..., Awaitable[str]],
) -> ProxyFactory:
    async def make(
        *,
        tuning: ProxyTuning = FAST_TUNING,
        store: StateStore | None = None,
        handler_cancellation: bool = False,
        metrics: ServerMetrics | None = None,
        **overrides: Any,
    ) -> Proxy:
        # route_lease_ms=0: these tests pin the read-per-request mode (leases: test_route_lease).
        defaults = {"chat_header_timeout_ms": 5_000, "snapshot_cache_ttl_ms": 2_000}
        settings = Settings(**{**defaults, "route_lease_ms": 0, **overrides})
        proxy = Proxy()
        proxy.app = proxy_app(
            store if store is not None else sqlite_store,
            settings,
            clock=now,
            metrics=metrics,
            tuning=tuning,
            kicker=proxy,
        )
        # Served like production (web.run_app's default: handlers are NOT cancelled when a
        # client disconnects), unless a test asks for aiohttp's handler cancellation.
        proxy.url = await serve_app(proxy.app, handler_cancellation=handler_cancellation)
        return proxy

    return make


async def start_sim(stack: contextlib.AsyncExitStack, **config: Any) -> VllmSim:
    sim = VllmSim(VllmSimConfig(served_model_names=MODELS, **config))
    await stack.enter_async_context(sim)
    return sim


def layout(slug: str, alpha: dict[str, str], beta: dict[str, str]) -> FleetLayout:
    def domain(name: str, models: dict[str, str]) -> dict[str, Any]:
        return {
            "slug": name,
            "placement": PLACEMENT,
            "slots": [
                {
                    "kind": "inference",
                    "gpuIndex": 0,
                    "models": [{"name": n, "servingUrl": u} for n, u in models.items()],
                }
            ],
        }

    return FleetLayout.model_validate(
        {
            "slug": slug,
            "activeDomainSlug": "alpha",
            "domains": [domain("alpha", alpha), domain("beta", beta)],
        }
    )


@dataclass
class Fleet:
    id: UUID
    slug: str
    alpha_id: UUID
    beta_id: UUID


async def apply(store: StateStore, fleet_layout: FleetLayout) -> Fleet:
    result = await store.apply_fleet_layout(fleet_layout, at=now())
    await confirm_domains(store, str(result.fleet_id), at=now())
    snapshot = await store.get_fleet_snapshot(str(result.fleet_id))
    assert snapshot is not None
    assert snapshot.active_domain_id is not None
    ids = {d.slug: d.id for d in snapshot.domains}
    return Fleet(result.fleet_id, snapshot.slug, ids["alpha"], ids["beta"])


@dataclass
class Setup:
    fleet: Fleet
    alpha: VllmSim
    beta: VllmSim


async def make_setup(
    store: StateStore,
    stack: contextlib.AsyncExitStack,
    *,
    slug: str = "prod",
    extra_alpha: dict[str, str] | None = None,
    **sim_config: Any,
) -> Setup:
    alpha = await start_sim(stack, **sim_config)
    beta = await start_sim(stack, **sim_config)
    models_alpha = dict.fromkeys(MODELS, alpha.url) | (extra_alpha or {})
    fleet = await apply(store, layout(slug, models_alpha, dict.fromkeys(MODELS, beta.url)))
    return Setup(fleet, alpha, beta)


@pytest.fixture
async def setup(sqlite_store: StateStore, stack: contextlib.AsyncExitStack) -> Setup:
    return await make_setup(sqlite_store, stack)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


SdkFactory = Callable[..., openai.AsyncOpenAI]


@pytest.fixture
async def sdk_factory() -> AsyncIterator[SdkFactory]:
    clients: list[openai.AsyncOpenAI] = []

    def make(base_url: str, fleet: str, *, sent: list[bytes] | None = None) -> openai.AsyncOpenAI:
        async def record(request: httpx2.Request) -> None:
            if sent is not None:
                sent.append(request.content)

        client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key="sk-client-secret",
            default_headers={"X-Haru-Fleet": fleet},
            max_retries=0,
            http_client=httpx2.AsyncClient(event_hooks={"request": [record]}),
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


def chat_body(model: str = "chat-small", text: str = "hello there", **extra: Any) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": text}], **extra}
    ).encode()


async def post(
    http: aiohttp.ClientSession,
    proxy: Proxy,
    body: bytes,
    *,
    fleet: str | None = "prod",
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if fleet is not None:
        all_headers["X-Haru-Fleet"] = fleet
    async with http.post(f"{proxy.url}{path}", data=body, headers=all_headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def error_code(body: bytes) -> str:
    code = json.loads(body)["error"]["code"]
    assert isinstance(code, str)
    return code


async def eventually(predicate: Callable[[], bool], *, within: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# -- the official SDK against the proxy --------------------------------------------------------


async def test_sdk_chat_completions(
    make_proxy: ProxyFactory, setup: Setup, sdk_factory: SdkFactory
) -> None:
    proxy = await make_proxy()
    client = sdk_factory(proxy.v1, "prod")
    answer = await client.chat.completions.create(
        model="chat-small", messages=[{"role": "user", "content": "ping pong"}]
    )
    assert answer.choices[0].message.content == "ping pong"
    recorded = setup.alpha.recorded_requests[-1]
    assert recorded.path == "/v1/chat/completions"
    # The client's credential for Haru never travels to the model server.
    assert all(name.lower() != "authorization" for name, _ in recorded.headers)
    assert all(name.lower() != "x-haru-fleet" for name, _ in recorded.headers)


async def test_sdk_streaming_chat(
    make_proxy: ProxyFactory, setup: Setup, sdk_factory: SdkFactory
) -> None:
    proxy = await make_proxy()
    client = sdk_factory(proxy.v1, "prod")
    stream = await client.chat.completions.create(
        model="chat-small",
        messages=[{"role": "user", "content": "one two three four"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces) == "one two three four"
    assert len(pieces) == 4
    assert usage is not None
    assert usage.completion_tokens == 4


async def test_sdk_completions_embeddings_and_models(
    make_proxy: ProxyFactory, setup: Setup, sdk_factory: SdkFactory
) -> None:
    proxy = await make_proxy()
    client = sdk_factory(proxy.v1, "prod")
    completion = await client.completions.create(model="chat-large", prompt="a b c", max_tokens=2)
    assert completion.choices[0].text == "a b"
    embedding = await client.embeddings.create(model="embed-small", input=["x", "y"])
    assert len(embedding.data) == 2
    assert len(embedding.data[0].embedding) == 8
    models = await client.models.list()
    assert [m.id for m in models.data] == list(MODELS)
    assert all(m.owned_by == "haru" for m in models.data)
    paths = [r.path for r in setup.alpha.recorded_requests]
    assert paths == ["/v1/completions", "/v1/embeddings"]


async def test_sdk_vendor_extensions_arrive_byte_identical(
    make_proxy: ProxyFactory, setup: Setup, sdk_factory: SdkFactory
) -> None:
    proxy = await make_proxy()
    sent: list[bytes] = []
    client = sdk_factory(proxy.v1, "prod", sent=sent)
    await client.chat.completions.create(
        model="chat-small",
        messages=[{"role": "user", "content": "héllo 世界"}],
        extra_body={
            "guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "priority": -3,
            "vendor_x": {"nested": [1, 2.5, None, True, "\u2028"]},
        },
    )
    assert len(sent) == 1
    assert setup.alpha.recorded_requests[-1].body == sent[0]
    assert b"vendor_x" in sent[0]


async def test_raw_body_bytes_are_never_reencoded(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy()
    body = (
        b'{ "messages" :[{"content":"caf\\u00e9 \\ud83d\\ude00","role":"user"}],\n'
        b'  "model":"chat-small", "temperature": 1.0000000000000001, "seed": 1e2,'
        b' "x":{"b":1,"a":2}, "x":{"dup":true} }  '
    )
    status, _, _ = await post(http, proxy, body)
    assert status == 200
    assert setup.alpha.recorded_requests[-1].body == body


# -- streaming ---------------------------------------------------------------------------------


async def test_sse_chunks_arrive_while_the_upstream_is_still_generating(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    env = await make_setup(sqlite_store, stack, token_latency_ms=40)
    proxy = await make_proxy()
    words = " ".join(f"w{i}" for i in range(20))
    async with http.post(
        f"{proxy.url}/v1/chat/completions",
        data=chat_body(text=words, stream=True),
        headers={"X-Haru-Fleet": "prod"},
    ) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        # The first event reached the client before the upstream finished generating.
        assert env.alpha.num_running == 1
        rest = await resp.read()
    events = [line for line in (first + rest).split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    assert len(events) >= 21


async def test_quiet_stream_is_never_cut_by_the_header_bound(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(chat_header_timeout_ms=200)
    # Headers come at once, then the first token takes four header bounds.
    await setup.alpha.set_faults(slow_first_token_ms=800)
    status, _, body = await post(http, proxy, chat_body(text="slow answer", stream=True))
    assert status == 200
    assert body.rstrip().endswith(b"data: [DONE]")
    assert b"slow" in body


async def test_stream_headers_reach_the_client_before_the_first_token(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession
) -> None:
    # vLLM sends a stream's headers before it generates (a StreamingResponse); the proxy
    # relays them at once instead of holding them to share a write with the first chunk, so
    # a client sees its 200 while the model is still queued or prefilling.
    proxy = await make_proxy()
    await setup.alpha.set_faults(slow_first_token_ms=120_000)
    async with asyncio.timeout(60):  # a liveness bound only: the first token takes 120 s
        async with http.post(
            f"{proxy.url}/v1/chat/completions",
            data=chat_body(text="late answer", stream=True),
            headers={"X-Haru-Fleet": "prod"},
        ) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            await eventually(lambda: setup.alpha.num_running == 1)  # admitted, prefilling
            assert resp.content.total_bytes == 0  # not one body byte exists yet
    # Leaving closed the client's connection: the proxy aborts the upstream generation.
    await eventually(lambda: setup.alpha.num_running == 0)


async def test_no_headers_within_the_bound_is_504(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(chat_header_timeout_ms=200)
    # A non-streamed answer sends its headers only once generated.
    await setup.alpha.set_faults(slow_first_token_ms=3_000)
    status, headers, body = await post(http, proxy, chat_body())
    assert status == 504
    assert error_code(body) == "upstream_timeout"
    assert headers["Content-Type"].startswith("application/json")


async def read_into(resp: aiohttp.ClientResponse, pieces: list[bytes]) -> None:
    async for chunk in resp.content.iter_any():
        pieces.append(chunk)


async def test_upstream_cut_mid_stream_breaks_the_client_stream(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy()
    await setup.alpha.set_faults(cut_stream_after_chunks=2)
    async with http.post(
        f"{proxy.url}/v1/chat/completions",
        data=chat_body(text="a b c d e f", stream=True),
        headers={"X-Haru-Fleet": "prod"},
    ) as resp:
        assert resp.status == 200
        pieces: list[bytes] = []
        with pytest.raises(aiohttp.ClientPayloadError):
            await read_into(resp, pieces)
    received = b"".join(pieces)
    assert received.count(b"data: ") == 2
    assert b"[DONE]" not in received


async def test_upstream_cut_reaches_the_sdk_as_an_error(
    make_proxy: ProxyFactory, setup: Setup, sdk_factory: SdkFactory
) -> None:
    proxy = await make_proxy()
    await setup.alpha.set_faults(cut_stream_after_chunks=1)
    client = sdk_factory(proxy.v1, "prod")
    stream = await client.chat.completions.create(
        model="chat-small", messages=[{"role": "user", "content": "a b c"}], stream=True
    )
    with pytest.raises((httpx2.RemoteProtocolError, openai.APIError)):
        async for _ in stream:
            pass


# -- upstream failures -------------------------------------------------------------------------


async def test_connect_failure_is_502_and_kicks_the_fleet_once(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession
) -> None:
    # The proxy's monotonic clock moves only as the test says (a loaded machine may take more
    # than a second for three requests).
    mono = [1000.0]
    proxy = await make_proxy(tuning=replace(FAST_TUNING, monotonic=lambda: mono[0]))
    await setup.alpha.set_faults(refuse=True)
    # Debounced: one kick per second per fleet; the fourth comes more than a second after
    # the first and kicks again. Each comes past the outage memo.
    for after_s, kicks in ((0.3, 1), (0.3, 1), (0.3, 1), (0.5, 2)):
        mono[0] += after_s
        status, _, body = await post(http, proxy, chat_body())
        assert status == 502
        assert error_code(body) == "upstream_unreachable"
        assert proxy.kicks == [setup.fleet.id] * kicks
    assert served(setup.beta) == 0  # a standby is never routed to


def test_kicks_are_debounced_per_fleet() -> None:
    now = [100.0]
    kicker = Proxy()

    debounce = KickDebouncer(kicker, interval_s=1.0, clock=lambda: now[0])
    a, b = UUID(int=1), UUID(int=2)
    assert debounce(a)
    assert not debounce(a)
    assert debounce(b)
    now[0] += 0.99
    assert not debounce(a)
    now[0] += 0.02
    assert debounce(a)
    assert kicker.kicks == [a, b, a]
    assert not KickDebouncer(None, interval_s=1.0, clock=lambda: now[0])(a)


async def test_upstream_errors_pass_through_unchanged_and_unretried(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    ghost = await start_sim(stack)  # bound in the layout as "chat-ghost", which it does not serve
    env = await make_setup(sqlite_store, stack, extra_alpha={"chat-ghost": ghost.url})
    proxy = await make_proxy()
    status, headers, body = await post(
        http, proxy, json.dumps({"model": "chat-small", "messages": []}).encode()
    )
    assert status == 400
    assert headers["Content-Type"].startswith("application/json")
    assert json.loads(body)["error"]["type"] == "BadRequestError"
    assert env.alpha.requests_served["/v1/chat/completions"] == 1

    status, _, body = await post(http, proxy, chat_body(model="chat-ghost"))
    assert status == 404
    assert json.loads(body)["error"]["type"] == "NotFoundError"  # vLLM's body, not Haru's
    assert ghost.requests_served["/v1/chat/completions"] == 1

    await env.alpha.set_faults(error_500=True)
    status, _, body = await post(http, proxy, chat_body())
    assert status == 500
    assert json.loads(body)["error"]["type"] == "InternalServerError"
    assert env.alpha.requests_served["/v1/chat/completions"] == 2


@dataclass
class RawUpstream:
    """A raw TCP upstream: answers nothing (``silent``), one SSE event then stays quiet
    (``one_event``), or closes the connection once the request arrived (``drop``).

    It records when the proxy closes the connection, which is what "the upstream request is
    aborted" means on the wire.
    """

    mode: str
    received: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        self.writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        self.received.set()
        if self.mode == "drop":  # took the request, then died before answering
            writer.close()
            return
        if self.mode == "one_event":
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
                b"e\r\ndata: first\n\n\r\n"
            )
            await writer.drain()
        while await reader.read(65536):
            pass
        self.closed.set()
        writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()


RawUpstreamFactory = Callable[[str], Awaitable[tuple[RawUpstream, str]]]


@pytest.fixture
async def raw_upstream() -> AsyncIterator[RawUpstreamFactory]:
    upstreams: list[RawUpstream] = []

    async def make(mode: str) -> tuple[RawUpstream, str]:
        upstream = RawUpstream(mode)
        url = await upstream.start()
        upstreams.append(upstream)
        return upstream, url

    yield make
    for upstream in upstreams:
        await upstream.stop()


async def raw_request(
    proxy: Proxy, body: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
        b"Content-Type: application/json\r\nX-Haru-Fleet: prod\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize("cancellation", [False, True], ids=["run_app", "cancelling"])
async def test_client_gone_before_headers_aborts_the_upstream_request(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    raw_upstream: RawUpstreamFactory,
    cancellation: bool,
) -> None:
    upstream, url = await raw_upstream("silent")
    await make_setup(sqlite_store, stack, extra_alpha={"chat-hold": url})
    proxy = await make_proxy(handler_cancellation=cancellation)
    _, writer = await raw_request(proxy, chat_body(model="chat-hold"))
    await asyncio.wait_for(upstream.received.wait(), 5)
    writer.close()
    await writer.wait_closed()
    await asyncio.wait_for(upstream.closed.wait(), 5)


@pytest.mark.parametrize("cancellation", [False, True], ids=["run_app", "cancelling"])
async def test_client_gone_during_a_quiet_stream_stops_the_upstream_read(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    raw_upstream: RawUpstreamFactory,
    cancellation: bool,
) -> None:
    upstream, url = await raw_upstream("one_event")
    await make_setup(sqlite_store, stack, extra_alpha={"chat-hold": url})
    proxy = await make_proxy(handler_cancellation=cancellation)
    reader, writer = await raw_request(proxy, chat_body(model="chat-hold", stream=True))
    await asyncio.wait_for(reader.readuntil(b"data: first\n\n"), 5)
    writer.close()
    await writer.wait_closed()
    await asyncio.wait_for(upstream.closed.wait(), 5)


@pytest.mark.parametrize("cancellation", [False, True], ids=["run_app", "cancelling"])
async def test_client_gone_mid_stream_stops_the_generation(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    cancellation: bool,
) -> None:
    env = await make_setup(sqlite_store, stack, token_latency_ms=50)
    proxy = await make_proxy(handler_cancellation=cancellation)
    words = " ".join(f"w{i}" for i in range(200))  # about ten seconds of tokens
    reader, writer = await raw_request(proxy, chat_body(text=words, stream=True))
    await asyncio.wait_for(reader.readuntil(b"\n\n"), 5)
    assert env.alpha.num_running == 1
    writer.close()
    await writer.wait_closed()
    await eventually(lambda: env.alpha.num_running == 0, within=3)


# -- request validation ------------------------------------------------------------------------


async def test_body_cap_rejects_one_byte_over_and_accepts_exactly_at(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession
) -> None:
    cap = 1024
    proxy = await make_proxy(chat_max_body_bytes=cap)
    body = chat_body()
    exact = body + b" " * (cap - len(body))
    assert len(exact) == cap
    status, _, _ = await post(http, proxy, exact)
    assert status == 200
    assert setup.alpha.recorded_requests[-1].body == exact
    status, _, answer = await post(http, proxy, exact + b" ")
    assert status == 413
    assert error_code(answer) == "payload_too_large"


async def test_expect_continue_is_answered_only_within_the_cap(
    make_proxy: ProxyFactory, setup: Setup
) -> None:
    proxy = await make_proxy(chat_max_body_bytes=1024)
    host, port = proxy.url.removeprefix("http://").split(":")

    async def ask(length: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nX-Haru-Fleet: prod\r\n"
            b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
            + f"Content-Length: {length}\r\n\r\n".encode()
        )
        await writer.drain()
        return reader, writer, await asyncio.wait_for(reader.readline(), 5)

    reader, writer, status_line = await ask(4096)
    assert status_line.startswith(b"HTTP/1.1 413")  # refused before any body was sent
    writer.close()
    await writer.wait_closed()

    body = chat_body()
    reader, writer, status_line = await ask(len(body))
    assert status_line == b"HTTP/1.1 100 Continue\r\n"
    assert await reader.readline() == b"\r\n"
    writer.write(body)
    await writer.drain()
    assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"HTTP/1.1 200")
    writer.close()
    await writer.wait_closed()


async def test_client_gone_while_sending_its_body(
    make_proxy: ProxyFactory,
    setup: Setup,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    proxy = await make_proxy()
    host, port = proxy.url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nX-Haru-Fleet: prod\r\n"
        b"Content-Type: application/json\r\nContent-Length: 10000\r\n\r\n" + b'{"model": "'
    )
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    # The proxy is done with the cut request once the access log has its 499.
    await eventually(
        lambda: any(
            r.name == "aiohttp.access"
            and '"POST /v1/chat/completions HTTP/1.1" 499' in r.getMessage()
            for r in caplog.records
        )
    )
    assert (await post(http, proxy, chat_body()))[0] == 200  # the proxy carries on
    assert served(setup.alpha) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_body_cap_holds_for_a_chunked_upload(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(chat_max_body_bytes=4096)

    async def chunks(total: int) -> AsyncIterator[bytes]:
        head = b'{"model": "chat-small", "messages": [{"role": "user", "content": "hi"}], "pad": "'
        yield head
        sent = len(head)
        while sent < total - 2:
            piece = b"x" * min(512, total - 2 - sent)
            sent += len(piece)
            yield piece
        yield b'"}'

    async with http.post(
        f"{proxy.url}/v1/chat/completions",
        data=chunks(100_000),
        headers={"X-Haru-Fleet": "prod", "Content-Type": "application/json"},
    ) as resp:
        assert resp.status == 413
    async with http.post(
        f"{proxy.url}/v1/chat/completions",
        data=chunks(4096),
        headers={"X-Haru-Fleet": "prod", "Content-Type": "application/json"},
    ) as resp:
        assert resp.status == 200
    assert len(setup.alpha.recorded_requests[-1].body) == 4096


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"",
        b'["model", "chat-small"]',
        b'{"messages": []}',
        b'{"model": ""}',
        b'{"model": 42}',
        b'{"model": null}',
        b"[" * 100_000,
        b'{"model": "\xff\xfe"}',
    ],
)
async def test_bad_bodies_are_400_invalid_request(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession, body: bytes
) -> None:
    proxy = await make_proxy()
    status, _, answer = await post(http, proxy, body)
    assert status == 400
    assert error_code(answer) == "invalid_request"
    assert served(setup.alpha) == 0


async def test_unknown_model_lists_the_available_ones(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy()
    status, _, answer = await post(http, proxy, chat_body(model="chat-huge"))
    assert status == 404
    assert error_code(answer) == "model_not_found"
    message = json.loads(answer)["error"]["message"]
    for model in MODELS:
        assert model in message


async def test_fleet_selection(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy()
    status, _, answer = await post(http, proxy, chat_body(), fleet=None)
    assert status == 404
    assert error_code(answer) == "fleet_not_found"
    assert "X-Haru-Fleet" in json.loads(answer)["error"]["message"]
    for ref in ("nope", "Not A Slug!", str(UUID(int=7))):
        status, _, answer = await post(http, proxy, chat_body(), fleet=ref)
        assert status == 404
        assert error_code(answer) == "fleet_not_found"
    status, _, _ = await post(http, proxy, chat_body(), fleet=str(setup.fleet.id).upper())
    assert status == 200

    defaulted = await make_proxy(default_fleet="prod")
    status, _, _ = await post(http, defaulted, chat_body(), fleet=None)
    assert status == 200
    status, _, _ = await post(http, defaulted, chat_body(), fleet="  ")
    assert status == 200


async def test_only_inference_paths_exist(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy()
    for path in ("/sleep", "/wake_up", "/v1/../sleep", "/v1/chat/completions/../../sleep"):
        status, _, _ = await post(http, proxy, chat_body(), path=path)
        assert status == 404
    status, _, answer = await post(http, proxy, chat_body(model="../../sleep"))
    assert status == 404
    assert error_code(answer) == "model_not_found"
    assert "/sleep" not in setup.alpha.requests_served
    assert setup.alpha.sleeps == 0


# -- routing -----------------------------------------------------------------------------------


async def start_promotion(store: StateStore, fleet: Fleet) -> UUID:
    """An operator's promotion of beta, accepted and running (its flip not yet made)."""
    operation, created = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=fleet.beta_id, at=now()
    )
    assert created
    assert await store.claim_operation(
        operation.id, first_step=OperationStep.STOP_TRAINING, at=now()
    )
    return operation.id


async def flip_to_beta(store: StateStore, fleet: Fleet, operation_id: UUID) -> None:
    """The rest of the promotion up to the flip: beta's slots serve, then one CAS."""
    at = now()
    inference = SlotKind.INFERENCE
    for before, after in (
        (InferenceSlotState.SLEEPING, InferenceSlotState.WAKING),
        (InferenceSlotState.WAKING, InferenceSlotState.PROBING),
        (InferenceSlotState.PROBING, InferenceSlotState.SERVING),
    ):
        await store.transition_domain_slots(
            fleet.beta_id, kind=inference, from_states=[before], to=after, at=at
        )
    assert await store.switch_active(
        fleet_id=fleet.id,
        expected_active_domain_id=fleet.alpha_id,
        target_domain_id=fleet.beta_id,
        operation_id=operation_id,
        at=at,
    )


async def promote(store: StateStore, fleet: Fleet) -> None:
    """Move the pointer to beta the way a promotion does."""
    await flip_to_beta(store, fleet, await start_promotion(store, fleet))


async def test_promotion_is_seen_on_the_very_next_request(
    make_proxy: ProxyFactory, setup: Setup, sqlite_store: StateStore, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(snapshot_cache_ttl_ms=600_000)
    for _ in range(3):
        assert (await post(http, proxy, chat_body()))[0] == 200
    assert served(setup.alpha) == 3
    assert served(setup.beta) == 0
    await promote(sqlite_store, setup.fleet)
    status, headers, _ = await post(http, proxy, chat_body())
    assert status == 200
    assert "X-Haru-Routing" not in headers
    assert served(setup.beta) == 1
    assert served(setup.alpha) == 3


async def test_active_domain_states(
    make_proxy: ProxyFactory, setup: Setup, sqlite_store: StateStore, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(snapshot_cache_ttl_ms=1)
    alpha = setup.fleet.alpha_id
    assert await sqlite_store.transition_domain(
        alpha, from_states=[DomainState.READY], to=DomainState.DEGRADED, at=now()
    )
    await asyncio.sleep(0.01)
    assert (await post(http, proxy, chat_body()))[0] == 200  # degraded still serves
    assert await sqlite_store.transition_domain(
        alpha, from_states=[DomainState.DEGRADED], to=DomainState.FAILED, at=now()
    )
    await asyncio.sleep(0.01)
    status, headers, answer = await post(http, proxy, chat_body())
    assert status == 503
    assert error_code(answer) == "no_active_domain"
    assert headers["Retry-After"] == "1"
    async with http.get(f"{proxy.v1}/models", headers={"X-Haru-Fleet": "prod"}) as resp:
        assert resp.status == 503
        assert error_code(await resp.read()) == "no_active_domain"
        assert resp.headers["Retry-After"] == "1"
    assert served(setup.beta) == 0


async def test_models_lists_only_eligible_models(
    make_proxy: ProxyFactory, setup: Setup, sqlite_store: StateStore, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(snapshot_cache_ttl_ms=1)
    snapshot = await sqlite_store.get_fleet_snapshot("prod")
    assert snapshot is not None
    alpha = snapshot.domain(setup.fleet.alpha_id)
    assert alpha is not None
    slot = alpha.slots[0]
    assert await sqlite_store.transition_slot(
        slot.id,
        kind=SlotKind.INFERENCE,
        from_states=[InferenceSlotState.SERVING],
        to=InferenceSlotState.FAILED,
        at=now(),
    )
    await asyncio.sleep(0.01)
    async with http.get(f"{proxy.v1}/models", headers={"X-Haru-Fleet": "prod"}) as resp:
        assert resp.status == 200
        assert await resp.json() == {"object": "list", "data": []}
    # A model the active binds on a failed slot is an outage (503), not an unknown model.
    status, _, answer = await post(http, proxy, chat_body())
    assert status == 503
    assert error_code(answer) == "no_active_domain"
    assert "'chat-small'" in json.loads(answer)["error"]["message"]
    status, _, answer = await post(http, proxy, chat_body(model="chat-huge"))
    assert status == 404
    assert "available models: none" in json.loads(answer)["error"]["message"]


async def test_serving_url_prefix_and_query_are_kept_and_only_content_type_returns(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    aiohttp_server: AiohttpServer,
    http: aiohttp.ClientSession,
) -> None:
    seen: list[str] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        seen.append(request.path_qs)
        return web.Response(
            status=201,
            body=b'{"ok": true}',
            headers={
                "Content-Type": "application/vnd.test+json",
                "Set-Cookie": "session=upstream",
                "X-Upstream-Secret": "s3cret",
            },
        )

    fake = web.Application()
    fake.router.add_post("/prefix/v1/chat/completions", upstream)
    server = await aiohttp_server(fake)
    base = str(server.make_url("/prefix/")) + "?tenant=a&key=b"
    await make_setup(sqlite_store, stack, extra_alpha={"chat-prefixed": base})
    proxy = await make_proxy()
    status, headers, body = await post(http, proxy, chat_body(model="chat-prefixed"))
    assert status == 201
    assert body == b'{"ok": true}'
    assert seen == ["/prefix/v1/chat/completions?tenant=a&key=b"]
    assert headers["Content-Type"] == "application/vnd.test+json"
    assert "Set-Cookie" not in headers
    assert "X-Upstream-Secret" not in headers
    assert "X-Haru-Routing" not in headers
    # What the access log names as the upstream: its origin only, never the query's key.
    routes = (await proxy_of(proxy).cache.resolve("prod")).routes
    assert routes.origin("chat-prefixed") == str(server.make_url("/").origin())
    assert routes.origin("no-such-model") is None


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_an_upstream_redirect_is_passed_to_the_client_never_followed(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    aiohttp_server: AiohttpServer,
    http: aiohttp.ClientSession,
    status: int,
) -> None:
    hits: list[tuple[str, bytes]] = []

    async def admin(request: web.Request) -> web.StreamResponse:
        hits.append((request.path, await request.read()))
        return web.json_response({"slept": True})

    target = web.Application()
    target.router.add_route("*", "/{tail:.*}", admin)
    target_server = await aiohttp_server(target)
    location = str(target_server.make_url("/sleep?level=1"))

    async def redirecting(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(
            status=status,
            body=b"moved",
            headers={"Location": location, "Content-Type": "text/plain"},
        )

    upstream = web.Application()
    upstream.router.add_post("/v1/chat/completions", redirecting)
    upstream_server = await aiohttp_server(upstream)
    await make_setup(
        sqlite_store, stack, extra_alpha={"chat-moved": str(upstream_server.make_url("/"))}
    )
    proxy = await make_proxy()
    body = chat_body(model="chat-moved")
    all_headers = {"Content-Type": "application/json", "X-Haru-Fleet": "prod"}
    async with http.post(
        f"{proxy.v1}/chat/completions", data=body, headers=all_headers, allow_redirects=False
    ) as resp:
        assert resp.status == status
        assert resp.headers["Location"] == location
        assert await resp.read() == b"moved"
    assert hits == []  # nothing of the client's request reached the redirect's target


# -- inside the real server app ----------------------------------------------------------------


async def test_proxy_inside_the_server_app_behind_the_bearer_check(
    sqlite_store: StateStore, stack: contextlib.AsyncExitStack, http: aiohttp.ClientSession
) -> None:
    env = await make_setup(sqlite_store, stack)
    settings = Settings(
        api_token=SecretStr("server-token-0123456789"),
        proxy_accept_admin_token=True,
        default_fleet="prod",
        chat_max_body_bytes=2048,
        reconcile_interval_ms=None,
    )
    runner = web.AppRunner(create_app(settings, store=sqlite_store))
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    url = f"http://{host}:{port}/v1/chat/completions"
    bearer = {"Authorization": "Bearer server-token-0123456789", "Content-Type": "application/json"}

    async with http.post(url, data=b"x" * 10_000) as resp:
        assert resp.status == 401  # the bearer check comes before the body cap
        assert error_code(await resp.read()) == "unauthorized"
    async with http.post(url, data=b"x" * 10_000, headers=bearer) as resp:
        assert resp.status == 413
        assert error_code(await resp.read()) == "payload_too_large"
    async with http.post(url, data=chat_body(text="via the app"), headers=bearer) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"] == "via the app"
    async with http.get(f"http://{host}:{port}/v1/models", headers=bearer) as resp:
        assert resp.status == 200
        assert [m["id"] for m in (await resp.json())["data"]] == list(MODELS)
    recorded = env.alpha.recorded_requests[-1]
    assert all("server-token-0123456789" not in value for _, value in recorded.headers)


# -- route lease, pointer notifications -------------------------------------------------------


class CountingStore(StateStore):
    """A store that counts the route-pointer reads it serves."""

    pointer_reads = 0

    async def get_fleet_route_pointer(self, ref: str | FleetRef) -> FleetRoutePointer | None:
        self.pointer_reads += 1
        return await super().get_fleet_route_pointer(ref)


def proxy_of(proxy: Proxy) -> _Proxy:
    running = proxy.app[proxy_key].running
    assert running is not None
    return running


def counted(proxy: Proxy, name: str = "haru_proxy_held_requests") -> float:
    """A counter of the proxy's metrics (by default: requests held, then dispatched)."""
    registry = proxy.app[metrics_key].registry
    return sum(
        sample.value
        for metric in registry.collect()
        if metric.name == name
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


async def test_leased_requests_never_read_the_pointer_and_own_flips_apply_at_once(
    make_proxy: ProxyFactory, setup: Setup, sqlite_store: StateStore, http: aiohttp.ClientSession
) -> None:
    counting = CountingStore.open(sqlite_store.url)
    assert isinstance(counting, CountingStore)
    try:
        # A lease far longer than the test: only the first requests may read the pointer (the
        # lease starts with a read made after the process recorded its lease in the store).
        proxy = await make_proxy(store=counting, route_lease_ms=60_000)
        await leased(http, proxy, setup.fleet.id)
        reads = counting.pointer_reads
        assert reads >= 2  # the first read predates the record, so it cannot start the lease
        for _ in range(20):
            assert (await post(http, proxy, chat_body()))[0] == 200
        assert counting.pointer_reads == reads
        snapshot = await sqlite_store.get_fleet_snapshot("prod")
        assert snapshot is not None
        assert snapshot.route_lease_ms == 60_000
        assert served(setup.alpha) == 20 + reads  # each warm-up request read once
        cache = proxy_of(proxy).cache
        assert cache.refreshing(setup.fleet.id)
        # A flip this process did not hear of is not seen before the lease runs out (SQLite
        # cannot notify) ...
        await promote(sqlite_store, setup.fleet)
        assert (await post(http, proxy, chat_body()))[0] == 200
        assert served(setup.beta) == 0
        # ... a flip made by this process (the switch_active step reports it) is seen at once.
        pointer = await sqlite_store.get_fleet_route_pointer("prod")
        assert pointer is not None
        proxy.app[proxy_key].note_route_move(pointer)
        status, headers, _ = await post(http, proxy, chat_body())
        assert status == 200
        assert "X-Haru-Routing" not in headers
        assert served(setup.beta) == 1
        assert counting.pointer_reads == reads
    finally:
        await counting.close()


async def test_an_unconfirmed_lease_is_served_marked_stale() -> None:
    clock = [0.0]
    gate: asyncio.Queue[None] = asyncio.Queue()

    async def sleep(_: float) -> None:
        await gate.get()

    class Source:
        def __init__(self, pointer: FleetRoutePointer, snapshot: FleetSnapshot) -> None:
            self.pointer = pointer
            self.snapshot = snapshot
            self.fail = False
            self.reads = 0
            self.records = 0

        async def get_fleet_route_pointer(self, ref: str) -> FleetRoutePointer | None:
            self.reads += 1
            if self.fail:
                raise StateStoreUnavailableError("down")
            return self.pointer

        async def get_fleet_snapshot(self, ref: str) -> FleetSnapshot | None:
            return self.snapshot

        async def record_route_lease(self, fleet_id: UUID, lease_ms: int) -> bool:
            self.records += 1
            return True

    fleet_id = UUID(int=1)
    snapshot = FleetSnapshot.model_validate(
        {
            "id": str(fleet_id),
            "slug": "prod",
            "displayName": None,
            "activeDomainId": None,
            "routeRevision": 1,
            "policy": {},
            "domains": [],
        }
    )
    pointer = FleetRoutePointer(id=fleet_id, slug="prod", active_domain_id=None, route_revision=1)
    source = Source(pointer, snapshot)
    cache: RouteCache[FleetSnapshot] = RouteCache(
        source,
        build=lambda s: s,
        ttl_ms=600_000,
        lease_ms=100,
        pointer_timeout_ms=50,
        monotonic=lambda: clock[0],
        sleep=sleep,
    )
    try:
        assert not (await cache.resolve("prod")).stale
        await _until(lambda: source.records == 1)  # the lease is recorded in the background
        await asyncio.sleep(0)
        assert not (await cache.resolve("prod")).stale  # a read made after the record: leased
        source.fail = True
        clock[0] = 0.149  # within lease + read bound: fresh, and nothing was read
        assert not (await cache.resolve("prod")).stale
        assert source.reads == 2  # the first request's read, and the first after the record
        gate.put_nowait(None)  # one refresher round: the read fails
        await _until(lambda: source.reads == 3)
        clock[0] = 0.151  # the lease has run out unconfirmed
        lookup = await cache.resolve("prod")
        assert lookup.stale
        assert source.reads == 3  # still no read on the request path
        source.fail = False
        gate.put_nowait(None)
        await _until(lambda: source.reads == 4)
        assert not (await cache.resolve("prod")).stale
    finally:
        await cache.aclose()


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.001)


async def leased(
    http: aiohttp.ClientSession, proxy: Proxy, fleet_id: UUID, *, models: bool = False
) -> None:
    """Send requests until ``proxy`` keeps a lease for the fleet (it records its lease first).

    ``models``: ``GET /v1/models`` instead of chats (routed, but no upstream connection).
    """
    cache = proxy_of(proxy).cache
    for _ in range(500):
        if models:
            async with http.get(f"{proxy.v1}/models", headers={"X-Haru-Fleet": "prod"}) as resp:
                assert resp.status == 200
        else:
            assert (await post(http, proxy, chat_body()))[0] == 200
        if cache.refreshing(fleet_id):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no lease was kept")


async def two_processes(
    make_proxy: ProxyFactory, store: StateStore, **overrides: Any
) -> tuple[Proxy, Proxy, StateStore]:
    other = StateStore.open(store.url)
    first = await make_proxy(store=store, **overrides)
    second = await make_proxy(store=other, **overrides)
    return first, second, other


async def test_a_flip_by_one_process_reaches_another_by_notification(
    make_proxy: ProxyFactory,
    postgres_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    setup = await make_setup(postgres_store, stack)
    # The lease outlasts the test: only NOTIFY can move the second process.
    first, second, other = await two_processes(make_proxy, postgres_store, route_lease_ms=60_000)
    stack.push_async_callback(other.close)
    listener = proxy_of(second).listener
    assert listener is not None
    await listener.connected.wait()
    for proxy in (first, second):
        await leased(http, proxy, setup.fleet.id)
    revision = proxy_of(second).cache.leased(setup.fleet.id)
    assert revision is not None
    await promote(postgres_store, setup.fleet)  # the flip, made through the first's store
    await proxy_of(second).cache.wait_moved(setup.fleet.id, revision.route_revision, 30)
    status, headers, _ = await post(http, second, chat_body())
    assert status == 200
    assert "X-Haru-Routing" not in headers
    assert served(setup.beta) == 1
    assert listener.notifications >= 1


async def test_with_notifications_cut_a_flip_is_seen_within_the_lease(
    make_proxy: ProxyFactory,
    postgres_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    setup = await make_setup(postgres_store, stack)
    _, second, other = await two_processes(
        make_proxy,
        postgres_store,
        route_lease_ms=50,
        tuning=ProxyTuning(disconnect_poll_ms=20, outage_memo_ms=50, listen=False),
    )
    stack.push_async_callback(other.close)
    assert proxy_of(second).listener is None
    await leased(http, second, setup.fleet.id)
    pointer = proxy_of(second).cache.leased(setup.fleet.id)
    assert pointer is not None
    await promote(postgres_store, setup.fleet)
    # Only the refresher's polling can carry the move (every 50 ms while the fleet is used).
    await proxy_of(second).cache.wait_moved(setup.fleet.id, pointer.route_revision, 30)
    assert (await post(http, second, chat_body()))[0] == 200
    assert served(setup.beta) == 1


# -- holding requests through a failover -----------------------------------------------------


async def auto_failover_setup(
    store: StateStore, stack: contextlib.AsyncExitStack, alpha_url: str | None = None
) -> Setup:
    alpha = await start_sim(stack)
    beta = await start_sim(stack)
    models_alpha = dict.fromkeys(MODELS, alpha_url or alpha.url)
    fleet_layout = layout("prod", models_alpha, dict.fromkeys(MODELS, beta.url))
    fleet_layout = fleet_layout.model_copy(update={"policy": PolicyPatch(auto_failover=True)})
    return Setup(await apply(store, fleet_layout), alpha, beta)


def holding_is(proxy: _Proxy, count: int) -> bool:
    return proxy.hold.holding == count


async def held_now(http: aiohttp.ClientSession, proxy: Proxy) -> float:
    async with http.get(f"{proxy.url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    (family,) = (
        f
        for f in text_string_to_metric_families(text)
        if f.name == "haru_proxy_held_requests_in_flight"
    )
    (sample,) = family.samples
    return sample.value


HOLD_TUNING = ProxyTuning(disconnect_poll_ms=20, outage_memo_ms=50, hold_poll_ms=10)


async def test_held_requests_are_released_in_arrival_order_at_the_flip(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    setup = await auto_failover_setup(sqlite_store, stack)
    metrics = ServerMetrics(version="test")
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=60_000, metrics=metrics)
    await setup.alpha.set_faults(refuse=True)  # the active crashed: connections are refused
    running = proxy_of(proxy)
    tasks = []
    for i in range(3):
        tasks.append(asyncio.create_task(post(http, proxy, chat_body(text=f"request {i}"))))
        await eventually(functools.partial(holding_is, running, i + 1), within=30)
    # The held-now gauge, scraped while they wait.
    assert await held_now(http, proxy) == 3
    await promote(sqlite_store, setup.fleet)
    answers = await asyncio.gather(*tasks)
    assert await held_now(http, proxy) == 0
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert all(int(headers["X-Haru-Held-Ms"]) >= 0 for _, headers, _ in answers)
    arrived = [json.loads(r.body)["messages"][0]["content"] for r in setup.beta.recorded_requests]
    assert arrived == ["request 0", "request 1", "request 2"]
    assert served(setup.alpha) == 0
    assert counted(proxy) == 3
    assert running.hold.holding == 0


async def test_a_held_request_fails_at_its_bound_with_the_error_it_would_have_got(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    setup = await auto_failover_setup(sqlite_store, stack)
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=30)
    assert await sqlite_store.transition_domain(
        setup.fleet.alpha_id, from_states=[DomainState.READY], to=DomainState.FAILED, at=now()
    )
    status, headers, body = await post(http, proxy, chat_body())
    assert status == 503
    assert error_code(body) == "no_active_domain"
    assert int(headers["X-Haru-Held-Ms"]) >= 30
    assert headers["Retry-After"] == "1"
    assert proxy_of(proxy).hold.holding == 0


async def test_a_hold_that_gives_up_on_a_refusing_upstream_says_when_to_retry(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    setup = await auto_failover_setup(sqlite_store, stack)
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=30)
    await setup.alpha.set_faults(refuse=True)
    status, headers, body = await post(http, proxy, chat_body())
    assert status == 502
    assert error_code(body) == "upstream_unreachable"
    assert int(headers["X-Haru-Held-Ms"]) >= 30
    assert headers["Retry-After"] == "1"


async def fail_first_slot(store: StateStore, domain_id: UUID) -> UUID:
    snapshot = await store.get_fleet_snapshot("prod")
    assert snapshot is not None
    domain = snapshot.domain(domain_id)
    assert domain is not None
    slot = next(s for s in domain.slots if s.kind is SlotKind.INFERENCE)
    assert await store.transition_slot(
        slot.id,
        kind=SlotKind.INFERENCE,
        from_states=[InferenceSlotState.SERVING],
        to=InferenceSlotState.FAILED,
        at=now(),
    )
    return slot.id


async def test_a_model_on_a_failed_slot_is_held_until_its_slot_serves_again(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    # Fault schedules: /is_sleeping answered garbage on the active, its slot went failed, and
    # the proxy answered 404 model_not_found for a model whose server was serving.
    setup = await auto_failover_setup(sqlite_store, stack)
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=60_000, snapshot_cache_ttl_ms=1)
    slot_id = await fail_first_slot(sqlite_store, setup.fleet.alpha_id)
    running = proxy_of(proxy)
    held = asyncio.create_task(post(http, proxy, chat_body()))
    await eventually(lambda: running.hold.holding == 1, within=30)
    # The heartbeat sees the models awake again: no pointer move, the slot serves again.
    assert await sqlite_store.transition_slot(
        slot_id,
        kind=SlotKind.INFERENCE,
        from_states=[InferenceSlotState.FAILED],
        to=InferenceSlotState.SERVING,
        at=now(),
    )
    status, headers, _ = await held
    assert status == 200
    assert int(headers["X-Haru-Held-Ms"]) >= 0
    assert served(setup.alpha) == 1
    assert running.hold.holding == 0


async def test_a_model_on_a_failed_slot_is_held_through_the_failover(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    setup = await auto_failover_setup(sqlite_store, stack)
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=60_000)
    await fail_first_slot(sqlite_store, setup.fleet.alpha_id)
    running = proxy_of(proxy)
    held = asyncio.create_task(post(http, proxy, chat_body()))
    await eventually(lambda: running.hold.holding == 1, within=30)
    await promote(sqlite_store, setup.fleet)
    assert (await held)[0] == 200
    assert served(setup.beta) == 1
    assert served(setup.alpha) == 0


async def test_holds_respect_the_cap_and_need_auto_failover(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    setup = await auto_failover_setup(sqlite_store, stack)
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=60_000, failover_hold_max=1)
    await setup.alpha.set_faults(refuse=True)
    running = proxy_of(proxy)
    held = asyncio.create_task(post(http, proxy, chat_body(text="held")))
    await eventually(lambda: running.hold.holding == 1, within=30)
    status, headers, body = await post(http, proxy, chat_body(text="over the cap"))
    # Over the cap: refused at once, saying when to come back, never held.
    assert status == 503
    assert error_code(body) == "overloaded"
    assert headers["Retry-After"] == "1"
    assert "X-Haru-Held-Ms" not in headers
    assert running.hold.over_cap == 1
    assert counted(proxy, "haru_proxy_hold_refused") == 1
    await promote(sqlite_store, setup.fleet)
    assert (await held)[0] == 200
    assert served(setup.beta) == 1


async def test_a_fleet_without_auto_failover_fails_at_once(
    make_proxy: ProxyFactory, setup: Setup, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=60_000)
    await setup.alpha.set_faults(refuse=True)
    status, headers, _ = await post(http, proxy, chat_body())
    assert status == 502
    assert "X-Haru-Held-Ms" not in headers
    assert counted(proxy) == 0


@pytest.mark.parametrize("route_lease_ms", [0, 20])
async def test_a_promotion_in_flight_holds_requests_without_auto_failover(
    make_proxy: ProxyFactory,
    setup: Setup,
    sqlite_store: StateStore,
    http: aiohttp.ClientSession,
    route_lease_ms: int,
) -> None:
    proxy = await make_proxy(
        tuning=HOLD_TUNING, failover_hold_ms=60_000, route_lease_ms=route_lease_ms
    )
    running = proxy_of(proxy)
    if route_lease_ms:  # routed and leased without a pooled upstream connection
        await leased(http, proxy, setup.fleet.id, models=True)
    await setup.alpha.set_faults(refuse=True)  # the active died; the operator promotes beta
    operation_id = await start_promotion(sqlite_store, setup.fleet)
    if route_lease_ms:  # the refresher's next read carries the flag; no request waits on it
        await eventually(lambda: running.cache.promotion_in_flight(setup.fleet.id), within=30)
    held = asyncio.create_task(post(http, proxy, chat_body(text="held")))
    await eventually(lambda: running.hold.holding == 1, within=30)
    await flip_to_beta(sqlite_store, setup.fleet, operation_id)
    status, headers, _ = await held
    assert status == 200
    assert int(headers["X-Haru-Held-Ms"]) >= 0
    assert served(setup.beta) == 1
    assert counted(proxy) == 1


async def test_a_hold_outlasts_its_fixed_bound_while_a_promotion_is_in_flight(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    setup = await auto_failover_setup(sqlite_store, stack)
    hold_ms = 100
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=hold_ms)
    running = proxy_of(proxy)
    await setup.alpha.set_faults(refuse=True)
    operation_id = await start_promotion(sqlite_store, setup.fleet)
    held = asyncio.create_task(post(http, proxy, chat_body()))
    await eventually(lambda: running.hold.holding == 1, within=30)
    since = running.cache.promotion_since(setup.fleet.id)
    assert since is not None
    # Bounded by the promotion's own budgets up to the flip, not by HARU_FAILOVER_HOLD_MS.
    snapshot = await sqlite_store.get_fleet_snapshot("prod")
    assert snapshot is not None
    policy = snapshot.policy
    budget_s = (
        policy.stop_training_timeout_ms
        + policy.verify_gpu_timeout_ms
        + policy.wake_timeout_ms
        + policy.probe_timeout_ms
        + policy.switch_active_timeout_ms
    ) / 1000
    assert (
        running.hold.hold_deadline(setup.fleet.id, since, policy)
        == since + budget_s + hold_ms / 1000
    )
    # The promotion takes several times the fixed bound to flip; the request waits for it.
    loop = asyncio.get_running_loop()
    flip_after = loop.time() + 5 * hold_ms / 1000
    await eventually(lambda: loop.time() >= flip_after, within=30)
    assert not held.done()
    await flip_to_beta(sqlite_store, setup.fleet, operation_id)
    status, headers, _ = await held
    assert status == 200
    assert int(headers["X-Haru-Held-Ms"]) >= 5 * hold_ms
    assert served(setup.beta) == 1


async def test_with_the_promotion_over_a_hold_falls_back_to_its_fixed_bound(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    setup = await auto_failover_setup(sqlite_store, stack)
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=200)
    running = proxy_of(proxy)
    await setup.alpha.set_faults(refuse=True)
    operation_id = await start_promotion(sqlite_store, setup.fleet)
    held = asyncio.create_task(post(http, proxy, chat_body()))
    await eventually(lambda: running.hold.holding == 1, within=30)
    assert await sqlite_store.fail_operation(
        operation_id,
        error=OperationError(step=None, code="probe_failed", message="probe failed"),
        at=now(),
    )
    # autoFailover may still bring another promotion: held for HARU_FAILOVER_HOLD_MS, then
    # given up with Retry-After (not for the failed promotion's budgets, minutes by default).
    status, headers, body = await asyncio.wait_for(held, timeout=30)
    assert status == 502
    assert error_code(body) == "upstream_unreachable"
    assert headers["Retry-After"] == "1"
    assert running.cache.promotion_since(setup.fleet.id) is None


async def test_requests_held_for_a_promotion_fail_at_once_when_it_fails(
    make_proxy: ProxyFactory, setup: Setup, sqlite_store: StateStore, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=60_000)
    running = proxy_of(proxy)
    await setup.alpha.set_faults(refuse=True)
    operation_id = await start_promotion(sqlite_store, setup.fleet)
    held = asyncio.create_task(post(http, proxy, chat_body()))
    await eventually(lambda: running.hold.holding == 1, within=30)
    assert await sqlite_store.fail_operation(
        operation_id,
        error=OperationError(step=None, code="probe_failed", message="probe failed"),
        at=now(),
    )
    # Nothing will move the pointer now: the request gets its error long before its bound.
    status, headers, body = await asyncio.wait_for(held, timeout=30)
    assert status == 502
    assert error_code(body) == "upstream_unreachable"
    assert 0 <= int(headers["X-Haru-Held-Ms"]) < 60_000
    assert running.hold.holding == 0
    assert counted(proxy) == 0


async def test_a_promotion_accepted_by_this_process_holds_at_once(
    sqlite_store: StateStore, stack: contextlib.AsyncExitStack, http: aiohttp.ClientSession
) -> None:
    alpha = await start_sim(stack)
    beta = await start_sim(stack)
    document = layout(
        "prod", dict.fromkeys(MODELS, alpha.url), dict.fromkeys(MODELS, beta.url)
    ).model_dump(mode="json", by_alias=True, exclude_none=True)
    for domain in document["domains"]:  # never called: this app runs no reconcile loop
        domain["supervisorUrl"] = "http://127.0.0.1:9"
    env = Setup(await apply(sqlite_store, FleetLayout.model_validate(document)), alpha, beta)
    # A lease that outlasts the test: only the accept itself can tell this process's proxy.
    settings = Settings(
        default_fleet="prod",
        route_lease_ms=60_000,
        failover_hold_ms=60_000,
        reconcile_interval_ms=None,
    )
    app = create_app(settings, store=sqlite_store)
    runner = web.AppRunner(app)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    base = f"http://{host}:{port}"
    async with http.post(f"{base}/v1/chat/completions", data=chat_body()) as resp:
        assert resp.status == 200
    running = app[proxy_key].running
    assert running is not None
    cache = running.cache
    assert not cache.promotion_in_flight(env.fleet.id)
    async with http.post(
        f"{base}/v1/fleets/prod/promote", json={"targetDomainId": str(env.fleet.beta_id)}
    ) as resp:
        assert resp.status == 202, await resp.text()
    assert cache.promotion_in_flight(env.fleet.id)


@pytest.mark.parametrize("padding", [0, 900_000], ids=["after_the_body", "mid_body"])
async def test_a_request_an_upstream_dropped_unanswered_is_sent_once_to_the_new_active(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    raw_upstream: RawUpstreamFactory,
    http: aiohttp.ClientSession,
    padding: int,
) -> None:
    # Takes the request head and closes without answering: with a large body, while the
    # proxy is still sending it.
    upstream, url = await raw_upstream("drop")
    setup = await auto_failover_setup(sqlite_store, stack, alpha_url=url)
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=60_000)
    running = proxy_of(proxy)
    body = chat_body(text="once more", padding="x" * padding)
    held = asyncio.create_task(post(http, proxy, body))
    await eventually(lambda: running.hold.holding == 1, within=30)
    # Held until the route moves: sent again to the upstream that dropped it, it would have
    # been dropped a second time and failed (a request reaches at most two upstreams).
    await promote(sqlite_store, setup.fleet)
    status, headers, _ = await held
    assert status == 200
    assert int(headers["X-Haru-Held-Ms"]) >= 0
    assert len(upstream.writers) == 1  # never sent to the dropping upstream again
    arrived = [json.loads(r.body)["messages"][0]["content"] for r in setup.beta.recorded_requests]
    assert arrived == ["once more"]
    assert counted(proxy, "haru_proxy_retried_requests") == 1
    assert counted(proxy) == 1
    assert running.hold.holding == 0


def test_held_requests_take_at_most_half_the_connection_cap() -> None:
    assert Settings().failover_hold_max == 256
    assert held_cap(256, 512) == min(256, connection_cap(512) // 2)
    assert held_cap(1_024, 64) == connection_cap(64) // 2 <= 32
    assert held_cap(8, 64) == min(8, connection_cap(64) // 2)
    assert held_cap(8, 1) == 0  # a single connection is never given to a held request


async def test_the_proxy_lowers_its_hold_cap_to_half_the_connections(
    make_proxy: ProxyFactory,
) -> None:
    proxy = await make_proxy(failover_hold_max=1_000, http_max_connections=20)
    assert proxy_of(proxy).hold.hold_max == held_cap(1_000, 20) <= 10


async def test_a_request_dropped_by_two_actives_is_not_sent_a_third_time(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    raw_upstream: RawUpstreamFactory,
    http: aiohttp.ClientSession,
) -> None:
    first, first_url = await raw_upstream("drop")
    second, second_url = await raw_upstream("drop")
    alpha = dict.fromkeys(MODELS, first_url)
    document = layout("prod", alpha, dict.fromkeys(MODELS, second_url)).model_copy(
        update={"policy": PolicyPatch(auto_failover=True)}
    )
    fleet = await apply(sqlite_store, document)
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=60_000)
    running = proxy_of(proxy)
    held = asyncio.create_task(post(http, proxy, chat_body()))
    await eventually(lambda: running.hold.holding == 1, within=30)
    await promote(sqlite_store, fleet)
    status, headers, body = await held
    assert status == 502
    assert error_code(body) == "upstream_unreachable"
    assert headers["Retry-After"] == "1"
    assert (len(first.writers), len(second.writers)) == (1, 1)
    assert counted(proxy, "haru_proxy_retried_requests") == 0


async def test_an_upstream_answer_is_never_sent_again_even_a_500(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    http: aiohttp.ClientSession,
) -> None:
    setup = await auto_failover_setup(sqlite_store, stack)
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=60_000)
    await setup.alpha.set_faults(error_500=True)
    status, headers, body = await post(http, proxy, chat_body())
    assert status == 500
    assert json.loads(body)["error"]["type"] == "InternalServerError"  # the upstream's own
    assert "X-Haru-Held-Ms" not in headers
    assert served(setup.alpha) == 1
    assert served(setup.beta) == 0
    assert proxy_of(proxy).hold.holding == 0


async def test_a_fleet_without_a_failover_coming_fails_a_dropped_request_at_once(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    raw_upstream: RawUpstreamFactory,
    http: aiohttp.ClientSession,
) -> None:
    upstream, url = await raw_upstream("drop")
    setup = await make_setup(sqlite_store, stack, extra_alpha={"chat-small": url})
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=60_000)
    status, headers, body = await post(http, proxy, chat_body())
    assert status == 502
    assert error_code(body) == "upstream_unreachable"
    assert "X-Haru-Held-Ms" not in headers
    assert len(upstream.writers) == 1
    assert served(setup.beta) == 0


async def test_a_client_gone_while_held_is_dropped(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
) -> None:
    setup = await auto_failover_setup(sqlite_store, stack)
    proxy = await make_proxy(tuning=HOLD_TUNING, failover_hold_ms=60_000)
    await setup.alpha.set_faults(refuse=True)
    running = proxy_of(proxy)
    _, writer = await raw_request(proxy, chat_body())
    await eventually(lambda: running.hold.holding == 1, within=30)
    writer.close()
    await eventually(lambda: running.hold.holding == 0, within=30)
    await promote(sqlite_store, setup.fleet)
    assert served(setup.beta) == 0
    assert counted(proxy) == 0


# -- a silent upstream mid-answer -------------------------------------------------------------


async def test_an_upstream_silent_mid_answer_is_cut_at_the_idle_bound(
    make_proxy: ProxyFactory,
    sqlite_store: StateStore,
    stack: contextlib.AsyncExitStack,
    raw_upstream: RawUpstreamFactory,
    http: aiohttp.ClientSession,
) -> None:
    upstream, url = await raw_upstream("one_event")
    await make_setup(sqlite_store, stack, extra_alpha={"chat-small": url})
    proxy = await make_proxy(upstream_idle_timeout_ms=50)
    async with http.post(
        f"{proxy.url}/v1/chat/completions",
        data=chat_body(stream=True),
        headers={"X-Haru-Fleet": "prod"},
    ) as resp:
        assert resp.status == 200
        pieces: list[bytes] = []
        with pytest.raises(aiohttp.ClientPayloadError):
            await read_into(resp, pieces)
    assert b"".join(pieces).startswith(b"data: first\n\n")
    await asyncio.wait_for(upstream.closed.wait(), 30)
    assert proxy_of(proxy).relay.idle_cuts == 1
