"""The supervisor API over real sockets, against emulated vLLM servers and real trainers."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from haru_protocol import SupervisorConfig, SupervisorStatus
from haru_sim import VllmSim, read_trainer_checkpoint
from haru_supervisor._keys import actions_key, runs_key
from haru_supervisor._settings import TOKEN_VAR
from haru_supervisor.api import Settings, VllmTimeouts, create_app

Command = Callable[..., tuple[str, ...]]

ROUTES = [
    ("GET", "/v1/status"),
    ("GET", "/v1/ready"),
    ("POST", "/v1/vllm/sleep"),
    ("POST", "/v1/vllm/wake"),
    ("POST", "/v1/training/start"),
    ("POST", "/v1/training/stop"),
    ("GET", "/v1/training/status"),
    ("GET", "/v1/gpu/memory"),
    ("POST", "/v1/probe"),
    ("GET", "/v1/no-such-route"),
]


def _inference(gpu: int, *sims: VllmSim) -> dict[str, Any]:
    return {
        "kind": "inference",
        "gpuIndex": gpu,
        "models": [{"name": sim.config.primary_model_name, "port": sim.port} for sim in sims],
    }


def _training(gpu: int, command: tuple[str, ...], checkpoint_dir: Path) -> dict[str, Any]:
    return {
        "kind": "training",
        "gpuIndex": gpu,
        "command": list(command),
        "checkpointDir": str(checkpoint_dir),
    }


async def _error(response: aiohttp.ClientResponse, status: int, code: str) -> str:
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    message: str = body["error"]["message"]
    return message


@pytest.fixture
async def fleet(sims: Any) -> tuple[VllmSim, VllmSim, VllmSim]:
    """GPU 0 runs two small models, GPU 1 one large model."""
    return (await sims("chat-a"), await sims("chat-b"), await sims("chat-large"))


@pytest.fixture
def fleet_config(fleet: tuple[VllmSim, VllmSim, VllmSim]) -> dict[str, Any]:
    a, b, large = fleet
    return {"slots": [_inference(0, a, b), _inference(1, large)]}


# -- auth and envelope -------------------------------------------------------------------------


async def test_healthz_is_open(supervisor: Any, fleet_config: dict[str, Any]) -> None:
    client = await supervisor(fleet_config)
    response = await client.get("/healthz")
    assert response.status == 200
    assert await response.json() == {"ok": True}


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token"},
        {"Authorization": "Basic c3VwLXRlc3QtdG9rZW4tN2YzYTljOg=="},
        {"Authorization": "sup-test-token-7f3a9c"},
    ],
)
async def test_every_v1_route_needs_the_token(
    supervisor: Any, fleet_config: dict[str, Any], method: str, path: str, headers: dict[str, str]
) -> None:
    client = await supervisor(fleet_config)
    response = await client.request(method, path, headers=headers)
    await _error(response, 401, "unauthorized")
    assert response.headers["WWW-Authenticate"] == 'Bearer realm="haru"'


async def test_the_scheme_is_case_insensitive(
    supervisor: Any, fleet_config: dict[str, Any]
) -> None:
    client = await supervisor(fleet_config)
    response = await client.get(
        "/v1/ready", headers={"Authorization": "bearer   sup-test-token-7f3a9c "}
    )
    assert response.status == 200


async def test_without_a_token_the_api_is_open(
    supervisor: Any, fleet_config: dict[str, Any]
) -> None:
    client = await supervisor(fleet_config, token="   ")
    assert (await client.get("/v1/ready")).status == 200


async def test_unknown_routes_and_methods_use_the_envelope(
    supervisor: Any, fleet_config: dict[str, Any], auth: dict[str, str]
) -> None:
    client = await supervisor(fleet_config)
    await _error(await client.get("/v1/no-such-route", headers=auth), 404, "not_found")
    await _error(await client.get("/nope"), 404, "not_found")
    response = await client.get("/v1/vllm/sleep", headers=auth)
    await _error(response, 405, "method_not_allowed")
    assert "POST" in response.headers["Allow"]


async def test_an_oversized_body_is_refused(
    supervisor: Any, fleet_config: dict[str, Any], auth: dict[str, str]
) -> None:
    client = await supervisor(fleet_config)
    response = await client.post("/v1/vllm/sleep", data=b"{" + b" " * 100_000 + b"}", headers=auth)
    await _error(response, 413, "payload_too_large")


# -- status and ready --------------------------------------------------------------------------


V = {"vllmVersion": "0.33.0"}
"""What the emulator's ``GET /version`` says by default."""


