"""Where real vLLM differs from a kind emulator (README "Fidelity to vLLM").

Each test drives the real supervisor app on a real socket against the strict emulator
(haru-sim, which copies vLLM 0.33's behaviour unless told otherwise), or, where only the order
of requests can prove a point, against a scripted peer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from haru_protocol import SupervisorConfig, SupervisorModel
from haru_sim import VllmSim, VllmSimConfig
from haru_supervisor.api import (
    SettingsError,
    VllmAdminClient,
    VllmTimeouts,
    load_settings,
    parse_vllm_version,
    resolve_api_keys,
    version_refusal,
)
from pydantic import ValidationError

if TYPE_CHECKING:
    from conftest import SimFactory, SupervisorFactory, WaitFor


def _config(*sims: VllmSim, **model_extra: Any) -> dict[str, Any]:
    return {
        "slots": [
            {
                "kind": "inference",
                "gpuIndex": 0,
                "models": [
                    {"name": sim.config.primary_model_name, "port": sim.port, **model_extra}
                    for sim in sims
                ],
            }
        ]
    }


async def _models(client: Any, auth: dict[str, str]) -> list[dict[str, Any]]:
    response = await client.get("/v1/status", headers=auth)
    assert response.status == 200
    body = await response.json()
    models: list[dict[str, Any]] = body["slots"][0]["models"]
    return models


async def _chat(url: str, *, words: int = 3, **extra: Any) -> dict[str, Any]:
    prompt = " ".join(f"w{i}" for i in range(words))
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": prompt}], **extra},
        ) as response,
    ):
        assert response.status == 200, await response.text()
        data: dict[str, Any] = await response.json()
        return data


# -- version -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "parsed"),
    [
        ("0.33.0", (0, 33)),
        ("0.17.0rc1", (0, 17)),
        ("v0.9.2.dev3+gabc", (0, 9)),
        ("1.0.0", (1, 0)),
        ("0.17.0.post1+cu128", (0, 17)),
        ("2", (2, 0)),
        ("dev", None),
        ("0.17abc", None),
    ],
)
def test_parse_vllm_version(version: str, parsed: tuple[int, int] | None) -> None:
    assert parse_vllm_version(version) == parsed


def test_only_versions_proved_older_than_0_17_are_refused() -> None:
    assert version_refusal("0.17.0") is None
    assert version_refusal("0.33.0") is None
    assert version_refusal("unknown-build") is None
    refusal = version_refusal("0.16.2")
    assert refusal is not None
    assert "vLLM 0.16.2 is not supported" in refusal
    assert ">= 0.17.0" in refusal


async def test_status_reports_each_servers_version(
    supervisor: SupervisorFactory, sims: SimFactory, auth: dict[str, str]
) -> None:
    new = await sims("chat-new")
    legacy = await sims("chat-legacy", vllm_version="0.31.0")
    client = await supervisor(_config(new, legacy))
    models = await _models(client, auth)
    assert [(m["vllmVersion"], m["sleeping"]) for m in models] == [
        ("0.33.0", False),
        ("0.31.0", False),
    ]
    assert all("error" not in m and "action" not in m for m in models)
    # 0.31 answers /sleep and /wake_up with empty 200s: both accepted.
    assert (await client.post("/v1/vllm/sleep", headers=auth)).status == 200
    assert (new.sleeping, legacy.sleeping) == (True, True)
    assert (await client.post("/v1/vllm/wake", headers=auth)).status == 200
    assert (new.sleeping, legacy.sleeping) == (False, False)


async def test_a_server_older_than_0_17_is_refused_with_a_clear_error(
    supervisor: SupervisorFactory,
    sims: SimFactory,
    auth: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="haru_supervisor")
    old = await sims("chat-old", vllm_version="0.16.0")
    client = await supervisor(_config(old))
    (model,) = await _models(client, auth)
    assert model["vllmVersion"] == "0.16.0"
    assert model["sleeping"] is None  # never "ready" on a server the supervisor cannot drive
    assert "vLLM 0.16.0 is not supported" in model["error"]
    assert (await (await client.get("/v1/ready", headers=auth)).json()) == {"ready": False}
    assert "chat-old: vLLM 0.16.0 is not supported" in caplog.text  # at start-up

    for route in ("/v1/vllm/sleep", "/v1/vllm/wake"):
        response = await client.post(route, headers=auth)
        assert response.status == 502
        message = (await response.json())["error"]["message"]
        assert "chat-old (vLLM 0.16.0 is not supported" in message
    assert old.sleeps == 0
    assert old.wakes == 0

    response = await client.post("/v1/probe", headers=auth)
    body = await response.json()
    assert body["ok"] is False
    assert "vLLM 0.16.0 is not supported" in body["results"][0]["error"]
    assert old.requests_served.get("/v1/chat/completions", 0) == 0


async def test_the_version_is_read_again_after_a_reconnect(
    supervisor: SupervisorFactory, auth: dict[str, str], wait_for: WaitFor
) -> None:
    first = VllmSim(VllmSimConfig(served_model_names=("chat-x",), vllm_version="0.33.0"))
    await first.start()
    port = first.port
    second = VllmSim(VllmSimConfig(served_model_names=("chat-x",), vllm_version="0.16.0"))
    try:
        client = await supervisor(_config(first))
        assert (await _models(client, auth))[0]["vllmVersion"] == "0.33.0"
        await first.stop()
        (down,) = await _models(client, auth)
        assert (down["sleeping"], down["vllmVersion"]) == (None, None)
        # The server comes back on the same port as another release: it is read again.
        await second.start(port=port)
        (back,) = await _models(client, auth)
        assert back["vllmVersion"] == "0.16.0"
        assert "not supported" in back["error"]
    finally:
        await first.stop()
        await second.stop()


# -- a sleep or wake in progress is "busy" -----------------------------------------------------


async def test_a_sleep_in_progress_is_reported_busy_not_failed(
    supervisor: SupervisorFactory, sims: SimFactory, auth: dict[str, str], wait_for: WaitFor
) -> None:
    sim = await sims("chat-slow", sleep_latency_ms=800.0, wake_latency_ms=800.0)
    client = await supervisor(_config(sim))
    for action, route, asleep in (
        ("sleep", "/v1/vllm/sleep", True),
        ("wake", "/v1/vllm/wake", False),
    ):
        call = asyncio.create_task(client.post(route, headers=auth))
        seen: list[dict[str, Any]] = []

        async def busy(action: str = action, seen: list[dict[str, Any]] = seen) -> bool:
            (model,) = await _models(client, auth)
            seen.append(model)
            return model.get("action") == action

        await wait_for(busy)
        # vLLM would not answer /is_sleeping now: the supervisor does not ask, it says why.
        assert seen[-1]["sleeping"] is None
        assert (await call).status == 200
        (done,) = await _models(client, auth)
        assert "action" not in done
        assert done["sleeping"] is asleep


async def test_an_unfinished_sleep_is_confirmed_before_the_wake(
    supervisor: SupervisorFactory, sims: SimFactory, auth: dict[str, str], wait_for: WaitFor
) -> None:
    # The sleep outlasts the supervisor's bound on /sleep: the call fails, vLLM goes on.
    sim = await sims("chat-slow", sleep_latency_ms=2000.0, wake_latency_ms=5.0)
    timeouts = VllmTimeouts(admin_s=0.8, read_s=0.2, drain_poll_s=0.02, drain_quiet_s=0.05)
    client = await supervisor(_config(sim), vllm_timeouts=timeouts)
    response = await client.post("/v1/vllm/sleep", headers=auth)
    assert response.status == 502
    assert "no answer within 0.8 s" in (await response.json())["error"]["message"]
    assert sim.sleep_in_progress
    # /is_sleeping does not answer during the executor's sleep: busy, not down.
    (busy,) = await _models(client, auth)
    assert (busy["sleeping"], busy["action"]) == (None, "sleep")
    # A wake is sent only once the sleep is confirmed over; until then it is refused.
    outcomes: list[int] = []

    async def woken() -> bool:
        response = await client.post("/v1/vllm/wake", headers=auth)
        outcomes.append(response.status)
        if response.status != 200:
            assert "not waking it while that sleep may still run" in await response.text()
        return response.status == 200

    await wait_for(woken, timeout=10.0)
    assert not sim.sleeping
    assert sim.sleeps == 1
    assert sim.wakes == 1
    (awake,) = await _models(client, auth)
    assert (awake["sleeping"], awake.get("action")) == (False, None)


class OrderedPeer:
    """A vLLM whose sleep is held by the test: ``/is_sleeping`` blocks while it runs."""

    def __init__(self) -> None:
        self.sleep_done = asyncio.Event()
        self.wake_arrived_after_sleep: list[bool] = []
        self.sleeps = 0

    async def version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": "0.33.0"})

    async def sleep(self, _request: web.Request) -> web.Response:
        self.sleeps += 1
        await self.sleep_done.wait()
        return web.json_response({"status": "sleeping", "level": 1})

    async def is_sleeping(self, _request: web.Request) -> web.Response:
        await self.sleep_done.wait()  # answered between engine steps only
        return web.json_response({"is_sleeping": True})

    async def wake(self, _request: web.Request) -> web.Response:
        self.wake_arrived_after_sleep.append(self.sleep_done.is_set())
        return web.json_response({"status": "awake", "tags": None})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/version", self.version)
        app.router.add_post("/sleep", self.sleep)
        app.router.add_get("/is_sleeping", self.is_sleeping)
        app.router.add_post("/wake_up", self.wake)
        return app


async def test_no_wake_is_sent_while_a_timed_out_sleep_may_still_run(
    supervisor: SupervisorFactory, aiohttp_server: Any, auth: dict[str, str]
) -> None:
    peer = OrderedPeer()
    server: TestServer = await aiohttp_server(peer.app())
    config = {
        "slots": [
            {"kind": "inference", "gpuIndex": 0, "models": [{"name": "m", "port": server.port}]}
        ]
    }
    timeouts = VllmTimeouts(admin_s=0.3, read_s=0.1, drain_poll_s=0.02, drain_quiet_s=0.05)
    client = await supervisor(config, vllm_timeouts=timeouts)
    assert (await client.post("/v1/vllm/sleep", headers=auth)).status == 502
    # While the sleep may still run, a wake is refused after admin_s of trying to confirm.
    response = await client.post("/v1/vllm/wake", headers=auth)
    assert response.status == 502
    assert (
        "not waking it while that sleep may still run"
        in (await response.json())["error"]["message"]
    )
    assert peer.wake_arrived_after_sleep == []
    # Once vLLM finished the sleep, the next wake confirms it and is sent.
    wake = asyncio.create_task(client.post("/v1/vllm/wake", headers=auth))
    await asyncio.sleep(0.05)
    peer.sleep_done.set()
    assert (await wake).status == 200
    assert peer.wake_arrived_after_sleep == [True]
    assert peer.sleeps == 1


# -- sleep mode: abort, never parked for hours -------------------------------------------------


async def test_a_queued_straggler_is_aborted_not_parked_until_the_next_wake(
    supervisor: SupervisorFactory, sims: SimFactory, auth: dict[str, str], wait_for: WaitFor
) -> None:
    # One running slot: the second request waits (no KV blocks). Under mode=wait vLLM would
    # park it until the next wake (hours on a standby); the supervisor's abort ends it now.
    sim = await sims("chat-one", max_num_seqs=1, token_latency_ms=50.0)
    client = await supervisor(_config(sim))
    running = asyncio.create_task(_chat(sim.url, words=200))
    queued = asyncio.create_task(_chat(sim.url, words=200))
    await wait_for(lambda: sim.num_running == 1 and sim.num_waiting == 1)
    response = await client.post("/v1/vllm/sleep", json={"drainTimeoutMs": 100}, headers=auth)
    assert response.status == 200
    results = await asyncio.gather(running, queued)
    assert [r["choices"][0]["finish_reason"] for r in results] == ["abort", "abort"]
    assert sim.sleeping
    assert sim.num_parked == 0
    assert sim.parked_total == 0


async def test_sleeping_an_asleep_server_aborts_what_is_parked_there(
    supervisor: SupervisorFactory, sims: SimFactory, auth: dict[str, str], wait_for: WaitFor
) -> None:
    sim = await sims("chat-asleep", start_asleep=True)
    client = await supervisor(_config(sim))
    parked = asyncio.create_task(_chat(sim.url))
    await wait_for(lambda: sim.num_parked == 1)
    response = await client.post("/v1/vllm/sleep", json={"drainTimeoutMs": 1000}, headers=auth)
    assert response.status == 200
    result = await parked
    assert result["choices"][0]["finish_reason"] == "abort"
    assert sim.sleeping
    assert sim.num_parked == 0


async def test_a_drained_sleep_fails_no_request(
    supervisor: SupervisorFactory, sims: SimFactory, auth: dict[str, str], wait_for: WaitFor
) -> None:
    sim = await sims("chat-busy", max_num_seqs=2, token_latency_ms=5.0)
    client = await supervisor(_config(sim))
    requests = [asyncio.create_task(_chat(sim.url, words=20)) for _ in range(5)]
    await wait_for(lambda: sim.num_running == 2 and sim.num_waiting >= 1)
    response = await client.post("/v1/vllm/sleep", json={"drainTimeoutMs": 10_000}, headers=auth)
    assert response.status == 200
    results = await asyncio.gather(*requests)
    assert {r["choices"][0]["finish_reason"] for r in results} == {"stop"}
    assert sim.sleeping
    assert sim.parked_total == 0
    assert sim.arrived_while_sleeping == 0


# -- metrics without gauges --------------------------------------------------------------------


async def test_missing_gauges_are_reported_once_naming_the_flag(
    supervisor: SupervisorFactory,
    sims: SimFactory,
    auth: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    sim = await sims("chat-nostats", log_stats=False)
    client = await supervisor(_config(sim))
    for _ in range(2):
        response = await client.post("/v1/vllm/sleep", json={"drainTimeoutMs": 500}, headers=auth)
        assert response.status == 200  # slept anyway (mode=abort)
        assert (await client.post("/v1/vllm/wake", headers=auth)).status == 200
    reports = [r for r in caplog.records if "--disable-log-stats" in r.getMessage()]
    assert len(reports) == 1
    assert reports[0].levelno == logging.ERROR
    assert "vllm:num_requests_running" in reports[0].getMessage()


# -- the probe: reasoning, length, API key -----------------------------------------------------


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
async def test_a_probe_answered_with_reasoning_only_is_ok(
    supervisor: SupervisorFactory, sims: SimFactory, auth: dict[str, str], field: str
) -> None:
    sim = await sims("chat-think", reasoning_field=field, reasoning_tokens=8)
    # What the probe gets: reasoning only, content null, cut at length.
    completion = await _chat(sim.url, max_tokens=4)
    (choice,) = completion["choices"]
    assert choice["message"]["content"] is None
    assert choice["message"][field]
    client = await supervisor(_config(sim))
    body = await (await client.post("/v1/probe", headers=auth)).json()
    assert body["ok"] is True, body


async def test_a_probe_stopped_at_length_is_ok(aiohttp_server: Any) -> None:
    async def chat(_request: web.Request) -> web.Response:
        message = {"role": "assistant", "content": None}
        return web.json_response({"choices": [{"message": message, "finish_reason": "length"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/version", OrderedPeer().version)
    server: TestServer = await aiohttp_server(app)
    assert server.port is not None
    async with aiohttp.ClientSession() as session:
        client = VllmAdminClient(session)
        model = SupervisorModel(name="m", port=server.port)
        result = await client.probe(model, prompt="ping", max_tokens=4, timeout_s=2.0)
    assert result.ok, result.error


API_KEY = "vllm-key-4b1d2e7c9a"


async def test_the_probe_sends_the_models_api_key(
    supervisor: SupervisorFactory,
    sims: SimFactory,
    auth: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    sim = await sims("chat-keyed", api_key=API_KEY)
    config = _config(sim, apiKeyEnv="CHAT_KEYED_API_KEY")

    keyless = await supervisor(config)
    body = await (await keyless.post("/v1/probe", headers=auth)).json()
    assert body["ok"] is False
    assert "HTTP 401" in body["results"][0]["error"]

    keys = resolve_api_keys(
        SupervisorConfig.model_validate(config), {"CHAT_KEYED_API_KEY": API_KEY}
    )
    client = await supervisor(config, vllm_api_keys=keys)
    response = await client.post("/v1/probe", headers=auth)
    text = await response.text()
    assert '"ok":true' in text.replace(" ", "")
    # The admin routes and /metrics need no key; they still work.
    assert (
        await client.post("/v1/vllm/sleep", json={"drainTimeoutMs": 200}, headers=auth)
    ).status == 200
    assert (await client.post("/v1/vllm/wake", headers=auth)).status == 200
    status = await (await client.get("/v1/status", headers=auth)).text()
    assert API_KEY not in status
    assert API_KEY not in text
    assert API_KEY not in caplog.text
    header = dict(sim.recorded_requests[-1].headers)
    assert header.get("Authorization") == f"Bearer {API_KEY}"


def test_api_keys_come_from_a_variable_or_a_file(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"  {API_KEY}\n", encoding="utf-8")
    config = {
        "slots": [
            {
                "kind": "inference",
                "gpuIndex": 0,
                "models": [
                    {"name": "a", "port": 8001, "apiKeyEnv": "A_KEY"},
                    {"name": "b", "port": 8002, "apiKeyFile": str(key_file)},
                    {"name": "c", "port": 8003},
                ],
            }
        ]
    }
    env = {"HARU_SUPERVISOR_CONFIG": json.dumps(config), "A_KEY": "key-a", "KEEP": "1"}
    settings = load_settings(env)
    assert {name: key.get_secret_value() for name, key in settings.vllm_api_keys.items()} == {
        "a": "key-a",
        "b": API_KEY,
    }
    assert "key-a" not in repr(settings)
    assert API_KEY not in repr(settings)
    # A trainer never inherits the variable holding a key.
    assert "A_KEY" not in settings.trainer_env
    assert settings.trainer_env["KEEP"] == "1"


@pytest.mark.parametrize(
    ("model", "env", "match"),
    [
        ({"apiKeyEnv": "MISSING"}, {}, "apiKeyEnv names 'MISSING', which is unset or blank"),
        ({"apiKeyEnv": "BLANK"}, {"BLANK": "  "}, "unset or blank"),
        ({"apiKeyFile": "/nonexistent/key"}, {}, "cannot read apiKeyFile"),
    ],
)
def test_a_missing_api_key_stops_the_supervisor(
    model: dict[str, str], env: dict[str, str], match: str
) -> None:
    config = {
        "slots": [
            {"kind": "inference", "gpuIndex": 0, "models": [{"name": "a", "port": 1, **model}]}
        ]
    }
    with pytest.raises(SettingsError, match=match):
        load_settings({"HARU_SUPERVISOR_CONFIG": json.dumps(config), **env})


def test_a_model_takes_one_key_source() -> None:
    with pytest.raises(ValidationError, match="apiKeyEnv or apiKeyFile, not both"):
        SupervisorConfig.model_validate(
            {
                "slots": [
                    {
                        "kind": "inference",
                        "gpuIndex": 0,
                        "models": [{"name": "a", "port": 1, "apiKeyEnv": "X", "apiKeyFile": "/k"}],
                    }
                ]
            }
        )
