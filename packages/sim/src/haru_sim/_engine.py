"""The emulated engine core: sleep state, request admission, pacing, faults, counters.

Mirrors vLLM 0.33's engine-core semantics that Haru depends on (``vllm/v1/engine/core.py``
``EngineCore.sleep`` / ``wake_up`` / ``is_sleeping``, ``EngineCoreProc.pause_scheduler``):

- From 0.17, ``sleep`` pauses the scheduler first (vllm#34528), then handles requests in
  flight by mode (``abort`` ends running and waiting ones with finish_reason ``abort``;
  ``wait`` lets the *running* ones finish while waiting ones stay parked; ``keep`` freezes
  them until wake), then sleeps the executor once the engine is idle. A wake meanwhile
  resumes the scheduler, and the deferred executor sleep still runs later.
- ``is_sleeping`` is true while the scheduler is paused or any tag sleeps; it is answered by
  the engine loop, so it waits while the executor sleeps or wakes.
- At most ``max_num_seqs`` requests run; the rest wait in FIFO order. Requests that arrive
  while paused wait (parked) until the engine is fully awake: the client just hangs.
- The gauges are refreshed only by engine steps, so they freeze while nothing steps.
- Sleeping while asleep and waking while awake are quick no-ops that still answer 200.

How the engine waits on its own state (broadcasts, shutdown, detached admin calls) is
:mod:`haru_sim._engine_waits`; ``/_sim/state`` renders it (:mod:`haru_sim._vllm_control`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from haru_sim._config import SLEEP_TAGS, Faults, SleepMode, VllmSimConfig
from haru_sim._engine_waits import EngineWaits, ServerClosingError
from haru_sim._errors import SimUnsupportedError

logger = logging.getLogger(__name__)


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


class SimulatedFaultError(Exception):
    """An injected fault makes this call fail (answered as HTTP 500)."""


class Generation:
    """One request between admission and completion (a generation or an embedding)."""

    __slots__ = ("aborted", "parked")

    def __init__(self) -> None:
        self.aborted = False
        self.parked = False


PauseState = Literal["unpaused", "paused_new", "paused_all"]
"""vLLM's ``PauseState``: ``paused_new`` holds new requests (``abort``/``wait``), ``paused_all``
also freezes running ones (``keep``)."""


class Engine(EngineWaits):
    """State shared by every route of one emulated vLLM server.

    Models vLLM's engine core as three parts: the scheduler (pause state, a FIFO waiting queue,
    at most ``max_num_seqs`` running), the executor (which tags sleep) and the engine loop
    (``_loop_lock``: held while the loop runs a utility call, i.e. the executor's sleep or wake;
    ``/is_sleeping`` is answered by that loop, so it waits for it).
    """

    def __init__(self, config: VllmSimConfig) -> None:
        super().__init__()
        self.config = config
        self._faults = config.faults
        self._faults_lock = asyncio.Lock()
        self._loop_lock = asyncio.Lock()
        self.listener: ListenerControl | None = None
        start_asleep = config.start_asleep
        self._pause: PauseState = (
            "paused_new" if start_asleep and config.sleep_pauses else "unpaused"
        )
        self._sleeping_tags: set[str] = set(SLEEP_TAGS) if start_asleep else set()
        self._level: int | None = 1 if start_asleep else None
        self._running: set[Generation] = set()
        self._waiting: list[Generation] = []
        self._tokenizing = 0
        self._sleep_ops = 0
        self._gauge_running = 0
        self._gauge_waiting = 0
        self.requests_served: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.sleeps = 0
        self.wakes = 0
        self.arrived_while_sleeping = 0
        self.parked_total = 0
        self._recorded: deque[RecordedRequest] = deque(maxlen=config.request_log_size)

    # -- state -------------------------------------------------------------------------------

    @property
    def faults(self) -> Faults:
        return self._faults

    @property
    def is_sleeping(self) -> bool:
        """What vLLM's ``is_sleeping`` answers: the scheduler is paused or some tag still sleeps."""
        return self._pause != "unpaused" or bool(self._sleeping_tags)

    @property
    def sleep_level(self) -> int | None:
        """Level of the sleep in effect, or None while awake."""
        return self._level if self.is_sleeping else None

    @property
    def sleeping_tags(self) -> frozenset[str]:
        return frozenset(self._sleeping_tags)

    @property
    def pause_state(self) -> PauseState:
        return self._pause

    @property
    def num_running(self) -> int:
        """Requests being generated right now (live, not the per-step gauge)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue right now: over capacity, or parked by a pause."""
        return len(self._waiting)

    @property
    def num_tokenizing(self) -> int:
        """Requests still in the frontend (tokenising), not yet in the engine."""
        return self._tokenizing

    @property
    def num_parked(self) -> int:
        """Waiting requests held by a pause or a sleeping executor (0 while scheduling)."""
        return len(self._waiting) if self._held() else 0

    @property
    def gauge_running(self) -> int:
        """``vllm:num_requests_running`` as of the last engine step."""
        return self._gauge_running

    @property
    def gauge_waiting(self) -> int:
        """``vllm:num_requests_waiting`` as of the last engine step."""
        return self._gauge_waiting

    @property
    def sleep_in_progress(self) -> bool:
        """A ``/sleep`` call has not answered yet (draining, or the executor is going to sleep)."""
        return self._sleep_ops > 0

    @property
    def loop_busy(self) -> bool:
        """The engine loop runs an executor sleep or wake: ``/is_sleeping`` waits for it."""
        return self._loop_lock.locked()

    @property
    def recorded_requests(self) -> tuple[RecordedRequest, ...]:
        return tuple(self._recorded)

    def record(self, request: RecordedRequest) -> None:
        self._recorded.append(request)

    def clear_recorded(self) -> None:
        self._recorded.clear()

    # -- engine steps (gauges) -----------------------------------------------------------------

    def start_stepping(self) -> None:
        """Start the engine-step clock that refreshes the gauges (idempotent; needs a loop)."""
        if self._background is None and not self._closing:
            self._background = asyncio.create_task(self._step_loop())

    def _held(self) -> bool:
        """The scheduler admits nothing: paused, or (vLLM >= 0.17) the executor sleeps."""
        if self._pause != "unpaused":
            return True
        return bool(self._sleeping_tags) and self.config.sleep_pauses

    def _steps(self) -> bool:
        """The engine loop would step running requests now."""
        if self._pause == "paused_all" or self._loop_lock.locked():
            return False
        return not (self._sleeping_tags and self.config.sleep_pauses)

    def _has_work(self) -> bool:
        """Like vLLM's ``has_work``: running requests, or waiting ones the scheduler may admit."""
        if not self._steps():
            return False
        return bool(self._running) or (bool(self._waiting) and not self._held())

    def _snapshot(self) -> None:
        # What the scheduler reports with each step's outputs (SchedulerStats).
        self._gauge_running = len(self._running)
        self._gauge_waiting = len(self._waiting)

    async def _step_loop(self) -> None:
        period = self.config.step_period_ms / 1000
        try:
            while True:
                await self._wait_until(self._has_work)
                while self._has_work():
                    await self.delay(period)
                    if self._steps():
                        self._snapshot()
        except ServerClosingError:
            return

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

    async def is_sleeping_answer(self) -> bool:
        """``GET /is_sleeping``: answered by the engine loop, so it waits out a sleep or wake.

        Raises:
            ServerClosingError: The server shut down meanwhile.
        """
        async with self._loop_lock:
            if self._closing:
                raise ServerClosingError
            return self.is_sleeping

    async def sleep(self, level: int, mode: SleepMode) -> None:
        """Like vLLM's ``EngineCore.sleep``: pause the scheduler by ``mode``, then sleep ``level``.

        From vLLM 0.17 the scheduler pauses first: ``abort`` ends running and waiting requests,
        ``wait`` lets the running ones finish (waiting ones stay parked), ``keep`` freezes
        them. The executor then sleeps once the engine is idle, which may be long after a
        ``/wake_up`` resumed the scheduler meanwhile. Before 0.17 (``config.sleep_pauses``
        false) nothing pauses and ``mode`` is ignored.

        Raises:
            SimulatedFaultError: The ``sleep_fails`` fault is on.
            ServerClosingError: The server shut down meanwhile.
        """
        if self._faults.sleep_fails:
            raise SimulatedFaultError("simulated sleep failure")
        self._sleep_ops += 1
        try:
            if self.config.sleep_pauses:
                async with self._loop_lock:  # pause_scheduler runs in the engine loop
                    was_paused = self._pause != "unpaused"
                    if mode == "abort":
                        self._abort_all()
                    self._pause = "paused_all" if mode == "keep" else "paused_new"
                    self._mark_parked()
                    if level == 0 and not self._sleeping_tags:
                        self._level = 0
                        if not was_paused:
                            self.sleeps += 1
                    self._notify()
                # The pause completes (and a level >= 1 sleep proceeds) once the engine is idle.
                await self._wait_until(lambda: not self._has_work())
            if level == 0:
                logger.info("scheduler paused (level 0, mode=%s)", mode)
                return
            async with self._loop_lock:  # executor.sleep blocks the engine loop
                if self._sleeping_tags:
                    # vLLM logs "Executor is already sleeping." and answers 200 at once.
                    logger.info("Executor is already sleeping.")
                else:
                    await self.delay(self.config.sleep_latency_ms / 1000)
                    self._sleeping_tags = set(SLEEP_TAGS)
                    self._level = level
                    self.sleeps += 1
                    self._mark_parked()
                logger.info("asleep at level %s (mode=%s)", self._level, mode)
                self._notify()
        finally:
            self._sleep_ops -= 1
            self._notify()

    async def wake_up(self, tags: Sequence[str] | None) -> bool:
        """Wake ``tags`` (None = everything); resume the scheduler once fully awake.

        Waking while the executor is awake answers at once and resumes the scheduler (this is
        also what a wake during a deferred ``wait`` sleep does; that sleep still runs later).

        Returns:
            True when fully awake afterwards (vLLM answers ``"awake"``), False after a partial
            wake (``"sleeping"``).

        Raises:
            SimulatedFaultError: The ``wake_fails`` fault is on.
            ServerClosingError: The server shut down meanwhile.
        """
        if self._faults.wake_fails:
            raise SimulatedFaultError("simulated wake failure")
        async with self._loop_lock:  # executor.wake_up blocks the engine loop
            was_sleeping = self.is_sleeping
            to_wake = set(self._sleeping_tags) if tags is None else self._sleeping_tags & set(tags)
            for tag in set(tags or ()) - self._sleeping_tags:
                logger.info("Tag %s is not in sleeping tags", tag)
            if not self._sleeping_tags:
                logger.info("Executor is not sleeping.")
            if to_wake:
                await self.delay(self.config.wake_latency_ms / 1000)
                self._sleeping_tags -= to_wake
            fully_awake = not self._sleeping_tags
            if fully_awake:
                # Like vLLM, a wake also resumes a pause (level 0, or a deferred wait sleep).
                self._pause = "unpaused"
                self._level = None
                if was_sleeping:
                    self.wakes += 1
                logger.info("awake")
            self._notify()
            return fully_awake

    def _abort_all(self) -> None:
        # finish_requests(None, FINISHED_ABORTED): running and waiting leave the scheduler now.
        for generation in (*self._running, *self._waiting):
            generation.aborted = True
            self.finished["abort"] += 1
        self._running.clear()
        self._waiting.clear()
        self._notify()

    def _mark_parked(self) -> None:
        if self._held():
            for generation in self._waiting:
                if not generation.parked:
                    generation.parked = True
                    self.parked_total += 1

    # -- generations ---------------------------------------------------------------------------

    def note_arrival(self) -> None:
        """Count an inference request that reached the server while sleeping or asleep."""
        if self.is_sleeping or self._sleep_ops:
            self.arrived_while_sleeping += 1

    def _admissible(self, generation: Generation) -> bool:
        return (
            not self._held()
            and not self._loop_lock.locked()
            and len(self._running) < self.config.max_num_seqs
            and bool(self._waiting)
            and self._waiting[0] is generation
        )

    async def admit(self, generation: Generation) -> bool:
        """Tokenise, queue (FIFO), then run ``generation`` once the scheduler admits it.

        It waits while the scheduler is paused or ``max_num_seqs`` requests run; a client
        waiting behind a pause just hangs, like in vLLM.

        Returns:
            True once admitted (running), False when it was aborted while waiting.

        Raises:
            ServerClosingError: The server shut down while it was waiting.
        """
        if self._closing:
            raise ServerClosingError
        self._tokenizing += 1
        try:
            await self.delay(self.config.tokenize_latency_ms / 1000)
        finally:
            self._tokenizing -= 1
        self._waiting.append(generation)
        if self._held():
            generation.parked = True
            self.parked_total += 1
        self._notify()
        try:
            await self._wait_until(lambda: generation.aborted or self._admissible(generation))
        finally:
            if generation in self._waiting:
                self._waiting.remove(generation)
                self._notify()
        if generation.aborted:
            return False
        self._running.add(generation)
        self._notify()
        return True

    async def pace(self, generation: Generation, seconds: float) -> bool:
        """Spend ``seconds`` producing the next token; stay frozen while the engine does not step.

        Returns:
            True to go on, False when the generation was aborted.

        Raises:
            ServerClosingError: The server shut down meanwhile.
        """
        if seconds > 0:
            await self._wait_until(lambda: generation.aborted, seconds)
        # Frozen by a sleep with mode=keep (or an executor sleep/wake in progress).
        await self._wait_until(lambda: self._steps() or generation.aborted)
        return not generation.aborted

    def finish(self, generation: Generation, finish_reason: str) -> None:
        """Retire an admitted generation; the step that finishes it reports the gauges."""
        if generation in self._running:
            self._running.discard(generation)
            self.finished[finish_reason] += 1
            self._snapshot()
            self._notify()

    def release(self, generation: Generation) -> None:
        """Forget a generation whose client went away or whose server is closing."""
        if generation in self._running:
            self._running.discard(generation)
            self._notify()