async def test_status_reports_every_slot(
    supervisor: Any,
    fleet: tuple[VllmSim, VllmSim, VllmSim],
    auth: dict[str, str],
    tmp_path: Path,
    sim_trainer: Command,
) -> None:
    a, b, large = fleet
    config = {
        "slots": [_inference(0, a, b), _inference(1, large), _training(2, sim_trainer(), tmp_path)]
    }
    client = await supervisor(config)
    response = await client.get("/v1/status", headers=auth)
    assert response.status == 200
    body = await response.json()
    assert body == {
        "slots": [
            {
                "gpuIndex": 0,
                "kind": "inference",
                "models": [
                    {"name": "chat-a", "port": a.port, "sleeping": False, **V},
                    {"name": "chat-b", "port": b.port, "sleeping": False, **V},
                ],
            },
            {
                "gpuIndex": 1,
                "kind": "inference",
                "models": [{"name": "chat-large", "port": large.port, "sleeping": False, **V}],
            },
            {"gpuIndex": 2, "kind": "training", "training": {"state": "idle", "pids": []}},
        ],
        "ready": True,
    }
    assert SupervisorStatus.model_validate(body).ready
    ready = await client.get("/v1/ready", headers=auth)
    assert await ready.json() == {"ready": True}


async def test_a_model_that_proves_nothing_reports_null_and_not_ready(
    supervisor: Any,
    fleet: tuple[VllmSim, VllmSim, VllmSim],
    fleet_config: dict[str, Any],
    auth: dict[str, str],
) -> None:
    _, b, large = fleet
    await b.set_faults(is_sleeping_garbage=True)
    await large.stop()
    client = await supervisor(fleet_config)
    body = await (await client.get("/v1/status", headers=auth)).json()
    sleeping = {m["name"]: m["sleeping"] for s in body["slots"] for m in s["models"]}
    assert sleeping == {"chat-a": False, "chat-b": None, "chat-large": None}
    assert body["ready"] is False
    assert await (await client.get("/v1/ready", headers=auth)).json() == {"ready": False}


async def test_not_ready_without_any_model(
    supervisor: Any, auth: dict[str, str], tmp_path: Path, sim_trainer: Command
) -> None:
    client = await supervisor({"slots": [_training(0, sim_trainer(), tmp_path)]})
    assert await (await client.get("/v1/ready", headers=auth)).json() == {"ready": False}
    body = await (await client.get("/v1/status", headers=auth)).json()
    assert body["ready"] is False


