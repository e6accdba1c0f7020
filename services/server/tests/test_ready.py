"""``/readyz`` (store, schema, loop) and the settable listening address, on real sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import aiohttp
from haru_db import StateStore, downgrade
from haru_db.testing import DatabaseUrlFactory
from haru_server._app import create_app
from haru_server._keys import control_plane_key
from haru_server._settings import Settings
from haru_web import serving
from pydantic import SecretStr

TOKEN = "ready-test-token-0123456789"

Serve = Callable[..., AbstractAsyncContextManager[str]]


@asynccontextmanager
async def served(settings: Settings, store: StateStore) -> AsyncIterator[tuple[str, object]]:
    app = create_app(settings, store=store)
    async with serving(
        app, host=settings.host, port=0, limits=settings.http_limits, shutdown_timeout=1
    ) as listening:
        yield listening.url, app


async def get(url: str, **kwargs: object) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as http, http.get(url, **kwargs) as response:  # type: ignore[arg-type]
        return response.status, await response.json()


def not_ready(status: int, body: dict[str, object]) -> str:
    assert status == 503
    assert set(body) == {"error"}
    error = body["error"]
    assert isinstance(error, dict)
    assert set(error) == {"code", "message"}
    assert error["code"] == "not_ready"
    message = error["message"]
    assert isinstance(message, str)
    return message


async def test_ready_when_the_store_answers_at_head(store: StateStore) -> None:
    async with served(Settings(api_token=SecretStr(TOKEN), reconcile_interval_ms=None), store) as (
        url,
        _,
    ):
        # Open like /healthz: a load balancer probes it without the token.
        assert await get(url + "/readyz") == (
            200,
            {"ready": True, "checks": ["state store", "schema at head", "clock"]},
        )


async def test_not_ready_when_the_schema_is_not_at_head(
    sqlite_url_factory: DatabaseUrlFactory,
) -> None:
    url = await sqlite_url_factory()
    await downgrade(url)
    store = StateStore.open(url)
    try:
        async with served(Settings(reconcile_interval_ms=None), store) as (base, _):
            message = not_ready(*await get(base + "/readyz"))
            assert "schema" in message
            assert "haru db upgrade" in message
            # Liveness is untouched by the store.
            assert await get(base + "/healthz") == (200, {"ok": True})
    finally:
        await store.close()


async def test_not_ready_when_the_store_does_not_answer() -> None:
    broken = StateStore.open("postgresql://haru:secret-pw@127.0.0.1:1/haru", call_timeout_s=2)
    try:
        async with served(Settings(reconcile_interval_ms=None), broken) as (base, _):
            message = not_ready(*await get(base + "/readyz"))
            assert message.startswith("not ready: state store")
            assert "secret-pw" not in message
            assert await get(base + "/healthz") == (200, {"ok": True})
    finally:
        await broken.close()


async def test_ready_follows_the_reconcile_loop(store: StateStore) -> None:
    settings = Settings(reconcile_interval_ms=50)
    async with served(settings, store) as (base, app):
        async with asyncio.timeout(10):
            while True:
                status, body = await get(base + "/readyz")
                if status == 200:
                    break
                assert "first pass" in not_ready(status, body)
                await asyncio.sleep(0.02)
        assert body["checks"] == ["state store", "schema at head", "clock", "reconcile loop"]
        loop = app[control_plane_key].loop  # type: ignore[index]
        assert loop is not None
        assert loop.stalled(time.monotonic()) is None
        # A loop that stopped passing for longer than its window is reported.
        later = time.monotonic() + loop.stale_after_s + 1
        assert (loop.stalled(later) or "").startswith("the reconcile loop has not ticked for")
        await loop.stop()
        message = not_ready(*await get(base + "/readyz"))
        assert message == "not ready: the reconcile loop is not running"


async def test_without_a_token_a_network_bind_needs_the_opt_in(store: StateStore) -> None:
    fleets_as = {"headers": {"Host": "haru-server:8700"}}
    # Default: loopback only, and a non-loopback Host is refused (DNS rebinding).
    async with served(Settings(reconcile_interval_ms=None), store) as (base, _):
        assert base.startswith("http://127.0.0.1:")
        status, body = await get(base + "/v1/fleets", **fleets_as)
        assert (status, body["error"]["code"]) == (403, "forbidden")  # type: ignore[index]
    # Opted in: listens on every interface and answers its network name.
    settings = Settings(bind_host="0.0.0.0", allow_open_bind=True, reconcile_interval_ms=None)
    assert settings.open_to_network
    async with served(settings, store) as (base, _):
        assert await get(base + "/v1/fleets", **fleets_as) == (200, {"fleets": []})
        headers = {"Host": "haru-server:8700", "Origin": "http://evil.example"}
        status, _body = await get(base + "/v1/fleets", headers=headers)
        assert status == 403
