"""Fixtures: an injectable clock, a local fleet (emulated vLLM + real supervisors), reconcilers,
and the ``haru`` command line against a real ``haru serve``.

The ``store`` / ``sqlite_store`` / ``postgres_store`` / ``database_url_factory`` fixtures come
from the haru_db pytest plugin (a freshly migrated database per test, on both engines).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from haru_db import StateStore
from haru_demo.localfleet import LocalFleet, LocalFleetOptions
from haru_protocol import (
    FleetSnapshot,
    Operation,
    OperationState,
    PolicyPatch,
    TrainingRunState,
)
from haru_server._metrics import ServerMetrics
from haru_server._reconciler import Reconciler, ReconcilerOptions
from haru_server._steps import StepTuning
from haru_server.testing import ManualClock, seed_layout, tick_until_settled, wait_training
from haru_sim import read_trainer_checkpoint
from haru_supervisor_client import SupervisorClient

START = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START)


@pytest.fixture
async def make_fleet(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[LocalFleet]]]:
    """``fleet = await make_fleet(**LocalFleetOptions fields)``: started, closed after the test."""
    started: list[LocalFleet] = []

    async def make(**options: Any) -> LocalFleet:
        fleet = LocalFleet(tmp_path / f"fleet-{len(started)}", LocalFleetOptions(**options))
        started.append(fleet)
        await fleet.start()
        return fleet

    yield make
    for fleet in reversed(started):
        await fleet.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


FAST_TUNING = StepTuning(settle_s=0.5, first_poll_s=0.01, max_poll_s=0.05)


@pytest.fixture
def make_reconciler(clock: ManualClock, http: aiohttp.ClientSession) -> Callable[..., Reconciler]:
    def make(
        store: StateStore,
        *,
        token: str | Callable[[], str | None] | None = None,
        chaining: bool = True,
        tuning: StepTuning = FAST_TUNING,
        heartbeat_timeout_s: float = 2.0,
        metrics: ServerMetrics | None = None,
    ) -> Reconciler:
        return Reconciler(
            store,
            SupervisorClient(http, token=token),
            clock=clock,
            options=ReconcilerOptions(
                chaining=chaining, tuning=tuning, heartbeat_timeout_s=heartbeat_timeout_s
            ),
            metrics=metrics,
        )

    return make


async def seed(
    store: StateStore,
    fleet: LocalFleet,
    clock: ManualClock,
    *,
    policy: PolicyPatch | None = None,
) -> FleetSnapshot:
    """Apply the local fleet's layout and return the stored snapshot."""
    return await seed_layout(store, fleet.layout(policy=policy), clock)


async def start_standby_training(
    fleet: LocalFleet, http: aiohttp.ClientSession, reconciler: Reconciler, slug: str = "beta"
) -> None:
    """Bring the standby to its steady posture: asleep, trainers running (proven), and ticked."""
    client = SupervisorClient(http, token=fleet.options.supervisor_token)
    url = fleet.domain(slug).supervisor_url
    await client.start_training(url, timeout_s=5)
    await wait_training(client, url, TrainingRunState.RUNNING)
    # Wait until every trainer really trains (its first checkpoint), so a SIGTERM later
    # reaches its handler rather than a half-started interpreter.
    async with asyncio.timeout(30):
        for directory in fleet.domain(slug).checkpoint_dirs.values():
            while read_trainer_checkpoint(directory) is None:
                await asyncio.sleep(0.02)
    await reconciler.tick(fleet.options.slug)


_RECONCILER_OPTIONS = ("token", "chaining", "tuning", "heartbeat_timeout_s", "metrics")