async def test_status_queries_the_servers_concurrently(
    supervisor: Any, sims: Any, auth: dict[str, str]
) -> None:
    hung = [await sims(f"chat-{i}") for i in range(3)]
    for sim in hung:
        await sim.set_faults(hang=True)
    client = await supervisor(
        {"slots": [_inference(0, *hung)]},
        vllm_timeouts=VllmTimeouts(admin_s=5.0, read_s=0.4),
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    body = await (await client.get("/v1/status", headers=auth)).json()
    # Three 0.4 s timeouts run side by side, not one after the other.
    assert loop.time() - started < 1.1
    assert [m["sleeping"] for m in body["slots"][0]["models"]] == [None, None, None]
    for sim in hung:
        await sim.set_faults(hang=False)


# -- sleep and wake --------------------------------------------------------------------------


async def test_sleep_and_wake_everything(
    supervisor: Any,
    fleet: tuple[VllmSim, VllmSim, VllmSim],
    fleet_config: dict[str, Any],
    auth: dict[str, str],
) -> None:
    client = await supervisor(fleet_config)
    response = await client.post("/v1/vllm/sleep", headers=auth)
    assert response.status == 200
    assert await response.json() == {"status": "ok"}
    assert all(sim.sleeping and sim.sleep_level == 1 for sim in fleet)
    assert await (await client.get("/v1/ready", headers=auth)).json() == {"ready": False}
    response = await client.post("/v1/vllm/wake", data=b"{}", headers=auth)
    assert await response.json() == {"status": "ok"}
    assert not any(sim.sleeping for sim in fleet)
    assert await (await client.get("/v1/ready", headers=auth)).json() == {"ready": True}


async def test_sleep_one_gpu(
    supervisor: Any,
    fleet: tuple[VllmSim, VllmSim, VllmSim],
    fleet_config: dict[str, Any],
    auth: dict[str, str],
) -> None:
    a, b, large = fleet
    client = await supervisor(fleet_config)
    response = await client.post("/v1/vllm/sleep", json={"gpuIndex": 0}, headers=auth)
    assert response.status == 200
    assert a.sleeping
    assert b.sleeping
    assert not large.sleeping
    response = await client.post("/v1/vllm/wake", json={"gpuIndex": 0}, headers=auth)
    assert response.status == 200
    assert not a.sleeping


@pytest.mark.parametrize("path", ["/v1/vllm/sleep", "/v1/vllm/wake"])
@pytest.mark.parametrize("gpu", [7, 2])
async def test_an_unknown_gpu_is_an_invalid_target(
    supervisor: Any,
    fleet: tuple[VllmSim, VllmSim, VllmSim],
    auth: dict[str, str],
    tmp_path: Path,
    sim_trainer: Command,
    path: str,
    gpu: int,
) -> None:
    a, b, large = fleet
    config = {
        "slots": [_inference(0, a, b), _inference(1, large), _training(2, sim_trainer(), tmp_path)]
    }
    client = await supervisor(config)
    response = await client.post(path, json={"gpuIndex": gpu}, headers=auth)
    message = await _error(response, 404, "invalid_target")
    assert f"GPU {gpu}" in message
    assert not any(sim.sleeping for sim in fleet)


@pytest.mark.parametrize(
    ("path", "body", "match"),
    [
        ("/v1/vllm/sleep", b"{", "invalid request body"),
        ("/v1/vllm/sleep", b"[]", "invalid request body"),
        ("/v1/vllm/sleep", b"null", "invalid request body"),
        ("/v1/vllm/sleep", b'{"gpuIndex": 0, "level": 2}', "level"),
        ("/v1/vllm/sleep", b'{"gpu_index": 0, "extra": 1}', "extra"),
        ("/v1/vllm/sleep", b'{"gpuIndex": "0"}', "gpuIndex"),
        ("/v1/vllm/sleep", b'{"gpuIndex": -1}', "gpuIndex"),
        ("/v1/vllm/sleep", b'{"drainTimeoutMs": 0}', "drainTimeoutMs"),
        ("/v1/vllm/sleep", b'{"drainTimeoutMs": 1.5}', "drainTimeoutMs"),
        ("/v1/vllm/wake", b'{"drainTimeoutMs": 100}', "drainTimeoutMs"),
        ("/v1/vllm/wake", b"\xff\xfe", "invalid request body"),
        ("/v1/training/start", b'{"now": true}', "now"),
        ("/v1/training/stop", b'{"graceMs": -5}', "graceMs"),
        ("/v1/training/stop", b'{"grace": 5}', "grace"),
        ("/v1/probe", b'{"maxTokens": 0}', "maxTokens"),
        ("/v1/probe", b'{"prompt": ""}', "prompt"),
        ("/v1/probe", b'{"timeoutMs": "fast"}', "timeoutMs"),
    ],
)
async def test_malformed_bodies_are_invalid_requests(
    supervisor: Any,
    fleet: tuple[VllmSim, VllmSim, VllmSim],
    fleet_config: dict[str, Any],
    auth: dict[str, str],
    path: str,
    body: bytes,
    match: str,
) -> None:
    client = await supervisor(fleet_config)
    response = await client.post(path, data=body, headers=auth)
    message = await _error(response, 400, "invalid_request")
    assert match in message
    assert not any(sim.sleeping for sim in fleet)


async def test_one_model_down_sleeps_the_others_and_names_it(
    supervisor: Any,
    fleet: tuple[VllmSim, VllmSim, VllmSim],
    fleet_config: dict[str, Any],
    auth: dict[str, str],
) -> None:
    a, b, large = fleet
    await large.stop()
    await b.set_faults(sleep_fails=True)
    client = await supervisor(fleet_config)
    response = await client.post("/v1/vllm/sleep", headers=auth)
    message = await _error(response, 502, "upstream_unreachable")
    assert "2 of 3" in message
    assert "chat-b (/sleep: HTTP 500" in message
    assert "chat-large (/sleep: cannot connect" in message
    assert "chat-a" not in message
    assert a.sleeping  # attempted and done despite the others failing


async def test_a_failed_wake_is_named(
    supervisor: Any,
    fleet: tuple[VllmSim, VllmSim, VllmSim],
    fleet_config: dict[str, Any],
    auth: dict[str, str],
) -> None:
    a, b, large = fleet
    client = await supervisor(fleet_config)
    assert (await client.post("/v1/vllm/sleep", headers=auth)).status == 200
    await a.set_faults(wake_fails=True)
    response = await client.post("/v1/vllm/wake", headers=auth)
    message = await _error(response, 502, "upstream_unreachable")
    assert message.startswith("wake failed for 1 of 3 model(s): chat-a (")
    assert not b.sleeping
    assert not large.sleeping
    assert a.sleeping


async def test_drain_before_sleep_lets_the_request_in_flight_finish(
    supervisor: Any, sims: Any, auth: dict[str, str]
) -> None:
    sim = await sims("chat-a", token_latency_ms=30.0)
    client = await supervisor({"slots": [_inference(0, sim)]})
    prompt = " ".join(f"w{i}" for i in range(12))
    async with aiohttp.ClientSession() as session:

        async def chat() -> dict[str, Any]:
            async with session.post(
                sim.url + "/v1/chat/completions",
                json={"model": "chat-a", "messages": [{"role": "user", "content": prompt}]},
            ) as response:
                data: dict[str, Any] = await response.json()
                return data

        request = asyncio.create_task(chat())
        while sim.num_running == 0:
            await asyncio.sleep(0.01)
        response = await client.post(
            "/v1/vllm/sleep", json={"drainTimeoutMs": 10_000}, headers=auth
        )
        assert response.status == 200
        assert request.done()
        completion = await request
    assert completion["choices"][0]["finish_reason"] == "stop"
    assert sim.sleeping


# -- training ----------------------------------------------------------------------------------


async def test_training_start_stop_status(
    supervisor: Any,
    auth: dict[str, str],
    tmp_path: Path,
    sim_trainer: Command,
    wait_for: Any,
    alive: Callable[[int], bool],
) -> None:
    config = {
        "slots": [
            _training(1, sim_trainer(), tmp_path / "one"),
            _training(2, sim_trainer("--ignore-sigterm"), tmp_path / "two"),
        ]
    }
    client = await supervisor(config)
    status = await (await client.get("/v1/training/status", headers=auth)).json()
    assert status == {
        "slots": [
            {"gpuIndex": 1, "state": "idle", "pids": []},
            {"gpuIndex": 2, "state": "idle", "pids": []},
        ]
    }
    response = await client.post("/v1/training/start", headers=auth)
    assert response.status == 200
    assert await response.json() == {"status": "ok"}
    assert (await client.post("/v1/training/start", data=b"{}", headers=auth)).status == 200
    await wait_for(
        lambda: all(read_trainer_checkpoint(tmp_path / d) is not None for d in ("one", "two"))
    )
    status = await (await client.get("/v1/training/status", headers=auth)).json()
    assert [s["state"] for s in status["slots"]] == ["running", "running"]
    pids = [pid for s in status["slots"] for pid in s["pids"]]
    assert len(pids) == 2

    response = await client.post("/v1/training/stop", json={"graceMs": 300}, headers=auth)
    assert response.status == 202
    assert await response.json() == {"status": "ok"}

    async def all_idle() -> bool:
        body = await (await client.get("/v1/training/status", headers=auth)).json()
        return all(s["state"] == "idle" and s["pids"] == [] for s in body["slots"])

    await wait_for(all_idle)
    assert not any(alive(pid) for pid in pids)
    body = await (await client.get("/v1/status", headers=auth)).json()
    trainings = [s["training"] for s in body["slots"]]
    assert [(t["state"], t["pids"]) for t in trainings] == [("idle", [])] * 2
    # How each stop ended: the second trainer ignores SIGTERM, so the grace ran out.
    stops = [t["lastStop"] for t in trainings]
    assert [stop["graceMs"] for stop in stops] == [300, 300]
    assert stops[1]["killed"] is True
    assert stops[1]["stopMs"] >= 300


async def test_training_stop_uses_the_default_grace(
    supervisor: Any, auth: dict[str, str], tmp_path: Path, sim_trainer: Command, wait_for: Any
) -> None:
    client = await supervisor(
        {"slots": [_training(1, sim_trainer("--ignore-sigterm"), tmp_path)]}, stop_grace_s=0.3
    )
    assert (await client.post("/v1/training/start", headers=auth)).status == 200
    await wait_for(lambda: read_trainer_checkpoint(tmp_path) is not None)
    assert (await client.post("/v1/training/stop", headers=auth)).status == 202
    run = client.app[runs_key].runs[0]
    await asyncio.wait_for(run.wait_idle(), 5)


async def test_training_stop_when_idle_is_accepted(
    supervisor: Any, auth: dict[str, str], tmp_path: Path, sim_trainer: Command
) -> None:
    client = await supervisor({"slots": [_training(1, sim_trainer(), tmp_path)]})
    assert (await client.post("/v1/training/stop", headers=auth)).status == 202


async def test_a_spawn_failure_is_reported_and_the_supervisor_keeps_serving(
    supervisor: Any, auth: dict[str, str], tmp_path: Path
) -> None:
    client = await supervisor(
        {"slots": [_training(3, (str(tmp_path / "missing-trainer"),), tmp_path)]}
    )
    response = await client.post("/v1/training/start", headers=auth)
    message = await _error(response, 500, "internal_error")
    assert "GPU 3" in message
    assert "No such file or directory" in message
    status = await (await client.get("/v1/training/status", headers=auth)).json()
    assert status == {"slots": [{"gpuIndex": 3, "state": "idle", "pids": []}]}
    assert (await client.get("/healthz")).status == 200


async def test_training_start_is_refused_once_shutdown_began(
    supervisor: Any, auth: dict[str, str], tmp_path: Path, sim_trainer: Command
) -> None:
    client = await supervisor({"slots": [_training(1, sim_trainer(), tmp_path)]})
    client.app[runs_key].refuse_starts()
    response = await client.post("/v1/training/start", headers=auth)
    await _error(response, 503, "shutting_down")
    status = await (await client.get("/v1/training/status", headers=auth)).json()
    assert status["slots"][0]["state"] == "idle"


async def test_the_trainer_never_sees_the_token(
    supervisor: Any,
    auth: dict[str, str],
    tmp_path: Path,
    fake_trainer: Command,
    wait_for: Any,
    token: str,
) -> None:
    environ = dict(os.environ) | {TOKEN_VAR: token, "COPY_OF_TOKEN": token}
    client = await supervisor({"slots": [_training(4, fake_trainer(), tmp_path)]}, environ=environ)
    assert (await client.post("/v1/training/start", headers=auth)).status == 200
    await wait_for(lambda: (tmp_path / "ready.json").exists())
    env = json.loads((tmp_path / "env.json").read_text())
    assert token not in json.dumps(env)
    assert TOKEN_VAR not in env
    assert env["HARU_GPU_INDEX"] == "4"
    assert env["HARU_CHECKPOINT_DIR"] == str(tmp_path)


async def test_app_cleanup_stops_running_trainers(
    aiohttp_client: Any,
    tmp_path: Path,
    sim_trainer: Command,
    wait_for: Any,
    alive: Callable[[int], bool],
) -> None:
    config = SupervisorConfig.model_validate(
        {"slots": [_training(1, sim_trainer("--ignore-sigterm"), tmp_path)]}
    )
    app = create_app(
        Settings(config=config, shutdown_grace_ms=200),
        nvml_loader=lambda: None,
        training_poll_s=0.02,
    )
    client = await aiohttp_client(app)
    assert (await client.post("/v1/training/start")).status == 200
    await wait_for(lambda: read_trainer_checkpoint(tmp_path) is not None)
    (pid,) = (await app[runs_key].statuses())[0].pids
    await client.close()
    assert not alive(pid)


# -- probe -------------------------------------------------------------------------------------


async def test_probe_every_model(
    supervisor: Any,
    fleet: tuple[VllmSim, VllmSim, VllmSim],
    fleet_config: dict[str, Any],
    auth: dict[str, str],
) -> None:
    client = await supervisor(fleet_config)
    response = await client.post(
        "/v1/probe", json={"prompt": "hello there", "maxTokens": 2}, headers=auth
    )
    assert response.status == 200
    body = await response.json()
    assert body["ok"] is True
    assert [r["model"] for r in body["results"]] == ["chat-a", "chat-b", "chat-large"]
    assert all(r["ok"] and r["latencyMs"] >= 0 and r.get("error") is None for r in body["results"])
    for sim in fleet:
        (recorded,) = sim.recorded_requests
        assert json.loads(recorded.body)["max_tokens"] == 2


async def test_probe_reports_each_failure(
    supervisor: Any,
    fleet: tuple[VllmSim, VllmSim, VllmSim],
    fleet_config: dict[str, Any],
    auth: dict[str, str],
) -> None:
    _, b, large = fleet
    await b.set_faults(error_500=True)
    await large.sleep()  # parked until wake: the probe's bound answers for it
    client = await supervisor(fleet_config)
    response = await client.post("/v1/probe", json={"timeoutMs": 300}, headers=auth)
    body = await response.json()
    assert body["ok"] is False
    results = {r["model"]: r for r in body["results"]}
    assert results["chat-a"]["ok"] is True
    assert results["chat-b"]["ok"] is False
    assert results["chat-b"]["error"].startswith("HTTP 500")
    assert results["chat-large"]["error"] == "no answer within 0.3 s"


async def test_probe_without_models_is_not_ok(
    supervisor: Any, auth: dict[str, str], tmp_path: Path, sim_trainer: Command
) -> None:
    client = await supervisor({"slots": [_training(0, sim_trainer(), tmp_path)]})
    body = await (await client.post("/v1/probe", headers=auth)).json()
    assert body == {"ok": False, "results": []}


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/json", "Origin": "http://evil.example"},
        {"Content-Type": "application/json", "Host": "evil.example:8701"},
    ],
)
async def test_an_open_supervisor_refuses_browser_requests(
    supervisor: Any,
    fleet: tuple[VllmSim, VllmSim, VllmSim],
    fleet_config: dict[str, Any],
    headers: dict[str, str],
) -> None:
    client = await supervisor(fleet_config, token=None)
    response = await client.post("/v1/vllm/sleep", data=b"{}", headers=headers)
    assert response.status in (403, 415)
    body = await response.json()
    assert body["error"]["code"] in ("forbidden", "unsupported_media_type")
    assert not any(sim.sleeping for sim in fleet)
    ok = await client.post(
        "/v1/vllm/sleep", data=b"{}", headers={"Content-Type": "application/json"}
    )
    assert ok.status == 200


