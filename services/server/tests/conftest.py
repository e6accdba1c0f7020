"""Fixtures: an injectable clock, a local fleet (emulated vLLM + real supervisors), reconcilers,
``haru serve`` processes and the ``haru`` command line against them, the server and the proxy
run in this process.

The ``store`` / ``sqlite_store`` / ``postgres_store`` / ``database_url_factory`` fixtures come
from the haru_db pytest plugin (a freshly migrated database per test, on both engines).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler
from haru_db import StateStore
from haru_demo.localfleet import LocalFleet, LocalFleetOptions
from haru_protocol import (
    FleetSnapshot,
    Operation,
    OperationState,
    PolicyPatch,
    TrainingRunState,
)
from haru_server._keys import clock_key, settings_key, store_key
from haru_server._metrics import ServerMetrics, metrics_key
from haru_server._proxy import ProxyTuning, install_proxy
from haru_server._reconciler import Reconciler, ReconcilerOptions
from haru_server._serve import run_server
from haru_server._settings import Settings
from haru_server._steps import StepTuning
from haru_server.testing import ManualClock, seed_layout, tick_until_settled, wait_training
from haru_sim import read_trainer_checkpoint
from haru_supervisor_client import SupervisorClient
from haru_web import ApiError, add_metrics_route, render_api_error

T = TypeVar("T")
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


# -- `haru serve` as a process, and the haru command line ------------------------------------

CLI_TOKEN = "cli-token-0123456789abcdef"
_LISTENING = re.compile(r"haru-server listening on \S+ \((https?://\S+)\)")


def _haru_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without Haru's settings, wide enough for unwrapped tables,
    then ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HARU_") and k not in ("DATABASE_URL", "PORT")
    }
    env.update({"COLUMNS": "200", **extra})
    return env


class ServerProcess:
    """One ``haru serve`` process, its stderr read into :attr:`lines` as it writes them.

    A thread reads the log, so it is never left unread (a full pipe would stall the server),
    whether or not an event loop runs; :attr:`url` is set once it listens.
    """

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        cwd: Path | None = None,
        args: Sequence[str] = (),
        wrapper: Sequence[str] = (),
    ) -> None:
        self.process = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "haru_server", "serve", *args],
            env=_haru_env(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        self.lines: list[str] = []
        self.url = ""
        self._ended = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stderr = self.process.stderr
        assert stderr is not None
        with stderr:
            for line in stderr:
                with self._changed:
                    self.lines.append(line.rstrip("\n"))
                    self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, found: Callable[[list[str]], T | None], *, what: str, timeout_s: float) -> T:
        """``found(lines)`` once it is not None; fails (with the log) at the log's end."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while (result := found(self.lines)) is None:
                if self._ended:
                    raise AssertionError(f"haru serve ended before {what}:\n{self.log}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {what} within {timeout_s} s:\n{self.log}")
                self._changed.wait(left)
            return result

    async def until(
        self, found: Callable[[list[str]], T | None], *, what: str, timeout_s: float = 30
    ) -> T:
        """:meth:`wait_for` from a coroutine."""
        return await asyncio.to_thread(self.wait_for, found, what=what, timeout_s=timeout_s)

    async def line(self, pattern: str | re.Pattern[str], *, timeout_s: float = 10) -> re.Match[str]:
        """The first log line holding ``pattern`` (a string: literally), once it is written."""
        searched = re.compile(re.escape(pattern)) if isinstance(pattern, str) else pattern

        def first(lines: list[str]) -> re.Match[str] | None:
            return next(filter(None, map(searched.search, lines)), None)

        return await self.until(first, what=f"line {searched.pattern!r}", timeout_s=timeout_s)

    def listen(self, *, timeout_s: float = 90) -> str:
        """Its base URL, once it logged it (generous: loaded machines import slowly)."""

        def bound(lines: list[str]) -> str | None:
            match = next(filter(None, map(_LISTENING.search, lines)), None)
            return None if match is None else match.group(1)

        self.url = self.wait_for(bound, what="its listening line", timeout_s=timeout_s)
        return self.url

    async def exited(self, *, timeout_s: float = 60) -> int:
        """Its exit code, once it ended and its log was read to the end."""

        def wait() -> int:
            try:
                code = self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"haru serve still runs after {timeout_s} s:\n{self.log}"
                ) from None
            self._reader.join()
            return code

        return await asyncio.to_thread(wait)

    def stop(self) -> None:
        """SIGTERM (after SIGCONT: it may have been stopped), SIGKILL if it outlasts the drain."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join()


@asynccontextmanager
async def _haru_serve(
    env: Mapping[str, str], *, listening: bool = True, **options: Any
) -> AsyncIterator[ServerProcess]:
    server = ServerProcess(env, **options)
    try:
        if listening:
            await asyncio.to_thread(server.listen)
        yield server
    finally:
        await asyncio.to_thread(server.stop)


@pytest.fixture
def haru_serve() -> Callable[..., AbstractAsyncContextManager[ServerProcess]]:
    """``async with haru_serve(env, ...) as server``: a ``haru serve`` process (a ServerProcess).

    ``env`` goes on top of this process's environment less ``HARU_*``, ``DATABASE_URL`` and
    ``PORT``. It listens on entry (``listening=False``: not waited for, as by a boot that must
    fail); SIGTERM stops it on exit, its log complete after the block. ``cwd``, ``args`` (after
    ``serve``) and ``wrapper`` (a command that runs it) are passed on.
    """
    return _haru_serve


def _run_haru(
    *args: str, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "haru_server", *args],
        env=_haru_env(env or {}),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def haru() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``haru(*args, env=..., cwd=...)``: the ``haru`` command line (``python -m haru_server``).

    ``env`` goes on top of this process's environment less Haru's settings.
    """
    return _run_haru


