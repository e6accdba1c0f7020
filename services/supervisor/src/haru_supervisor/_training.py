"""Training runs: one trainer and all its descendants per training slot (DESIGN 6.5).

A run is ``idle``, ``running`` or ``stopping``. Its trainer runs in its own session and
process group, but a descendant may leave both (``setsid``, a daemonizing double fork), so
the group alone does not hold "everything the trainer spawned". Each run therefore TRACKS
its descendants:

- The supervisor is a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): an orphaned
  descendant is reparented to the supervisor, never to init, so it stays findable.
- Every poll lists the host's processes (psutil, which reads ``/proc``): a process is the
  run's when its parent is one of the run's processes, when it is in the trainer's process
  group, or when it is an orphan adopted by the supervisor whose environment carries the
  slot's ``HARU_GPU_INDEX`` and ``HARU_CHECKPOINT_DIR`` (it escaped between two polls). A
  process is remembered by pid AND start time (psutil's process identity), so a recycled pid
  is never mistaken for it, and signals go through a pidfd. psutil has no ``prctl``, so the
  subreaper is still set through ``ctypes``.
- Every signal goes to the group and to each tracked process; a run is idle again only once
  none of them is alive. That is what lets a promotion trust that the training VRAM is
  released.

A cgroup per run would contain descendants without polling, but the supervisor usually runs
where it may not create one (a container, a systemd unit without delegation); the subreaper
and ``/proc`` need no privilege. Off Linux, only the process group is tracked.

The tracking itself is :mod:`haru_supervisor._process_tree`; the relay of what a trainer
writes, :mod:`haru_supervisor._trainer_output`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from haru_protocol import SupervisorTrainingSlot, TrainingRunState, TrainingSlotStatus, TrainingStop

from haru_supervisor._errors import ShuttingDownError, TrainingStartError
from haru_supervisor._process_tree import ProcessTracker, become_subreaper
from haru_supervisor._settings import CHECKPOINT_DIR_VAR, GPU_INDEX_VAR
from haru_supervisor._trainer_output import LINE_LIMIT, RELAY_DRAIN_S, relay_output
from haru_supervisor._users import RunAs, resolve_run_as

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
"""Monotonic seconds; injected so tests control deadlines."""

DEFAULT_POLL_S: Final = 0.05
"""How often a stopping run (or one whose trainer exited) checks for surviving processes."""

DEFAULT_TRACK_S: Final = 0.5
"""How often a running run lists the processes to learn its new descendants."""

KILL_WAIT_S: Final = 10.0
"""After SIGKILL, how long a process may linger (uninterruptible I/O) before it is logged."""


class TrainingRun:
    """The run of one training slot.

    ``start`` is idempotent (a no-op unless idle); ``stop`` sends SIGTERM to the whole process
    group now and SIGKILL when the grace expires; a later ``stop`` may only bring the kill
    deadline closer. A trainer that exits on its own returns the run to idle.
    """

    def __init__(
        self,
        slot: SupervisorTrainingSlot,
        *,
        base_env: Mapping[str, str],
        clock: Clock = time.monotonic,
        poll_s: float = DEFAULT_POLL_S,
        track_s: float = DEFAULT_TRACK_S,
    ) -> None:
        """Create an idle run.

        Args:
            slot: The training slot (command, GPU, checkpoint directory).
            base_env: The environment the trainer inherits, secrets already removed.
            clock: Monotonic seconds, for the kill deadline.
            poll_s: How often to check for surviving processes while stopping.
            track_s: How often to look for new descendants while running.

        Raises:
            SettingsError: The slot's ``runAs`` cannot be honoured (not root, no such user).
        """
        self._slot = slot
        self._run_as: RunAs | None = resolve_run_as(slot)
        login = (
            {}
            if self._run_as is None
            else {
                "HOME": self._run_as.home,
                "USER": self._run_as.name,
                "LOGNAME": self._run_as.name,
            }
        )
        self._env = {
            **base_env,
            **login,
            CHECKPOINT_DIR_VAR: slot.checkpoint_dir,
            GPU_INDEX_VAR: str(slot.gpu_index),
        }
        self._marks = {name: self._env[name] for name in (CHECKPOINT_DIR_VAR, GPU_INDEX_VAR)}
        self._clock = clock
        self._poll_s = poll_s
        self._track_s = track_s
        self._lock = asyncio.Lock()
        self._state = TrainingRunState.IDLE
        self._pgid: int | None = None
        self._tracker: ProcessTracker | None = None
        become_subreaper()
        self._kill_deadline: float | None = None
        self._stop_started: float | None = None
        self._last_stop: TrainingStop | None = None
        self._changed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._watcher: asyncio.Task[None] | None = None
        self._relays: list[asyncio.Task[None]] = []
        self._pipes: list[asyncio.ReadTransport] = []

    @property
    def gpu_index(self) -> int:
        """The slot's GPU."""
        return self._slot.gpu_index

    @property
    def state(self) -> TrainingRunState:
        """The run's state."""
        return self._state

    @property
    def kill_deadline(self) -> float | None:
        """When SIGKILL is due (clock seconds) while stopping; None otherwise."""
        return self._kill_deadline if self._state is TrainingRunState.STOPPING else None

    @property
    def environment(self) -> Mapping[str, str]:
        """The exact environment the trainer is started with."""
        return dict(self._env)

    async def pids(self) -> tuple[int, ...]:
        """The run's live processes (trainer and descendants); empty unless one is alive."""
        tracker = self._tracker
        if tracker is None:
            return ()
        return await asyncio.to_thread(tracker.refresh)

    async def status(self) -> TrainingSlotStatus:
        """The run as ``GET /v1/training/status`` reports it."""
        state = self._state
        pids = await self.pids()
        return TrainingSlotStatus(
            gpu_index=self.gpu_index, state=state, pids=pids, last_stop=self._last_stop
        )

    async def start(self) -> bool:
        """Spawn the trainer unless the run is already running or stopping.

        Returns:
            True when a trainer was spawned, False when the run was not idle.

        Raises:
            TrainingStartError: The command could not be spawned; the run stays idle.
        """
        async with self._lock:
            if self._state is not TrainingRunState.IDLE:
                return False
            command = self._slot.command
            run_as = self._run_as
            # Its output goes through the supervisor's log (one record per line), on pipes of
            # our own: a descendant that outlives the run may keep them open, and the
            # supervisor must be able to close its end then.
            pipes = [os.pipe(), os.pipe()]
            try:
                # With runAs: that user, its primary group and NO supplementary group (the
                # supervisor's, root's included, would otherwise stay).
                process = await asyncio.create_subprocess_exec(
                    *command,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=pipes[0][1],
                    stderr=pipes[1][1],
                    env=self._env,
                    start_new_session=True,
                    user=None if run_as is None else run_as.uid,
                    group=None if run_as is None else run_as.gid,
                    extra_groups=None if run_as is None else [],
                )
            except (OSError, ValueError) as exc:
                for read_end, _ in pipes:
                    os.close(read_end)
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise TrainingStartError(
                    self.gpu_index, f"cannot run {command[0][:200]!r}: {reason}"
                ) from exc
            finally:
                for _, write_end in pipes:
                    os.close(write_end)  # the trainer holds its own copies
            self._state = TrainingRunState.RUNNING
            self._pgid = process.pid
            self._tracker = ProcessTracker(process.pid, marks=self._marks)
            self._kill_deadline = None
            self._stop_started = None
            self._last_stop = None
            self._idle.clear()
            self._changed.clear()
            loop = asyncio.get_running_loop()
            for name, (read_end, _) in zip(("stdout", "stderr"), pipes, strict=True):
                reader = asyncio.StreamReader(limit=LINE_LIMIT)
                transport, _ = await loop.connect_read_pipe(
                    functools.partial(asyncio.StreamReaderProtocol, reader),
                    os.fdopen(read_end, "rb", buffering=0),
                )
                self._pipes.append(transport)
                self._relays.append(
                    asyncio.create_task(
                        relay_output(reader, gpu_index=self.gpu_index, name=name),
                        name=f"training-gpu{self.gpu_index}-{name}",
                    )
                )
            self._watcher = asyncio.create_task(
                self._watch(process), name=f"training-gpu{self.gpu_index}"
            )
            logger.info("training on GPU %d started (pid %d)", self.gpu_index, process.pid)
            return True

    async def stop(self, grace_s: float) -> None:
        """SIGTERM the run's processes now (when running) and SIGKILL them ``grace_s`` from now.

        While already stopping, only a closer deadline is taken; no second SIGTERM is sent.
        Stopping an idle run does nothing.
        """
        async with self._lock:
            tracker = self._tracker
            if self._state is TrainingRunState.IDLE or tracker is None:
                return
            if self._state is TrainingRunState.RUNNING:
                # The latest descendants first: one spawned since the last poll gets SIGTERM too.
                pids = await asyncio.to_thread(tracker.refresh)
                self._stop_started = self._clock()
                deadline = self._stop_started + max(0.0, grace_s)
                self._state = TrainingRunState.STOPPING
                self._kill_deadline = deadline
                logger.info(
                    "training on GPU %d: SIGTERM to group %d and %d process(es), SIGKILL in %.1f s",
                    self.gpu_index,
                    self._pgid,
                    len(pids),
                    grace_s,
                )
                tracker.signal(signal.SIGTERM)
            else:
                deadline = self._clock() + max(0.0, grace_s)
                if self._kill_deadline is None or deadline < self._kill_deadline:
                    self._kill_deadline = deadline
            self._changed.set()

    async def wait_idle(self) -> None:
        """Return once the run is idle (none of its processes alive)."""
        await self._idle.wait()

    async def close(self) -> None:
        """Cancel the watcher (after :meth:`stop` and a bounded wait failed to end the run)."""
        watcher = self._watcher
        if watcher is not None and not watcher.done():
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        for task in self._relays:
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        self._relays = []
        for transport in self._pipes:
            transport.close()
        self._pipes = []

    async def _watch(self, process: asyncio.subprocess.Process) -> None:
        pgid = process.pid
        tracker = self._tracker
        assert tracker is not None  # noqa: S101  (set with the process, before this task)
        leader = asyncio.create_task(process.wait(), name=f"training-gpu{self.gpu_index}-wait")
        killed_at: float | None = None
        lingering_logged = False
        try:
            while True:
                # Cleared before the state is read, so a stop() landing during the await
                # below is seen by the next wait instead of lost.
                self._changed.clear()
                leader_done = leader.done()
                live = await asyncio.to_thread(tracker.refresh)
                if leader_done and not live:
                    break
                now = self._clock()
                if leader_done and self._state is TrainingRunState.RUNNING:
                    # The trainer exited by itself but left processes behind: nothing would
                    # ever stop them, and they may hold the GPU.
                    logger.warning(
                        "training on GPU %d: trainer exited with status %s but left processes "
                        "%s; killing them",
                        self.gpu_index,
                        process.returncode,
                        list(live),
                    )
                    self._state = TrainingRunState.STOPPING
                    self._kill_deadline = now
                deadline = self._kill_deadline
                if (
                    self._state is TrainingRunState.STOPPING
                    and deadline is not None
                    and now >= deadline
                ):
                    # Repeated while anything survives: a process forked during the
                    # first kill can miss it.
                    tracker.signal(signal.SIGKILL)
                    if killed_at is None:
                        killed_at = now
                        logger.warning(
                            "training on GPU %d: grace expired, SIGKILL to group %d and "
                            "process(es) %s",
                            self.gpu_index,
                            pgid,
                            list(live),
                        )
                    elif not lingering_logged and now - killed_at > KILL_WAIT_S:
                        lingering_logged = True
                        logger.error(
                            "training on GPU %d: process(es) %s survive SIGKILL "
                            "(uninterruptible?); still waiting",
                            self.gpu_index,
                            list(live),
                        )
                await self._wait_for_change(leader, now=now)
            await self._end_relays()
            self._log_exit(process.returncode)
            started = self._stop_started
            if started is not None:
                # What the server records in its operation: how long the trainer took, and
                # whether the grace ran out.
                deadline = self._kill_deadline if self._kill_deadline is not None else started
                self._last_stop = TrainingStop(
                    stop_ms=round((self._clock() - started) * 1000),
                    killed=killed_at is not None,
                    grace_ms=round((deadline - started) * 1000),
                )
        finally:
            if not leader.done():
                leader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await leader
            self._state = TrainingRunState.IDLE
            self._kill_deadline = None
            self._pgid = None
            self._tracker = None
            self._idle.set()

    async def _end_relays(self) -> None:
        """Let the output relays read what is left (bounded), then stop them."""
        relays, self._relays = self._relays, []
        pipes, self._pipes = self._pipes, []
        if relays:
            _, pending = await asyncio.wait(relays, timeout=RELAY_DRAIN_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)
        for transport in pipes:
            transport.close()

    async def _wait_for_change(self, leader: asyncio.Task[int], *, now: float) -> None:
        """Sleep until the leader exits, a stop changes the deadline, or a poll is due."""
        timeout = self._track_s
        if leader.done() or self._state is TrainingRunState.STOPPING:
            timeout = self._poll_s
        deadline = self._kill_deadline
        if self._state is TrainingRunState.STOPPING and deadline is not None:
            timeout = min(timeout, self._poll_s if now >= deadline else deadline - now)
        changed = asyncio.create_task(self._changed.wait())
        try:
            await asyncio.wait(
                {leader, changed} if not leader.done() else {changed},
                timeout=timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            changed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await changed

    def _log_exit(self, returncode: int | None) -> None:
        if returncode is not None and returncode < 0:
            with contextlib.suppress(ValueError):
                logger.info(
                    "training on GPU %d ended by %s",
                    self.gpu_index,
                    signal.Signals(-returncode).name,
                )
                return
        level = logging.INFO if returncode == 0 else logging.WARNING
        logger.log(level, "training on GPU %d exited with status %s", self.gpu_index, returncode)


class TrainingRuns:
    """Every training slot's run, plus the shutdown latch that refuses new starts."""

    def __init__(
        self,
        slots: Iterable[SupervisorTrainingSlot],
        *,
        base_env: Mapping[str, str],
        clock: Clock = time.monotonic,
        poll_s: float = DEFAULT_POLL_S,
        track_s: float = DEFAULT_TRACK_S,
    ) -> None:
        """Create idle runs, one per slot, in config order."""
        self._runs = tuple(
            TrainingRun(slot, base_env=base_env, clock=clock, poll_s=poll_s, track_s=track_s)
            for slot in slots
        )

        self._refusing = False

    @property
    def runs(self) -> tuple[TrainingRun, ...]:
        """The runs, in config order."""
        return self._runs

    @property
    def refusing_starts(self) -> bool:
        """Whether shutdown began (no run may start any more)."""
        return self._refusing

    def refuse_starts(self) -> None:
        """Refuse every later start (the first step of shutdown)."""
        self._refusing = True

    def by_gpu(self, gpu_index: int) -> TrainingRun | None:
        """The run on ``gpu_index``, if any."""
        return next((run for run in self._runs if run.gpu_index == gpu_index), None)

    async def start_all(self) -> list[TrainingStartError]:
        """Start every idle run; the failures, one per slot that could not spawn.

        Raises:
            ShuttingDownError: Shutdown began.
        """
        if self._refusing:
            raise ShuttingDownError("the supervisor is shutting down")
        failures: list[TrainingStartError] = []
        for run in self._runs:
            # Checked again per run: shutdown may begin while an earlier spawn awaits.
            if self._refusing:
                raise ShuttingDownError("the supervisor is shutting down")
            try:
                await run.start()
            except TrainingStartError as exc:
                failures.append(exc)
        for failure in failures:
            logger.error("training could not start on %s", failure)
        return failures

    async def stop_all(self, grace_s: float) -> None:
        """Stop every run with the same grace (see :meth:`TrainingRun.stop`)."""
        for run in self._runs:
            await run.stop(grace_s)

    async def statuses(self) -> tuple[TrainingSlotStatus, ...]:
        """Every run's status, in config order."""
        return tuple(await asyncio.gather(*(run.status() for run in self._runs)))

    async def shutdown(self, grace_s: float) -> bool:
        """Refuse starts, stop every run, and wait until each is idle (bounded).

        Returns:
            True when every run ended; False when a process survived SIGKILL past
            :data:`KILL_WAIT_S` (logged; the watchers are then cancelled).
        """
        self.refuse_starts()
        await self.stop_all(grace_s)
        ended = True
        try:
            async with asyncio.timeout(max(0.0, grace_s) + KILL_WAIT_S):
                await asyncio.gather(*(run.wait_idle() for run in self._runs))
        except TimeoutError:
            ended = False
        if not ended:
            survivors = [
                run.gpu_index for run in self._runs if run.state is not TrainingRunState.IDLE
            ]
            logger.error("training runs on GPU(s) %s did not end after SIGKILL", survivors)
            for run in self._runs:
                await run.close()
        return ended