# -- admin actions: one at a time per GPU ------------------------------------------------------


async def test_twenty_concurrent_sleep_and_wake_calls_run_one_at_a_time_and_join(
    supervisor: Any, sims: Any, auth: dict[str, str], wait_for: Any
) -> None:
    sim = await sims("m-a")
    client = await supervisor({"slots": [_inference(0, sim)]})
    actions = client.app[actions_key]
    # The first sleep hangs inside vLLM: everything that arrives meanwhile must wait for it.
    await sim.set_faults(hang=True)
    first = asyncio.create_task(client.post("/v1/vllm/sleep", json={}, headers=auth))
    await wait_for(lambda: actions.callers == 1)
    others = [
        asyncio.create_task(
            client.post(f"/v1/vllm/{'wake' if i % 2 else 'sleep'}", json={}, headers=auth)
        )
        for i in range(1, 20)
    ]
    # 9 sleeps joined the running one; the 10 wakes queued behind it as ONE wake.
    await wait_for(lambda: actions.callers == 20)
    assert actions.actions == 2
    await sim.set_faults(hang=False)
    responses = await asyncio.gather(first, *others)
    assert [r.status for r in responses] == [200] * 20
    assert [await r.json() for r in responses] == [{"status": "ok"}] * 20
    # One sleep, then one wake: never interleaved, never repeated.
    assert (sim.sleeps, sim.wakes) == (1, 1)
    assert sim.sleeping is False
    assert (actions.callers, actions.actions) == (0, 0)