@pytest.fixture
def serve_example(tmp_path: Path) -> Iterator[Callable[..., dict[str, str]]]:
    """``env = serve_example(**server_env)``: the example fleet seeded and served; the CLI's env.

    ``haru seed`` seeds it into a fresh SQLite database, and ``haru serve`` runs on it: API
    token :data:`CLI_TOKEN`, no reconcile loop (the example's supervisors do not exist, and no
    CLI test needs a tick), ``server_env`` on top; stopped after the test. The environment
    returned points the CLI at it (``HARU_URL``, ``HARU_API_TOKEN``, ``DATABASE_URL``).
    """
    servers: list[ServerProcess] = []

    def serve(**server_env: str) -> dict[str, str]:
        url = f"sqlite:///{tmp_path / f'cli-{len(servers)}.db'}"
        seeded = _run_haru("seed", env={"DATABASE_URL": url})
        assert seeded.returncode == 0, seeded.stderr
        env = {"DATABASE_URL": url, "PORT": "0", "HARU_API_TOKEN": CLI_TOKEN}
        server = ServerProcess({**env, "HARU_RECONCILE_INTERVAL_MS": "off", **server_env})
        servers.append(server)
        return _haru_env(
            {"HARU_URL": server.listen(), "HARU_API_TOKEN": CLI_TOKEN, "DATABASE_URL": url}
        )

    yield serve
    for server in reversed(servers):
        server.stop()


# -- the server and the proxy in this process -------------------------------------------------

QUICK_PROXY = ProxyTuning(disconnect_poll_ms=20, outage_memo_ms=50)


@pytest.fixture
def running_server() -> Callable[[Settings], AbstractAsyncContextManager[str]]:
    """``async with running_server(settings) as url``: ``run_server`` in this process."""

    @asynccontextmanager
    async def run(settings: Settings) -> AsyncIterator[str]:
        listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        task = asyncio.create_task(
            run_server(settings, on_listening=listening.set_result, stop=stop)
        )
        try:
            yield await asyncio.wait_for(asyncio.shield(listening), 30)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    return run


@pytest.fixture
async def stack() -> AsyncIterator[contextlib.AsyncExitStack]:
    """One exit stack for the test's servers and clients, closed after it."""
    async with contextlib.AsyncExitStack() as stack:
        yield stack


@pytest.fixture
def serve_app(stack: contextlib.AsyncExitStack) -> Callable[..., Awaitable[str]]:
    """``origin = await serve_app(app, handler_cancellation=False)``: on 127.0.0.1 until
    :func:`stack` closes."""

    async def serve(app: web.Application, *, handler_cancellation: bool = False) -> str:
        runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    return serve


@web.middleware
async def _render_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return render_api_error(exc)


def _proxy_app(
    store: StateStore,
    settings: Settings,
    *,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    metrics: ServerMetrics | None = None,
    tuning: ProxyTuning = QUICK_PROXY,
    kicker: Any = None,
) -> web.Application:
    app = web.Application(middlewares=[_render_errors])
    app[settings_key] = settings
    app[store_key] = store
    app[clock_key] = clock
    if metrics is not None:
        app[metrics_key] = metrics
        add_metrics_route(app, metrics.exposition, before_scrape=metrics.before_scrape)
    install_proxy(app, tuning=tuning, kicker=kicker)
    return app


@pytest.fixture
def proxy_app() -> Callable[..., web.Application]:
    """``app = proxy_app(store, settings, clock=, metrics=, tuning=, kicker=)``: the proxy
    alone (and ``/metrics`` with ``metrics``), ``ApiError`` rendered; quick tuning by default."""
    return _proxy_app


@pytest.fixture
def serve_proxy(serve_app: Callable[..., Awaitable[str]]) -> Callable[..., Awaitable[str]]:
    """``base = await serve_proxy(store, settings, **proxy_app options)``: its ``/v1`` URL."""

    async def serve(store: StateStore, settings: Settings, **options: Any) -> str:
        return await serve_app(_proxy_app(store, settings, **options)) + "/v1"

    return serve


@pytest.fixture
def outside_address() -> str:
    """This host's IPv4 address on its default route (skips where it has only loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        with contextlib.suppress(OSError):
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
        address: str = probe.getsockname()[0]
    if address.startswith(("127.", "0.")):
        pytest.skip("this host has no non-loopback IPv4 address")
    return address
