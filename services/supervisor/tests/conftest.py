"""Fixtures: emulated vLLM servers on real sockets, the supervisor app, process helpers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from haru_protocol import SupervisorConfig
from haru_sim import VllmSim, VllmSimConfig
from haru_supervisor.api import Settings, VllmTimeouts, create_app
from pydantic import SecretStr

TOKEN = "sup-test-token-7f3a9c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

FAST_TIMEOUTS = VllmTimeouts(admin_s=5.0, read_s=2.0, drain_poll_s=0.02, drain_quiet_s=0.05)


@pytest.fixture
def data_dir() -> Path:
    return Path(__file__).parent / "data"


@pytest.fixture
def auth() -> dict[str, str]:
    # Control bodies must be declared JSON (haru-web); every test body here is.
    return {**AUTH, "Content-Type": "application/json"}


@pytest.fixture
def token() -> str:
    """The bearer token the ``supervisor`` fixture configures by default."""
    return TOKEN


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not: it holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rpartition(b")")[2].split()[0] not in (b"Z", b"X")


@pytest.fixture
def alive() -> Callable[[int], bool]:
    return _alive


class WaitFor(Protocol):
    async def __call__(
        self, predicate: Callable[[], Awaitable[bool] | bool], *, timeout: float = ...
    ) -> None: ...


async def _wait_for(
    predicate: Callable[[], Awaitable[bool] | bool], *, timeout: float = 5.0
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.02)


@pytest.fixture
def wait_for() -> WaitFor:
    return _wait_for


@pytest.fixture
def sim_trainer() -> Callable[..., tuple[str, ...]]:
    """argv of the emulated trainer (haru-sim) with extra flags; one step is 10 ms."""

    def command(*flags: str) -> tuple[str, ...]:
        return (
            sys.executable,
            "-m",
            "haru_sim.trainer",
            "--step-ms",
            "10",
            "--checkpoint-every",
            "1",
            *flags,
        )

    return command


@pytest.fixture
def fake_trainer(data_dir: Path) -> Callable[..., tuple[str, ...]]:
    """argv of tests/data/fake_trainer.py with extra flags."""

    def command(*flags: str) -> tuple[str, ...]:
        return (sys.executable, str(data_dir / "fake_trainer.py"), *flags)

    return command


SimFactory = Callable[..., Awaitable[VllmSim]]


@pytest.fixture
async def sims() -> AsyncIterator[SimFactory]:
    """Start emulated vLLM servers on 127.0.0.1 (ephemeral ports); all stopped afterwards."""
    started: list[VllmSim] = []

    async def start(name: str, **config: Any) -> VllmSim:
        config.setdefault("sleep_latency_ms", 5.0)
        config.setdefault("wake_latency_ms", 5.0)
        sim = VllmSim(VllmSimConfig(served_model_names=(name,), **config))
        await sim.start()
        started.append(sim)
        return sim

    yield start
    for sim in started:
        await sim.stop()


@pytest.fixture
def unused_port() -> Callable[[], int]:
    """A port nothing listens on (bound then released)."""
    import socket

    def pick() -> int:
        with contextlib.closing(socket.socket()) as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
            return port

    return pick


SupervisorFactory = Callable[..., Awaitable[TestClient[web.Request, web.Application]]]


@pytest.fixture
def supervisor(aiohttp_client: Any) -> SupervisorFactory:
    """Build the supervisor app for a config document and serve it on a real socket."""

    async def make(
        config: dict[str, Any] | SupervisorConfig,
        *,
        token: str | None = TOKEN,
        environ: dict[str, str] | None = None,
        shutdown_grace_s: float = 2.0,
        stop_grace_s: float = 30.0,
        search_path: str | None = "",
        **deps: Any,
    ) -> TestClient[web.Request, web.Application]:
        parsed = (
            config
            if isinstance(config, SupervisorConfig)
            else SupervisorConfig.model_validate(config)
        )
        settings = Settings(
            config=parsed,
            token=None if token is None else SecretStr(token),
            shutdown_grace_ms=round(shutdown_grace_s * 1000),
            stop_grace_s=stop_grace_s,
            trainer_env=dict(os.environ) if environ is None else environ,
            search_path=search_path,
            gpu_source=deps.pop("gpu_source", "auto"),
            vllm_api_keys=deps.pop("vllm_api_keys", {}),
        )
        deps.setdefault("vllm_timeouts", FAST_TIMEOUTS)
        deps.setdefault("training_poll_s", 0.02)
        deps.setdefault("nvml_loader", lambda: None)
        client: TestClient[web.Request, web.Application] = await aiohttp_client(
            create_app(settings, **deps)
        )
        return client

    return make