async def test_a_training_stop_never_waits_behind_a_hung_sleep_of_its_gpu(
    supervisor: Any,
    sims: Any,
    auth: dict[str, str],
    sim_trainer: Command,
    tmp_path: Path,
    wait_for: Any,
) -> None:
    sim = await sims("m-a")
    client = await supervisor(
        {"slots": [_inference(1, sim), _training(1, sim_trainer(), tmp_path)]},
        vllm_timeouts=VllmTimeouts(admin_s=60.0, read_s=2.0),  # the hang lasts until released
    )
    actions = client.app[actions_key]
    assert (await client.post("/v1/vllm/sleep", json={}, headers=auth)).status == 200
    assert (await client.post("/v1/training/start", json={}, headers=auth)).status == 200
    await wait_for(lambda: read_trainer_checkpoint(tmp_path) is not None)
    # A sleep of GPU 1 hangs inside vLLM (up to the admin bound) ...
    await sim.set_faults(hang=True)
    sleeping = asyncio.create_task(client.post("/v1/vllm/sleep", json={}, headers=auth))
    await wait_for(lambda: actions.callers == 1)
    # ... and the stop of GPU 1's trainer (a promotion's first step) does not queue behind it.
    stop = await asyncio.wait_for(
        client.post("/v1/training/stop", json={"graceMs": 5000}, headers=auth), 10
    )
    assert stop.status == 202
    await asyncio.wait_for(client.app[runs_key].runs[0].wait_idle(), 10)
    assert not sleeping.done()
    await sim.set_faults(hang=False)
    assert (await sleeping).status == 200
    assert (actions.callers, actions.actions) == (0, 0)


