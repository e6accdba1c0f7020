"""The emulated engine core: sleep state, request admission, pacing, faults, counters.

Mirrors vLLM 0.33's engine-core semantics that Haru depends on:

- ``sleep`` always pauses the scheduler first (vllm#34528), then handles requests in flight
  by mode (``abort`` ends them with finish_reason ``abort``; ``wait`` lets the running ones
  finish; ``keep`` freezes them until wake), then sleeps the executor.
- ``is_sleeping`` is true while the scheduler is paused or any tag sleeps, so it turns true
  as soon as a sleep starts and false only once a wake is complete.
- Requests that arrive while paused are parked (counted as waiting) until the engine is
  fully awake: the client just hangs, exactly like vLLM (closed PR vllm#45326).
- Sleeping while asleep and waking while awake are quick no-ops that still answer 200.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from haru_sim._config import SLEEP_TAGS, Faults, SleepMode, VllmSimConfig
from haru_sim._errors import SimUnsupportedError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class RecordedRequest:
    """One inference request exactly as it reached the emulated server.

    Attributes:
        method: HTTP method.
        path: Path with query string, as sent.
        headers: Request headers in arrival order (names as sent).
        body: The raw body bytes, unparsed.
        received_at: Wall-clock arrival time (``time.time()``).
    """

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    received_at: float


class ListenerControl(Protocol):
    """What the engine needs from whoever owns the listening socket (for ``refuse``)."""

    async def set_listening(self, listening: bool) -> None:
        """Open (True) or close (False) the listening socket on the same port."""


class ServerClosingError(Exception):
    """The server is shutting down; a request waiting inside it must drop its connection."""


class SimulatedFaultError(Exception):
    """An injected fault makes this call fail (answered as HTTP 500)."""


class Generation:
    """One request between admission and completion (a generation or an embedding)."""

    __slots__ = ("aborted",)

    def __init__(self) -> None:
        self.aborted = False


class Engine:
    """State shared by every route of one emulated vLLM server."""

    def __init__(self, config: VllmSimConfig) -> None:
        self.config = config
        self._faults = config.faults
        self._faults_lock = asyncio.Lock()
        self._admin_lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._closing = False
        self.listener: ListenerControl | None = None
        # Scheduler: admitting new requests / stepping admitted ones. Both false while paused.
        self._admitting = not config.start_asleep
        self._stepping = not config.start_asleep
        self._sleeping_tags: set[str] = set(SLEEP_TAGS) if config.start_asleep else set()
        self._level: int | None = 1 if config.start_asleep else None
        self._running: set[Generation] = set()
        self._waiting: set[Generation] = set()
        self.requests_served: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.sleeps = 0
        self.wakes = 0
        self.parked = 0
        """Generations that arrived while the scheduler was paused (asleep or falling asleep)."""
        self._recorded: deque[RecordedRequest] = deque(maxlen=config.request_log_size)
        self._detached: set[asyncio.Task[Any]] = set()

    # -- state -------------------------------------------------------------------------------

    @property
    def faults(self) -> Faults:
        return self._faults

    @property
    def is_sleeping(self) -> bool:
        """What vLLM's ``is_sleeping`` answers: the scheduler is paused or some tag still sleeps."""
        return not self._admitting or bool(self._sleeping_tags)

    @property
    def sleep_level(self) -> int | None:
        """Level of the sleep in effect, or None while awake."""
        return self._level if self.is_sleeping else None

    @property
    def sleeping_tags(self) -> frozenset[str]:
        return frozenset(self._sleeping_tags)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def recorded_requests(self) -> tuple[RecordedRequest, ...]:
        return tuple(self._recorded)

    def record(self, request: RecordedRequest) -> None:
        self._recorded.append(request)

    def clear_recorded(self) -> None:
        self._recorded.clear()

    def _notify(self) -> None:
        # Broadcast: wake every waiter, which re-checks its own condition.
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_until(
        self, condition: Callable[[], bool], timeout: float | None = None
    ) -> bool:
        """Wait until ``condition()`` holds (True) or ``timeout`` seconds pass (False).

        Raises:
            ServerClosingError: The server started shutting down.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._closing:
                raise ServerClosingError
            if condition():
                return True
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            changed = self._changed
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                pass

    async def delay(self, seconds: float) -> None:
        """Sleep ``seconds`` unless the server shuts down first (then raise)."""
        if seconds > 0:
            await self._wait_until(lambda: False, seconds)
        elif self._closing:
            raise ServerClosingError

    def close(self) -> None:
        """Release every waiting request: the server is shutting down."""
        self._closing = True
        self._notify()

    async def run_detached(self, operation: Coroutine[Any, Any, _T]) -> _T:
        """Run ``operation`` to its end even if the caller is cancelled.

        A vLLM sleep or wake goes on when its HTTP client disconnects; the server cancels a
        handler whose client went away (which is what aborts generations), so admin calls
        run in a task the engine holds and awaits at shutdown.
        """
        task = asyncio.create_task(operation)
        self._detached.add(task)
        task.add_done_callback(self._detached_done)
        return await asyncio.shield(task)

    def _detached_done(self, task: asyncio.Task[Any]) -> None:
        self._detached.discard(task)
        # Retrieve the outcome so an operation whose caller left does not warn at exit.
        if not task.cancelled() and task.exception() is not None:
            logger.info("detached admin operation ended with %r", task.exception())

    async def wait_detached(self) -> None:
        """Wait for detached admin operations (they end quickly once :meth:`close` ran)."""
        if self._detached:
            await asyncio.gather(*self._detached, return_exceptions=True)

    # -- faults ------------------------------------------------------------------------------

    async def set_faults(self, faults: Faults) -> Faults:
        """Replace the active faults, opening or closing the listener when ``refuse`` flips.

        Raises:
            SimUnsupportedError: ``refuse`` was asked for but no listener is attached.
        """
        async with self._faults_lock:
            if faults.refuse != self._faults.refuse:
                if self.listener is None:
                    raise SimUnsupportedError(
                        "the refuse fault needs a listener owned by VllmSim "
                        "(this app was mounted by someone else)"
                    )
                await self.listener.set_listening(not faults.refuse)
            self._faults = faults
            logger.info("faults now %s", faults)
            self._notify()
            return faults

    async def wait_while_hung(self) -> None:
        await self._wait_until(lambda: not self._faults.hang)

    # -- admin (sleep / wake) ------------------------------------------------------------------

    async def sleep(self, level: int, mode: SleepMode) -> None:
        """Pause the scheduler, settle in-flight requests by ``mode``, then sleep ``level``.

        Raises:
            SimulatedFaultError: The ``sleep_fails`` fault is on.
            ServerClosingError: The server shut down meanwhile.
        """
        async with self._admin_lock:
            if self._faults.sleep_fails:
                raise SimulatedFaultError("simulated sleep failure")
            was_paused = not self._admitting
            self._admitting = False
            if mode == "abort":
                self._abort_all()
            elif mode == "wait" and self._stepping:
                # Only a stepping engine can drain; requests frozen by an earlier keep stay.
                self._notify()
                await self._wait_until(lambda: not self._running)
            self._stepping = False
            self._notify()
            if level == 0:
                if not self._sleeping_tags:
                    self._level = 0
            elif not self._sleeping_tags:
                await self.delay(self.config.sleep_latency_ms / 1000)
                self._sleeping_tags = set(SLEEP_TAGS)
                self._level = level
            # else: the executor already sleeps; vLLM logs "Executor is already sleeping." and
            # answers 200 at once, echoing the requested level.
            if not was_paused:
                self.sleeps += 1
            logger.info("asleep at level %s (mode=%s)", self._level, mode)
            self._notify()

    async def wake_up(self, tags: Sequence[str] | None) -> bool:
        """Wake ``tags`` (None = everything); resume the scheduler once fully awake.

        Returns:
            True when fully awake afterwards (vLLM answers ``"awake"``), False after a partial
            wake (``"sleeping"``).

        Raises:
            SimulatedFaultError: The ``wake_fails`` fault is on.
            ServerClosingError: The server shut down meanwhile.
        """
        async with self._admin_lock:
            if self._faults.wake_fails:
                raise SimulatedFaultError("simulated wake failure")
            to_wake = set(self._sleeping_tags) if tags is None else self._sleeping_tags & set(tags)
            for tag in set(tags or ()) - self._sleeping_tags:
                logger.info("Tag %s is not in sleeping tags", tag)
            if to_wake:
                await self.delay(self.config.wake_latency_ms / 1000)
                self._sleeping_tags -= to_wake
            fully_awake = not self._sleeping_tags
            if fully_awake:
                # Like vLLM, a wake also resumes a pause left by a level-0 sleep.
                if not self._admitting:
                    self.wakes += 1
                self._admitting = True
                self._stepping = True
                self._level = None
                logger.info("awake")
            self._notify()
            return fully_awake

    def _abort_all(self) -> None:
        for generation in (*self._running, *self._waiting):
            generation.aborted = True
        self._notify()

    # -- generations ---------------------------------------------------------------------------

    async def admit(self, generation: Generation) -> bool:
        """Admit ``generation``; park it (counted as waiting) while the scheduler is paused.

        Returns:
            True once admitted (running), False when it was aborted while parked.

        Raises:
            ServerClosingError: The server shut down while it was parked.
        """
        if self._closing:
            raise ServerClosingError
        if not self._admitting:
            self.parked += 1
            self._waiting.add(generation)
            try:
                await self._wait_until(lambda: self._admitting or generation.aborted)
            finally:
                self._waiting.discard(generation)
            if generation.aborted:
                self._finish_counted("abort")
                return False
        self._running.add(generation)
        return True

    async def pace(self, generation: Generation, seconds: float) -> bool:
        """Spend ``seconds`` producing the next token; stay frozen while the engine is paused.

        Returns:
            True to go on, False when the generation was aborted.

        Raises:
            ServerClosingError: The server shut down meanwhile.
        """
        if seconds > 0:
            await self._wait_until(lambda: generation.aborted, seconds)
        # Frozen by a sleep with mode=keep: hold the token until the engine steps again.
        await self._wait_until(lambda: self._stepping or generation.aborted)
        return not generation.aborted

    def finish(self, generation: Generation, finish_reason: str) -> None:
        """Retire an admitted generation."""
        if generation in self._running:
            self._running.discard(generation)
            self._finish_counted(finish_reason)
            self._notify()

    def release(self, generation: Generation) -> None:
        """Forget a generation whose client went away or whose server is closing."""
        if generation in self._running:
            self._running.discard(generation)
            self._notify()

    def _finish_counted(self, finish_reason: str) -> None:
        self.finished[finish_reason] += 1

    # -- introspection -------------------------------------------------------------------------

    def state_json(self) -> dict[str, object]:
        """``GET /_sim/state``."""
        counters: Mapping[str, object] = {
            "requests": dict(sorted(self.requests_served.items())),
            "finished": dict(sorted(self.finished.items())),
            "sleeps": self.sleeps,
            "wakes": self.wakes,
            "parked": self.parked,
        }
        return {
            "served_model_names": list(self.config.served_model_names),
            "dev_mode": self.config.dev_mode,
            "sleeping": self.is_sleeping,
            "sleep_level": self.sleep_level,
            "sleeping_tags": sorted(self._sleeping_tags),
            "num_requests_running": self.num_running,
            "num_requests_waiting": self.num_waiting,
            "faults": self._faults.to_json(),
            "counters": counters,
            "recorded_requests": len(self._recorded),
            "time": time.time(),
        }
