"""``VllmSim``: a runnable emulated vLLM server on a real socket."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Self, Unpack

from aiohttp import web

from haru_sim._config import Faults, FaultUpdate, SleepMode, VllmSimConfig
from haru_sim._engine import Engine, RecordedRequest
from haru_sim._errors import SimStateError
from haru_sim._vllm import build_app
from haru_sim._vllm_control import engine_state

logger = logging.getLogger(__name__)

# Parked and hung requests are released when shutdown starts, so handlers end at once;
# this only bounds a handler stuck in something else.
_SHUTDOWN_TIMEOUT_S = 5.0


def _format_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class VllmSim:
    """One emulated ``vllm serve`` process, listening on a real TCP port.

    Use ``async with VllmSim(config) as sim:`` (127.0.0.1, ephemeral port) or call
    :meth:`start` / :meth:`stop`. A handle runs once: it cannot be restarted after
    :meth:`stop`.

    Example::

        async with VllmSim(VllmSimConfig(served_model_names=("chat-small",))) as sim:
            await sim.set_faults(error_500=True)
            ...  # talk to sim.url
    """

    def __init__(self, config: VllmSimConfig | None = None) -> None:
        """Create a stopped server.

        Args:
            config: Its configuration; defaults to ``VllmSimConfig()``.
        """
        self._config = config if config is not None else VllmSimConfig()
        self._engine = Engine(self._config)
        self._engine.listener = self
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._control_runner: web.AppRunner | None = None
        self._control_port: int | None = None
        self._host = "127.0.0.1"
        self._port: int | None = None
        self._stopped = False
        self._listen_lock = asyncio.Lock()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, control_port: int | None = None
    ) -> None:
        """Listen on ``host:port`` (``port=0``: an ephemeral port, see :attr:`port`).

        Args:
            host: Interface to bind.
            port: TCP port; 0 picks a free one.
            control_port: Also serve the ``/_sim/*`` control routes on this port (0 =
                ephemeral), on a listener the ``refuse`` fault never closes, so another process
                can clear ``refuse``. None = no separate control listener.

        Raises:
            SimStateError: Already started, or stopped.
            OSError: The port could not be bound.
        """
        if self._runner is not None or self._stopped:
            raise SimStateError("a VllmSim can be started only once")
        # handler_cancellation: a client that disconnects aborts its request, as in vLLM.
        runner = web.AppRunner(
            build_app(self._engine),
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
            handler_cancellation=True,
        )
        await runner.setup()
        self._runner = runner
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            self._site = site
            self._host = host
            self._port = site.port
            if control_port is not None:
                control_runner = web.AppRunner(
                    build_app(self._engine, control_only=True),
                    shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
                )
                await control_runner.setup()
                self._control_runner = control_runner
                control_site = web.TCPSite(control_runner, host, control_port)
                await control_site.start()
                self._control_port = control_site.port
            if self._engine.faults.refuse:
                await self.set_listening(False)
        except BaseException:
            await self.stop()
            raise
        logger.info("emulated vLLM listening on %s", self.url)

    async def stop(self) -> None:
        """Stop listening, release parked and hung requests (their connections drop), clean up.

        Idempotent.
        """
        self._stopped = True
        runners = [r for r in (self._runner, self._control_runner) if r is not None]
        self._runner = None
        self._control_runner = None
        self._site = None
        self._engine.close()
        for runner in runners:
            await runner.cleanup()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def set_listening(self, listening: bool) -> None:
        """Open or close the listening socket on the same port (used by the ``refuse`` fault)."""
        async with self._listen_lock:
            if self._runner is None or self._port is None:
                return  # not running: start() applies the refuse fault in effect
            if listening and self._site is None:
                site = web.TCPSite(self._runner, self._host, self._port)
                await site.start()
                self._site = site
                logger.info("listening again on %s", self.url)
            elif not listening and self._site is not None:
                await self._site.stop()
                self._site = None
                logger.info("stopped listening on %s (refuse)", self.url)

    # -- addresses ---------------------------------------------------------------------------

    @property
    def config(self) -> VllmSimConfig:
        """The configuration this server runs with."""
        return self._config

    @property
    def host(self) -> str:
        """The bound interface."""
        return self._host

    @property
    def port(self) -> int:
        """The bound port (known once started).

        Raises:
            SimStateError: Not started yet.
        """
        if self._port is None:
            raise SimStateError("the server has not been started")
        return self._port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (no trailing slash)."""
        return _format_url(self._host, self.port)

    @property
    def control_url(self) -> str | None:
        """Base URL of the separate control listener, or None when there is none."""
        if self._control_port is None:
            return None
        return _format_url(self._host, self._control_port)

    # -- faults ------------------------------------------------------------------------------

    @property
    def faults(self) -> Faults:
        """The faults in effect."""
        return self._engine.faults

    async def set_faults(self, **changes: Unpack[FaultUpdate]) -> Faults:
        """Change some faults (the others keep their value); returns the faults now in effect.

        Raises:
            SimConfigError: A name or value is invalid.
        """
        return await self._engine.set_faults(self._engine.faults.updated(changes))

    async def clear_faults(self) -> Faults:
        """Turn every fault off (``refuse`` included: the port listens again)."""
        return await self._engine.set_faults(Faults())

    # -- sleep state -------------------------------------------------------------------------

    @property
    def sleeping(self) -> bool:
        """What ``GET /is_sleeping`` would answer: true from a sleep's start to a full wake."""
        return self._engine.is_sleeping

    @property
    def sleep_level(self) -> int | None:
        """The sleep level in effect, or None while awake."""
        return self._engine.sleep_level

    async def sleep(self, level: int = 1, *, mode: SleepMode = "abort") -> None:
        """Do what ``POST /sleep?level=&mode=`` does (latency and faults included)."""
        await self._engine.sleep(level, mode)

    async def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """Do what ``POST /wake_up`` does; True when fully awake afterwards."""
        return await self._engine.wake_up(tags)

    # -- counters ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests being generated right now (live; the gauge lags, see :attr:`gauges`)."""
        return self._engine.num_running

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue right now: over ``max_num_seqs``, or parked."""
        return self._engine.num_waiting

    @property
    def num_tokenizing(self) -> int:
        """Requests still being tokenised (in neither the running nor the waiting count)."""
        return self._engine.num_tokenizing

    @property
    def num_parked(self) -> int:
        """Waiting requests held by a pause or a sleeping engine right now."""
        return self._engine.num_parked

    @property
    def parked_total(self) -> int:
        """Requests that ever waited behind a pause or a sleeping engine."""
        return self._engine.parked_total

    @property
    def arrived_while_sleeping(self) -> int:
        """Inference requests that arrived while asleep or while a ``/sleep`` was in progress."""
        return self._engine.arrived_while_sleeping

    @property
    def gauges(self) -> tuple[int, int] | None:
        """(running, waiting) as ``/metrics`` shows them (last engine step); None without stats."""
        if not self._config.log_stats:
            return None
        return self._engine.gauge_running, self._engine.gauge_waiting

    @property
    def sleep_in_progress(self) -> bool:
        """A ``/sleep`` has not answered yet (draining, or the executor is going to sleep)."""
        return self._engine.sleep_in_progress

    @property
    def requests_served(self) -> Mapping[str, int]:
        """Requests received per route path (e.g. ``"/v1/chat/completions"``), a snapshot."""
        return dict(self._engine.requests_served)

    @property
    def sleeps(self) -> int:
        """Transitions from awake to asleep."""
        return self._engine.sleeps

    @property
    def wakes(self) -> int:
        """Transitions from asleep to fully awake."""
        return self._engine.wakes

    @property
    def recorded_requests(self) -> tuple[RecordedRequest, ...]:
        """The last ``request_log_size`` inference requests, oldest first, raw bodies included."""
        return self._engine.recorded_requests

    def clear_recorded_requests(self) -> None:
        """Forget the recorded inference requests."""
        self._engine.clear_recorded()

    def state(self) -> dict[str, object]:
        """The same JSON object ``GET /_sim/state`` answers."""
        return engine_state(self._engine)
