"""The proxy through a state-store outage, on both engines (DESIGN 7.5 fail-open rules).

PostgreSQL lane: the proxy's store talks to PostgreSQL through a TCP forwarder on 127.0.0.1
that the test cuts (connections dropped, new ones refused) or black-holes (bytes stop
flowing). SQLite lane: the proxy's store is the real store behind a switch that raises
``StateStoreUnavailableError``, the error every statement failure becomes. The fleet itself
lives in the real database and is changed through the real store.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast
from uuid import UUID

import aiohttp
import pytest
import sqlalchemy as sa
from aiohttp import web
from haru_db import StateStore, StateStoreUnavailableError
from haru_db.testing import confirm_domains
from haru_protocol import (
    FleetLayout,
    FleetRoutePointer,
    FleetSnapshot,
    InferenceSlotState,
    OperationKind,
    OperationStep,
    SlotKind,
)
from haru_server._proxy import ProxyTuning
from haru_server._settings import Settings
from haru_sim import VllmSim, VllmSimConfig
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

MODELS = ("chat-small", "embed-small")
PLACEMENT = {"cloud": "aws", "region": "us-east-1", "accelerator": "EXAMPLE-GPU"}
TUNING = ProxyTuning(disconnect_poll_ms=20, outage_memo_ms=50, pointer_timeout_ms=250)


def now() -> datetime:
    return datetime.now(UTC)


def served(sim: VllmSim) -> int:
    """Inference requests ``sim`` received (a function, so no assertion narrows the count)."""
    return len(sim.recorded_requests)


# -- the outage switches -----------------------------------------------------------------------


@dataclass
class TcpCut:
    """A TCP forwarder to PostgreSQL that can be cut or black-holed, and restored."""

    target: tuple[str, int]
    mode: str = "open"
    flowing: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None
    writers: set[asyncio.StreamWriter] = field(default_factory=set)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    async def start(self) -> int:
        self.flowing.set()
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    def _track(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._track()
        self.writers.add(client_w)
        if self.mode == "down":
            client_w.close()
            return
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        self.writers.add(server_w)
        await asyncio.gather(
            self._pipe(client_r, server_w), self._pipe(server_r, client_w), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self.flowing.wait()  # black-holed: bytes stop here
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def cut(self) -> None:
        self.mode = "down"
        for writer in list(self.writers):
            writer.close()
        self.writers.clear()

    def hang(self) -> None:
        self.mode = "hang"
        self.flowing.clear()

    def restore(self) -> None:
        self.mode = "open"
        self.flowing.set()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        self.restore()
        for writer in list(self.writers):
            writer.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()


class SwitchedStore:
    """The real store behind a switch: down, every read fails like an unreachable database."""

    def __init__(self, inner: StateStore) -> None:
        self.inner = inner
        self.down = False
        self.snapshots_down = False

    def _check(self) -> None:
        if self.down:
            raise StateStoreUnavailableError("database unreachable (injected OperationalError)")

    async def get_fleet_route_pointer(self, ref: str) -> FleetRoutePointer | None:
        self._check()
        return await self.inner.get_fleet_route_pointer(ref)

    async def record_route_lease(self, fleet_id: UUID, lease_ms: int) -> bool:
        self._check()
        return await self.inner.record_route_lease(fleet_id, lease_ms)

    async def get_fleet_snapshot(self, ref: str) -> FleetSnapshot | None:
        self._check()
        if self.snapshots_down:
            raise StateStoreUnavailableError("database unreachable (injected OperationalError)")
        return await self.inner.get_fleet_snapshot(ref)


@dataclass
class Outage:
    """The store the proxy uses, and how to take it down and bring it back."""

    proxy_store: StateStore
    cut: Callable[[], None]
    restore: Callable[[], None]
    lane: str


@pytest.fixture
async def outage(store: StateStore) -> AsyncIterator[Outage]:
    if store.dialect == "postgresql":
        url = make_url(store.url)
        assert url.host is not None, "the PostgreSQL lane must use TCP for this test"
        forwarder = TcpCut((url.host, url.port or 5432))
        port = await forwarder.start()
        proxied = StateStore.open(
            url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
        )
        try:
            yield Outage(proxied, forwarder.cut, forwarder.restore, "postgresql")
        finally:
            forwarder.restore()
            await proxied.close()
            await forwarder.stop()
    else:
        switched = SwitchedStore(store)

        def cut() -> None:
            switched.down = True

        def restore() -> None:
            switched.down = False

        # The proxy needs only the two reads SwitchedStore provides.
        yield Outage(cast(StateStore, switched), cut, restore, "sqlite")


# -- app and fleet -----------------------------------------------------------------------------


ProxyFactory = Callable[..., Awaitable[str]]


@pytest.fixture
def make_proxy(
    proxy_app: Callable[..., web.Application], serve_app: Callable[..., Awaitable[str]]
) -> ProxyFactory:
    async def make(store: StateStore, *, tuning: ProxyTuning = TUNING, **overrides: Any) -> str:
        # route_lease_ms=0: the read-per-request mode (leases: test_route_lease).
        settings = Settings(**{"snapshot_cache_ttl_ms": 2_000, "route_lease_ms": 0, **overrides})
        return await serve_app(proxy_app(store, settings, clock=now, tuning=tuning))

    return make


@dataclass
class Fleet:
    id: UUID
    alpha_id: UUID
    beta_id: UUID
    alpha: VllmSim
    beta: VllmSim


@pytest.fixture
async def fleet(store: StateStore) -> AsyncIterator[Fleet]:
    async with contextlib.AsyncExitStack() as stack:
        alpha = await stack.enter_async_context(VllmSim(VllmSimConfig(served_model_names=MODELS)))
        beta = await stack.enter_async_context(VllmSim(VllmSimConfig(served_model_names=MODELS)))

        def domain(slug: str, sim: VllmSim) -> dict[str, Any]:
            models = [{"name": m, "servingUrl": sim.url} for m in MODELS]
            return {
                "slug": slug,
                "placement": PLACEMENT,
                "slots": [{"kind": "inference", "gpuIndex": 0, "models": models}],
            }

        fleet_layout = FleetLayout.model_validate(
            {
                "slug": "prod",
                "activeDomainSlug": "alpha",
                "domains": [domain("alpha", alpha), domain("beta", beta)],
            }
        )
        result = await store.apply_fleet_layout(fleet_layout, at=now())
        await confirm_domains(store, "prod", at=now())
        snapshot = await store.get_fleet_snapshot("prod")
        assert snapshot is not None
        ids = {d.slug: d.id for d in snapshot.domains}
        yield Fleet(result.fleet_id, ids["alpha"], ids["beta"], alpha, beta)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


CHAT = json.dumps({"model": "chat-small", "messages": [{"role": "user", "content": "hi there"}]})
STREAM = json.dumps(
    {"model": "chat-small", "messages": [{"role": "user", "content": "a b c"}], "stream": True}
)


async def chat(
    http: aiohttp.ClientSession, url: str, body: str = CHAT
) -> tuple[int, dict[str, str], bytes]:
    async with http.post(
        f"{url}/v1/chat/completions",
        data=body,
        headers={"X-Haru-Fleet": "prod", "Content-Type": "application/json"},
    ) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def code_of(body: bytes) -> str:
    code = json.loads(body)["error"]["code"]
    assert isinstance(code, str)
    return code


async def promote(store: StateStore, fleet: Fleet) -> None:
    at = now()
    operation, _ = await store.create_operation(
        fleet_id=fleet.id, kind=OperationKind.PROMOTE, target_domain_id=fleet.beta_id, at=at
    )
    assert await store.claim_operation(operation.id, first_step=OperationStep.STOP_TRAINING, at=at)
    for before, after in (
        (InferenceSlotState.SLEEPING, InferenceSlotState.WAKING),
        (InferenceSlotState.WAKING, InferenceSlotState.PROBING),
        (InferenceSlotState.PROBING, InferenceSlotState.SERVING),
    ):
        await store.transition_domain_slots(
            fleet.beta_id, kind=SlotKind.INFERENCE, from_states=[before], to=after, at=at
        )
    assert await store.switch_active(
        fleet_id=fleet.id,
        expected_active_domain_id=fleet.alpha_id,
        target_domain_id=fleet.beta_id,
        operation_id=operation.id,
        at=at,
    )


# -- tests -------------------------------------------------------------------------------------


async def test_warm_cache_keeps_answering_through_an_outage(
    make_proxy: ProxyFactory, fleet: Fleet, outage: Outage, http: aiohttp.ClientSession
) -> None:
    monotonic = [1_000.0]
    url = await make_proxy(
        outage.proxy_store,
        tuning=dataclasses.replace(TUNING, monotonic=lambda: monotonic[0]),
        snapshot_cache_ttl_ms=50,
    )
    status, headers, _ = await chat(http, url)
    assert status == 200
    assert "X-Haru-Routing" not in headers
    outage.cut()
    answers = [await chat(http, url, STREAM if i % 4 == 0 else CHAT) for i in range(24)]
    monotonic[0] += 1  # well past the TTL and the outage memo: stale serving ignores the TTL
    answers.append(await chat(http, url))
    assert [status for status, _, _ in answers] == [200] * len(answers)
    assert all(headers.get("X-Haru-Routing") == "stale" for _, headers, _ in answers)
    assert all(b"[DONE]" in body for i, (_, _, body) in enumerate(answers[:-1]) if i % 4 == 0)
    assert served(fleet.beta) == 0
    # Errors decided on stale routing say so too; the model list is served from the cache.
    status, headers, body = await chat(http, url, CHAT.replace("chat-small", "chat-huge"))
    assert status == 404
    assert code_of(body) == "model_not_found"
    assert headers["X-Haru-Routing"] == "stale"
    async with http.get(f"{url}/v1/models", headers={"X-Haru-Fleet": "prod"}) as resp:
        assert resp.status == 200
        assert resp.headers["X-Haru-Routing"] == "stale"
        assert [m["id"] for m in (await resp.json())["data"]] == list(MODELS)

    outage.restore()

    async def fresh() -> bool:
        status, headers, _ = await chat(http, url)
        assert status == 200
        return "X-Haru-Routing" not in headers

    for _ in range(100):
        monotonic[0] += 1  # past the outage memo: the next request probes the store
        if await fresh():
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("routing never became fresh again after the store came back")


async def test_cold_fleet_during_an_outage_is_503(
    make_proxy: ProxyFactory, fleet: Fleet, outage: Outage, http: aiohttp.ClientSession
) -> None:
    url = await make_proxy(outage.proxy_store)
    outage.cut()
    status, headers, body = await chat(http, url)
    assert status == 503
    assert code_of(body) == "state_store_unavailable"
    assert "X-Haru-Routing" not in headers
    assert headers["Retry-After"] == "1"  # an outage to wait out
    async with http.get(f"{url}/v1/models", headers={"X-Haru-Fleet": "prod"}) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
    assert served(fleet.alpha) == 0


async def test_moved_pointer_whose_snapshot_fails_is_503_and_forgotten(
    make_proxy: ProxyFactory, fleet: Fleet, store: StateStore, http: aiohttp.ClientSession
) -> None:
    switched = SwitchedStore(store)
    monotonic = [1_000.0]
    url = await make_proxy(
        cast(StateStore, switched),
        tuning=dataclasses.replace(TUNING, monotonic=lambda: monotonic[0]),
        snapshot_cache_ttl_ms=600_000,
    )
    assert (await chat(http, url))[0] == 200
    await promote(store, fleet)  # the real pointer moves
    switched.snapshots_down = True
    status, _, body = await chat(http, url)
    assert status == 503
    assert code_of(body) == "state_store_unavailable"
    # The superseded entry is gone: a full outage now finds nothing to resurrect.
    switched.down = True
    status, _, body = await chat(http, url)
    assert status == 503
    assert code_of(body) == "state_store_unavailable"
    assert served(fleet.alpha) == 1
    switched.down = switched.snapshots_down = False
    monotonic[0] += 1  # past the outage memo
    assert (await chat(http, url))[0] == 200
    assert served(fleet.beta) == 1


async def test_malformed_state_is_503_never_served(
    make_proxy: ProxyFactory, fleet: Fleet, store: StateStore, http: aiohttp.ClientSession
) -> None:
    url = await make_proxy(store, snapshot_cache_ttl_ms=1)
    assert (await chat(http, url))[0] == 200
    engine = create_async_engine(store.url)
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text("""UPDATE domains SET placement = '{"cloud": 42}'"""))
    finally:
        await engine.dispose()
    await asyncio.sleep(0.01)
    for _ in range(2):
        status, headers, body = await chat(http, url)
        assert status == 503
        assert code_of(body) == "state_store_unavailable"
        assert "X-Haru-Routing" not in headers
        assert "Retry-After" not in headers  # waiting does not mend malformed state
    assert served(fleet.alpha) == 1


async def test_a_hung_database_turns_into_stale_serving_quickly(
    make_proxy: ProxyFactory, postgres_store: StateStore, http: aiohttp.ClientSession
) -> None:
    url = make_url(postgres_store.url)
    assert url.host is not None
    forwarder = TcpCut((url.host, url.port or 5432))
    port = await forwarder.start()
    proxied = StateStore.open(
        url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
    )
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(forwarder.stop)
        stack.push_async_callback(proxied.close)
        stack.callback(forwarder.restore)
        sim = await stack.enter_async_context(VllmSim(VllmSimConfig(served_model_names=MODELS)))
        layout = FleetLayout.model_validate(
            {
                "slug": "prod",
                "activeDomainSlug": "alpha",
                "domains": [
                    {
                        "slug": "alpha",
                        "placement": PLACEMENT,
                        "slots": [
                            {
                                "kind": "inference",
                                "gpuIndex": 0,
                                "models": [{"name": "chat-small", "servingUrl": sim.url}],
                            }
                        ],
                    }
                ],
            }
        )
        await postgres_store.apply_fleet_layout(layout, at=now())
        await confirm_domains(postgres_store, layout.slug, at=now())
        proxy_url = await make_proxy(proxied, tuning=ProxyTuning(pointer_timeout_ms=100))
        assert (await chat(http, proxy_url))[0] == 200
        forwarder.hang()
        status, headers, _ = await asyncio.wait_for(chat(http, proxy_url), timeout=5)
        assert status == 200
        assert headers["X-Haru-Routing"] == "stale"