async def test_a_wake_is_refused_while_training_holds_the_gpu(
    supervisor: Any,
    sims: Any,
    auth: dict[str, str],
    sim_trainer: Command,
    tmp_path: Path,
    wait_for: Any,
) -> None:
    sim = await sims("m-a")
    other = await sims("m-b")
    client = await supervisor(
        {
            "slots": [
                _inference(0, other),
                _inference(1, sim),
                _training(1, sim_trainer(), tmp_path),
            ]
        }
    )
    assert (await client.post("/v1/vllm/sleep", json={}, headers=auth)).status == 200
    assert (await client.post("/v1/training/start", json={}, headers=auth)).status == 200
    response = await client.post("/v1/vllm/wake", json={"gpuIndex": 1}, headers=auth)
    assert response.status == 409
    error = (await response.json())["error"]
    assert error["code"] == "operation_conflict"
    assert "GPU 1 (running)" in error["message"]
    # A wake of every slot touches GPU 1 too: refused as a whole, nothing woken.
    assert (await client.post("/v1/vllm/wake", json={}, headers=auth)).status == 409
    assert (sim.sleeping, other.sleeping) == (True, True)
    # GPU 0 holds no training slot: its wake goes through.
    assert (await client.post("/v1/vllm/wake", json={"gpuIndex": 0}, headers=auth)).status == 200
    assert other.sleeping is False
    stop = await client.post("/v1/training/stop", json={"graceMs": 5000}, headers=auth)
    assert stop.status == 202

    async def idle() -> bool:
        body = await (await client.get("/v1/training/status", headers=auth)).json()
        return bool(body["slots"][0]["state"] == "idle")

    await wait_for(idle)
    assert (await client.post("/v1/vllm/wake", json={"gpuIndex": 1}, headers=auth)).status == 200
    assert sim.sleeping is False


async def test_stop_leaves_no_process_of_a_trainer_whose_grandchild_escaped(
    supervisor: Any,
    auth: dict[str, str],
    fake_trainer: Command,
    tmp_path: Path,
    wait_for: Any,
    alive: Callable[[int], bool],
) -> None:
    client = await supervisor(
        {"slots": [_training(0, fake_trainer("--escaped-grandchild"), tmp_path)]}
    )
    assert (await client.post("/v1/training/start", json={}, headers=auth)).status == 200
    await wait_for(lambda: (tmp_path / "ready.json").exists())
    pids = json.loads((tmp_path / "ready.json").read_text())

    async def reported() -> bool:
        body = await (await client.get("/v1/training/status", headers=auth)).json()
        return set(body["slots"][0]["pids"]) == set(pids)

    await wait_for(reported)
    stop = await client.post("/v1/training/stop", json={"graceMs": 300}, headers=auth)
    assert stop.status == 202

    async def idle() -> bool:
        body = await (await client.get("/v1/training/status", headers=auth)).json()
        slot = body["slots"][0]
        return bool((slot["gpuIndex"], slot["state"], slot["pids"]) == (0, "idle", []))

    await wait_for(idle)
    assert not any(alive(pid) for pid in pids)
