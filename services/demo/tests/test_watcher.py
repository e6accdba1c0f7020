"""The live view's poller against a real HTTP control API (serving recorded answers) and real
emulated vLLM servers."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from haru_demo._view import FleetWatcher, ViewState
from haru_server.control_client import ControlClient
from haru_sim import VllmSim, VllmSimConfig

DATA = Path(__file__).parent / "data"
ServerFactory = Callable[[web.Application], Awaitable[TestServer]]


def load(name: str) -> Any:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def control_app(*, up: list[bool]) -> web.Application:
    """A control API answering from recordings; ``up[0] = False`` makes it answer 503."""
    fleet = load("fleet-after-promotion.json")
    events = load("events-promotion.json")["events"]
    operation = load("operation-promotion.json")

    def unavailable() -> web.Response:
        body = {"error": {"code": "state_store_unavailable", "message": "store down"}}
        return web.json_response(body, status=503)

    async def get_fleet(request: web.Request) -> web.Response:
        return web.json_response(fleet) if up[0] else unavailable()

    async def get_events(request: web.Request) -> web.Response:
        after = int(request.query.get("after", "0"))
        limit = int(request.query.get("limit", "100"))
        page = [e for e in events if e["id"] > after][:limit]
        next_after = page[-1]["id"] if len(page) == limit else None
        return web.json_response({"events": page, "nextAfter": next_after})

    async def get_operation(request: web.Request) -> web.Response:
        assert request.match_info["id"] == operation["id"]
        return web.json_response(operation)

    app = web.Application()
    app.router.add_get("/v1/fleets/{ref}", get_fleet)
    app.router.add_get("/v1/fleets/{ref}/events", get_events)
    app.router.add_get("/v1/fleets/{ref}/operations/{id}", get_operation)
    return app


async def chat(session: aiohttp.ClientSession, url: str, times: int) -> None:
    for _ in range(times):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200


async def test_the_watcher_follows_the_api_and_counts_what_each_domain_served(
    aiohttp_server: ServerFactory,
) -> None:
    up = [True]
    server = await aiohttp_server(control_app(up=up))
    async with (
        VllmSim(VllmSimConfig(served_model_names=("m",))) as alpha,
        VllmSim(VllmSimConfig(served_model_names=("m",))) as beta,
        ControlClient(str(server.make_url("")).rstrip("/"), token=None) as control,
        aiohttp.ClientSession() as session,
    ):
        await chat(session, alpha.url, 3)
        await chat(session, beta.url, 2)
        state = ViewState(server_url="http://127.0.0.1:8700")
        watcher = FleetWatcher(
            state,
            fleet="example",
            control=control,
            session=session,
            vllm_urls={"alpha": [alpha.url], "beta": [beta.url]},
        )
        await watcher.poll()
        assert state.error is None
        assert state.fleet is not None
        assert state.fleet.slug == "example"
        assert len(watcher.all_events) == len(load("events-promotion.json")["events"])
        assert [e.id for e in state.events] == [e.id for e in watcher.all_events[-6:]]
        assert state.operation is not None
        assert state.operation.state.value == "succeeded"
        assert state.served == {"alpha": 3, "beta": 2}

        # beta's server is restarted on its port: what it served before still counts.
        port = beta.port
        await beta.stop()
        await watcher.poll()
        assert state.served == {"alpha": 3, "beta": 2}
        restarted = VllmSim(VllmSimConfig(served_model_names=("m",)))
        await restarted.start(port=port)
        try:
            await chat(session, restarted.url, 1)
            await watcher.poll()
            assert state.served == {"alpha": 3, "beta": 3}
        finally:
            await restarted.stop()

        # The store is down: the view says so and keeps what it knew.
        up[0] = False
        await watcher.poll()
        assert "state_store_unavailable" in (watcher.state.error or "")
        assert watcher.state.fleet is not None
