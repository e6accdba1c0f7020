"""Shared fixtures: emulated servers on real ephemeral ports and a real HTTP client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from haru_sim import VllmSim, VllmSimConfig

StartSim = Callable[..., Awaitable[VllmSim]]
Eventually = Callable[..., Awaitable[None]]
ReadSse = Callable[[aiohttp.ClientResponse], AsyncIterator[Any]]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        yield session


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    """Start a VllmSim on 127.0.0.1:<ephemeral> with config overrides; stopped afterwards."""
    sims: list[VllmSim] = []

    async def start(**overrides: Any) -> VllmSim:
        sim = VllmSim(VllmSimConfig(**overrides))
        sims.append(sim)
        await sim.start()
        return sim

    yield start
    for sim in sims:
        await sim.stop()


@pytest.fixture
def eventually() -> Eventually:
    """Poll a condition (sync or async) every 5 ms until it holds; fail after ``timeout`` s."""

    async def wait(condition: Callable[[], object], timeout: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            result = condition()
            if asyncio.iscoroutine(result):
                result = await result
            if result:
                return
            if loop.time() > deadline:
                raise AssertionError(f"condition never held within {timeout}s")
            await asyncio.sleep(0.005)

    return wait


@pytest.fixture
def read_sse() -> ReadSse:
    """Yield each SSE ``data:`` payload (parsed JSON, or the string ``[DONE]``) as it arrives."""

    async def read(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
        async for raw in response.content:
            line = raw.decode().rstrip("\n")
            if not line.startswith("data: "):
                assert line == "", f"unexpected SSE line {line!r}"
                continue
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)

    return read
