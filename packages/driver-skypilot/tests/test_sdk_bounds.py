"""The SDK facade against a fake ``sky`` module whose API server can hang.

SkyPilot 0.14.1's ``sky.status`` defaults to ``all_users=False`` (``sky/client/sdk.py``),
which hides another identity's cluster; ``sky.get`` waits with no read timeout
(``timeout=(connect, None)``) and only a cancelled request (``sky.api_cancel``) ends it.
The fake copies both: ``get`` blocks until its request is cancelled (or, for a dead server,
not even then).
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import sys
import threading
import types
from collections.abc import Iterator

import pytest
from haru_driver_skypilot import SkyPilotSdk, SkySdkError


class HangingServer:
    def __init__(self, *, cancel_works: bool = True) -> None:
        self.cancel_works = cancel_works
        self.submitted: list[dict[str, object]] = []
        self.cancelled: list[object] = []
        self.released = threading.Event()
        self._done: dict[object, threading.Event] = {}

    def status(self, **kwargs: object) -> str:
        self.submitted.append(kwargs)
        request_id = f"req-{len(self.submitted)}"
        self._done[request_id] = threading.Event()
        return request_id

    def get(self, request_id: object) -> list[object]:
        done = self._done[request_id]
        while not done.wait(0.05):
            if self.released.is_set():
                break
        raise RuntimeError(f"request {request_id} cancelled")

    def api_cancel(self, request_id: object, silent: bool = False) -> str:
        self.cancelled.append(request_id)
        if self.cancel_works:
            self._done[request_id].set()
        return "req-cancel"


def fake_module(server: HangingServer) -> types.ModuleType:
    module = types.ModuleType("sky")
    module.__spec__ = importlib.machinery.ModuleSpec("sky", None)
    module.status = server.status  # type: ignore[attr-defined]
    module.get = server.get  # type: ignore[attr-defined]
    module.api_cancel = server.api_cancel  # type: ignore[attr-defined]
    return module


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[HangingServer]:
    hanging = HangingServer()
    monkeypatch.setitem(sys.modules, "sky", fake_module(hanging))
    yield hanging
    hanging.released.set()


async def idle(sdk: SkyPilotSdk) -> None:
    async with asyncio.timeout(10):
        while sdk.busy:
            await asyncio.sleep(0.02)


async def test_a_status_read_that_overruns_is_cancelled_and_frees_its_thread(
    server: HangingServer,
) -> None:
    sdk = SkyPilotSdk()
    with pytest.raises(SkySdkError, match="did not answer within"):
        await sdk.cluster_records(["haru-demo--alpha"], timeout=0.2)
    assert server.submitted == [{"cluster_names": ["haru-demo--alpha"], "all_users": True}]
    await idle(sdk)  # the cancel ended the worker's `sky.get`
    assert server.cancelled == ["req-1"]


async def test_calls_never_pile_up_behind_a_dead_server(server: HangingServer) -> None:
    server.cancel_works = False
    sdk = SkyPilotSdk(threads=2)
    for _ in range(2):
        with pytest.raises(SkySdkError, match="did not answer within"):
            await sdk.cluster_records(["haru-demo--alpha"], timeout=0.1)
    with pytest.raises(SkySdkError, match="2 earlier SDK calls still wait"):
        await sdk.cluster_records(["haru-demo--alpha"], timeout=0.1)
    assert len(server.submitted) == 2  # the third never reached the server
    server.released.set()
    await idle(sdk)