@pytest.fixture
def seeded_fleet(
    make_fleet: Callable[..., Awaitable[LocalFleet]],
    make_reconciler: Callable[..., Reconciler],
    clock: ManualClock,
    http: aiohttp.ClientSession,
) -> Callable[..., Awaitable[tuple[LocalFleet, FleetSnapshot, Reconciler]]]:
    """``fleet, seeded, reconciler = await seeded_fleet(store, **options)``: the reconcile set-up.

    A local fleet started (``LocalFleetOptions`` fields among ``options``), its layout applied
    to ``store`` (``policy=``), and a reconciler on it (``make_reconciler``'s keywords among
    ``options``). ``standby_training=True`` also brings the standby ``beta`` to its steady
    posture (asleep, trainers proven running, one tick recorded it).
    """

    async def make(
        store: StateStore,
        *,
        policy: PolicyPatch | None = None,
        standby_training: bool = False,
        **options: Any,
    ) -> tuple[LocalFleet, FleetSnapshot, Reconciler]:
        reconciler_options = {k: options.pop(k) for k in _RECONCILER_OPTIONS if k in options}
        fleet = await make_fleet(**options)
        seeded = await seed(store, fleet, clock, policy=policy)
        reconciler = make_reconciler(store, **reconciler_options)
        if standby_training:
            await start_standby_training(fleet, http, reconciler)
        return fleet, seeded, reconciler

    return make


def finished(operation: Operation | None) -> bool:
    return operation is not None and operation.state not in (
        OperationState.PENDING,
        OperationState.RUNNING,
    )


@pytest.fixture
def helpers() -> Any:
    """The module-level helpers above, for tests (importlib mode forbids importing conftest)."""

    class Helpers:
        seed = staticmethod(seed)
        tick_until_settled = staticmethod(tick_until_settled)
        finished = staticmethod(finished)
        wait_training = staticmethod(wait_training)

    return Helpers


# -- the haru command line ----------------------------------------------------------------------

CLI_TOKEN = "cli-token-0123456789abcdef"
_LISTENING = re.compile(r"listening on \S+ \((http://\S+)\)")


def _cli_env(**extra: str) -> dict[str, str]:
    """This process's environment without Haru's settings, wide enough for unwrapped tables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HARU_") and k not in ("DATABASE_URL", "PORT")
    }
    env.update(COLUMNS="200", **extra)
    return env


def _run_haru(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "haru_server", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def haru() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``haru(*args, env=...)``: the ``haru`` command line (``python -m haru_server``), run."""
    return _run_haru


@pytest.fixture
def serve_example(tmp_path: Path) -> Iterator[Callable[..., dict[str, str]]]:
    """``env = serve_example(**server_env)``: the example fleet seeded and served; the CLI's env.

    ``haru seed`` seeds the bundled example fleet into a fresh SQLite database, then ``haru
    serve`` runs on it as a process: API token :data:`CLI_TOKEN`, no reconcile loop (the
    example's supervisors do not exist, and no CLI test needs a tick), ``server_env`` on top.
    The returned environment points the CLI at it (``HARU_URL``, ``HARU_API_TOKEN``,
    ``DATABASE_URL``). The server is stopped with SIGTERM after the test.
    """
    processes: list[subprocess.Popen[str]] = []

    def serve(**server_env: str) -> dict[str, str]:
        url = f"sqlite:///{tmp_path / f'cli-{len(processes)}.db'}"
        seeded = _run_haru("seed", env=_cli_env(DATABASE_URL=url))
        assert seeded.returncode == 0, seeded.stderr
        process = subprocess.Popen(
            [sys.executable, "-m", "haru_server", "serve"],
            env=_cli_env(
                DATABASE_URL=url,
                PORT="0",
                HARU_API_TOKEN=CLI_TOKEN,
                HARU_RECONCILE_INTERVAL_MS="off",
                **server_env,
            ),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        processes.append(process)
        assert process.stderr is not None
        base = ""
        lines: list[str] = []
        for line in process.stderr:  # the server logs its bound URL once it listens
            lines.append(line)
            match = _LISTENING.search(line)
            if match:
                base = match.group(1)
                break
        assert base, "".join(lines)
        return _cli_env(HARU_URL=base, HARU_API_TOKEN=CLI_TOKEN, DATABASE_URL=url)

    yield serve
    for process in reversed(processes):
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=20)
