"""Fencing: the supervisor refuses state-changing calls carrying an older token (real sockets)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import aiohttp
import pytest
from haru_protocol import FENCE_HEADER, FenceParseError, SupervisorFence, TrainingRunState
from haru_sim import VllmSim, read_trainer_checkpoint
from haru_supervisor._fence import FenceBook
from haru_supervisor._keys import actions_key, fences_key, runs_key
from haru_supervisor.api import VllmTimeouts
from haru_supervisor_client import (
    SupervisorClient,
    SupervisorRejectedError,
    SupervisorStaleFenceError,
)

FLEET = UUID("0b6c2a4e-5d1f-4c3a-9e8b-7a6f5d4c3b2a")


def _fenced(auth: dict[str, str], token: int, fleet: UUID = FLEET) -> dict[str, str]:
    return {**auth, FENCE_HEADER: f"{fleet}:{token}"}


async def _refused(response: aiohttp.ClientResponse) -> str:
    assert response.status == 409, await response.text()
    body = await response.json()
    assert body["error"]["code"] == "stale_fence"
    message: str = body["error"]["message"]
    return message


@pytest.fixture
async def model(sims: Any) -> VllmSim:
    sim: VllmSim = await sims("chat-fence")
    return sim


@pytest.fixture
def config(model: VllmSim) -> dict[str, Any]:
    models = [{"name": model.config.primary_model_name, "port": model.port}]
    return {"slots": [{"kind": "inference", "gpuIndex": 0, "models": models}]}


async def test_a_stale_wake_after_a_newer_sleep_is_refused(
    supervisor: Any, config: dict[str, Any], model: VllmSim, auth: dict[str, str]
) -> None:
    client = await supervisor(config)
    assert (await client.post("/v1/vllm/wake", headers=_fenced(auth, 7))).status == 200
    assert (await client.post("/v1/vllm/sleep", headers=_fenced(auth, 8))).status == 200
    assert model.sleeping
    message = await _refused(await client.post("/v1/vllm/wake", headers=_fenced(auth, 7)))
    assert "fence 7" in message
    assert "older than 8" in message
    # Refused before acting: the model stays asleep.
    assert model.sleeping
    # The same token is another process acting for the same step: admitted.
    assert (await client.post("/v1/vllm/sleep", headers=_fenced(auth, 8))).status == 200
    assert client.app[fences_key].highest(FLEET) == 8
    # Fleets are fenced separately.
    other = uuid4()
    assert (await client.post("/v1/vllm/wake", headers=_fenced(auth, 1, other))).status == 200
    assert not model.sleeping


async def test_training_start_and_stop_are_fenced(
    supervisor: Any, auth: dict[str, str], tmp_path: Path, sim_trainer: Any
) -> None:
    slot = {
        "kind": "training",
        "gpuIndex": 1,
        "command": list(sim_trainer()),
        "checkpointDir": str(tmp_path),
    }
    client = await supervisor({"slots": [slot]})
    stop = await client.post("/v1/training/stop", json={"graceMs": 200}, headers=_fenced(auth, 5))
    assert stop.status == 202
    await _refused(await client.post("/v1/training/start", headers=_fenced(auth, 4)))
    assert client.app[runs_key].runs[0].state is TrainingRunState.IDLE
    await _refused(await client.post("/v1/training/stop", headers=_fenced(auth, 3)))


async def test_a_call_without_a_fence_is_accepted_and_logged(
    supervisor: Any,
    config: dict[str, Any],
    model: VllmSim,
    auth: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = await supervisor(config)
    assert (await client.post("/v1/vllm/sleep", headers=_fenced(auth, 9))).status == 200
    with caplog.at_level(logging.INFO, logger="haru_supervisor._routes"):
        assert (await client.post("/v1/vllm/wake", headers=auth)).status == 200
    assert not model.sleeping
    assert any("not fenced" in r.getMessage() for r in caplog.records)
    # Reads never look at the header.
    assert (await client.get("/v1/status", headers=_fenced(auth, 1))).status == 200


@pytest.mark.parametrize(
    "value",
    [
        "12",
        f"{FLEET}",
        f"{FLEET}:",
        f"{FLEET}:-1",
        f"{FLEET}:1.5",
        f"{FLEET}:99999999999999999999",
        f"{FLEET}:{2**63}",
        "not-a-uuid-not-a-uuid-not-a-uuid-x:1",
        f"{FLEET}:1\u00e9",
    ],
)
async def test_a_malformed_fence_is_an_invalid_request(
    supervisor: Any, config: dict[str, Any], model: VllmSim, auth: dict[str, str], value: str
) -> None:
    client = await supervisor(config)
    headers = {**auth, FENCE_HEADER: value.encode("utf-8").decode("latin-1")}
    response = await client.post("/v1/vllm/sleep", headers=headers)
    assert response.status == 400, await response.text()
    body = await response.json()
    assert body["error"]["code"] == "invalid_request"
    assert FENCE_HEADER in body["error"]["message"]
    assert not model.sleeping


async def test_a_repeated_fence_header_is_an_invalid_request(
    supervisor: Any, config: dict[str, Any], auth: dict[str, str]
) -> None:
    client = await supervisor(config)
    headers = [*auth.items(), (FENCE_HEADER, f"{FLEET}:2"), (FENCE_HEADER, f"{FLEET}:1")]
    response = await client.post("/v1/vllm/sleep", headers=headers)
    assert response.status == 400


async def test_the_fence_is_checked_after_the_token(
    supervisor: Any, config: dict[str, Any]
) -> None:
    client = await supervisor(config)
    response = await client.post("/v1/vllm/sleep", headers={FENCE_HEADER: f"{FLEET}:50"})
    assert response.status == 401
    assert client.app[fences_key].highest(FLEET) is None


async def test_the_client_sends_the_fence_and_types_a_refusal(
    supervisor: Any, config: dict[str, Any], model: VllmSim, token: str
) -> None:
    client = await supervisor(config)
    url = str(client.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:
        sup = SupervisorClient(session, token=token)
        await sup.sleep(url, timeout_s=5, fence=SupervisorFence(FLEET, 11))
        assert client.app[fences_key].highest(FLEET) == 11
        with pytest.raises(SupervisorStaleFenceError) as caught:
            await sup.wake(url, timeout_s=5, fence=SupervisorFence(FLEET, 10))
        assert isinstance(caught.value, SupervisorRejectedError)
        assert (caught.value.status, caught.value.code) == (409, "stale_fence")
        assert model.sleeping
        with pytest.raises(SupervisorStaleFenceError):
            await sup.start_training(url, timeout_s=5, fence=SupervisorFence(FLEET, 3))
        with pytest.raises(SupervisorStaleFenceError):
            await sup.stop_training(url, timeout_s=5, grace_ms=10, fence=SupervisorFence(FLEET, 3))
        await sup.wake(url, timeout_s=5, fence=SupervisorFence(FLEET, 12))
        assert not model.sleeping


def test_the_book_forgets_the_least_recently_fenced_fleet() -> None:
    book = FenceBook(capacity=2)
    first, second, third = uuid4(), uuid4(), uuid4()
    assert book.admit(SupervisorFence(first, 5)) is None
    assert book.admit(SupervisorFence(second, 5)) is None
    assert book.admit(SupervisorFence(first, 6)) is None
    assert book.admit(SupervisorFence(third, 1)) is None
    assert book.highest(second) is None
    assert book.highest(first) == 6
    assert book.admit(SupervisorFence(first, 2)) == 6


def test_fence_values_round_trip() -> None:
    fence = SupervisorFence(FLEET, 2**63 - 1)
    assert SupervisorFence.parse(fence.header_value()) == fence
    assert SupervisorFence.parse(f" {FLEET.hex}:0 ") == SupervisorFence(FLEET, 0)
    with pytest.raises(FenceParseError):
        SupervisorFence(FLEET, -1)


async def test_a_start_that_waited_behind_a_sleep_is_refused_after_a_newer_stop(
    supervisor: Any,
    model: VllmSim,
    auth: dict[str, str],
    sim_trainer: Any,
    tmp_path: Path,
    wait_for: Any,
) -> None:
    # GPU 0 holds the model and a trainer. An old step's start waits behind a hung sleep; a
    # newer step's stop (its own lane) runs at once. The start, once it gets its turn, must
    # not start what the newer step stopped.
    models = [{"name": model.config.primary_model_name, "port": model.port}]
    client = await supervisor(
        {
            "slots": [
                {"kind": "inference", "gpuIndex": 0, "models": models},
                {
                    "kind": "training",
                    "gpuIndex": 0,
                    "command": list(sim_trainer()),
                    "checkpointDir": str(tmp_path),
                },
            ]
        },
        vllm_timeouts=VllmTimeouts(admin_s=60.0, read_s=2.0),  # the hang lasts until released
    )
    actions = client.app[actions_key]
    await model.set_faults(hang=True)
    sleeping = asyncio.create_task(client.post("/v1/vllm/sleep", headers=_fenced(auth, 4)))
    await wait_for(lambda: actions.callers == 1)
    start = asyncio.create_task(client.post("/v1/training/start", headers=_fenced(auth, 4)))
    await wait_for(lambda: actions.callers == 2)
    stop = await asyncio.wait_for(client.post("/v1/training/stop", headers=_fenced(auth, 5)), 10)
    assert stop.status == 202
    assert not start.done()
    await model.set_faults(hang=False)
    assert (await sleeping).status == 200
    message = await _refused(await start)
    assert "training start refused: fence 4" in message
    assert "older than 5" in message
    [run] = client.app[runs_key].runs
    assert run.state is TrainingRunState.IDLE
    assert read_trainer_checkpoint(tmp_path) is None  # never spawned
    # A start of the newer step runs.
    assert (await client.post("/v1/training/start", headers=_fenced(auth, 5))).status == 200
    await wait_for(lambda: read_trainer_checkpoint(tmp_path) is not None)
