"""The background reconcile loop (``HARU_RECONCILE_INTERVAL_MS``).

One worker task per fleet: a slow fleet never delays another, and a fleet never overlaps
itself in one process. A worker ticks its fleet every interval, comes back after
``busy_interval_s`` while an operation is in flight, and ticks at once when kicked (an
accepted promote or demote, or the proxy's passive failure detection). Kicks coalesce: any
number of kicks while a tick runs cause one more tick, and kicked ticks are spaced by at
least ``kick_gap_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from uuid import UUID

from haru_db import StateStore, StateStoreUnavailableError

from haru_server._errors import ClockSkewedError, FleetNotFoundError, SchemaNewerError
from haru_server._reconciler import Accepted, Reconciler

logger = logging.getLogger(__name__)

STALE_GRACE_S = 10.0
"""Slack (a slow store call, a busy event loop) before a silent loop counts as stalled."""


@dataclass(frozen=True, slots=True)
class LoopOptions:
    """Timing of the background loop.

    Attributes:
        interval_s: Pause between ticks of an idle fleet (``HARU_RECONCILE_INTERVAL_MS``).
        busy_interval_s: Pause between ticks while an operation is in flight, or while a
            dead active is being confirmed (fresh heartbeats, not the next regular tick).
        kick_gap_s: Shortest spacing between the start of a tick and a kicked tick.
        fleets: Fleet references to reconcile; None = every fleet in the store.
        stop_grace_s: At stop, how long running ticks may finish before they are cancelled.
        repeat_warning_s: While a fleet's ticks keep failing for the same reason, how often
            the warning is repeated (with how long it has lasted); a new reason is logged at
            once.
    """

    interval_s: float
    busy_interval_s: float = 0.15
    kick_gap_s: float = 0.05
    fleets: tuple[str, ...] | None = None
    stop_grace_s: float = 5.0
    repeat_warning_s: float = 10.0


class _Worker:
    def __init__(self, fleet_id: UUID) -> None:
        self.fleet_id = fleet_id
        self.wake = asyncio.Event()
        self.start: Accepted | None = None
        """The operation the latest kick brought, for the next kicked tick to start."""
        self.task: asyncio.Task[None] | None = None


class ReconcileLoop:
    """Reconciles fleets in the background until :meth:`stop`.

    Args:
        reconciler: Runs the ticks.
        store: Lists fleets (discovery) and resolves configured references.
        options: Timing and the fleets to reconcile.
    """

    def __init__(self, reconciler: Reconciler, store: StateStore, options: LoopOptions) -> None:
        self._reconciler = reconciler
        self._store = store
        self._options = options
        self._workers: dict[UUID, _Worker] = {}
        self._discover = asyncio.Event()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._missing: set[str] = set()
        self._store_down = False
        self._last_pass: float | None = None

    @property
    def fleet_ids(self) -> frozenset[UUID]:
        """Fleets that currently have a worker."""
        return frozenset(self._workers)

    @property
    def fleet_refs(self) -> tuple[str, ...] | None:
        """The configured fleet references (``HARU_RECONCILE_FLEETS``); None = every fleet."""
        return self._options.fleets

    async def covers(self, fleet_id: UUID) -> bool:
        """Whether this loop drives ``fleet_id`` (resolving the configured references now).

        Raises:
            haru_db.StateStoreUnavailableError: The store failed while resolving them.
        """
        refs = self._options.fleets
        if refs is None or fleet_id in self._workers:
            return True
        for ref in refs:
            pointer = await self._store.get_fleet_route_pointer(ref)
            if pointer is not None and pointer.id == fleet_id:
                return True
        return False

    @property
    def stale_after_s(self) -> float:
        """How long without a discovery pass before :meth:`stalled` reports the loop."""
        return 3 * self._options.interval_s + STALE_GRACE_S

    def stalled(self, now: float) -> str | None:
        """Why the loop is not ticking at ``now`` (``time.monotonic()``), or None when it is.

        The loop ticks when its task runs and its last discovery pass (one per interval, or
        at a kick) ended less than :attr:`stale_after_s` ago.
        """
        if self._task is None or self._task.done():
            return "the reconcile loop is not running"
        if self._last_pass is None:
            return "the reconcile loop has not completed its first pass"
        silent = now - self._last_pass
        if silent > self.stale_after_s:
            return f"the reconcile loop has not ticked for {silent:.0f} s"
        return None

    def start(self) -> None:
        """Start the discovery task (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="haru-reconcile-loop")

    async def stop(self) -> None:
        """Stop discovery and every worker.

        Workers finish the tick they are in (bounded by ``stop_grace_s``, then cancelled), so
        a stop never abandons a tick between its statements when it can avoid it.
        """
        self._stopping.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        workers = [w.task for w in self._workers.values() if w.task is not None]
        self._workers.clear()
        if not workers:
            return
        _, pending = await asyncio.wait(workers, timeout=self._options.stop_grace_s)
        for worker in pending:
            worker.cancel()
        for worker in workers:
            with contextlib.suppress(asyncio.CancelledError):
                await worker

    def kick_pending(self, fleet_id: UUID) -> bool:
        """Whether a kick of ``fleet_id`` waits for its worker's next tick.

        A tick clears the kicks that came before it started; every kick during it is one more
        tick, however many there were.
        """
        worker = self._workers.get(fleet_id)
        return worker is not None and worker.wake.is_set()

    def kick(self, fleet_id: UUID, *, start: Accepted | None = None) -> None:
        """Ask for a tick of ``fleet_id`` now; never blocks, coalesces repeated kicks.

        ``start``: the operation a request just created (with the snapshot it was validated
        on), which the kicked tick starts without reading the fleet again.
        """
        worker = self._workers.get(fleet_id)
        if worker is not None:
            if start is not None:
                worker.start = start
            worker.wake.set()
        else:
            # A fleet seeded since the last discovery: find it now.
            self._discover.set()

    # ---- discovery ---------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping.is_set():
            self._discover.clear()
            await self._discover_fleets()
            self._last_pass = time.monotonic()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._options.interval_s):
                    await self._discover.wait()

    async def _fleet_ids(self) -> list[UUID]:
        refs = self._options.fleets
        if refs is None:
            return [pointer.id for pointer in await self._store.list_fleets()]
        ids: list[UUID] = []
        for ref in refs:
            pointer = await self._store.get_fleet_route_pointer(ref)
            if pointer is None:
                if ref not in self._missing:
                    self._missing.add(ref)
                    logger.warning("reconcile loop: fleet %r is not in the store (yet)", ref)
                continue
            self._missing.discard(ref)
            ids.append(pointer.id)
        return ids

    async def _discover_fleets(self) -> None:
        try:
            fleet_ids = await self._fleet_ids()
        except StateStoreUnavailableError as exc:
            if not self._store_down:
                self._store_down = True
                logger.warning("reconcile loop: state store unavailable: %s", exc)
            return
        if self._store_down:
            self._store_down = False
            logger.info("reconcile loop: state store reachable again")
        for fleet_id in fleet_ids:
            if fleet_id not in self._workers:
                worker = _Worker(fleet_id)
                self._workers[fleet_id] = worker
                worker.task = asyncio.create_task(
                    self._work(worker), name=f"haru-reconcile-{fleet_id}"
                )

    # ---- one fleet ---------------------------------------------------------------------------

    async def _work(self, worker: _Worker) -> None:
        options = self._options
        ref = str(worker.fleet_id)
        failing: str | None = None
        failing_since = warned_at = 0.0
        while not self._stopping.is_set():
            kicked = worker.wake.is_set()
            worker.wake.clear()
            start, worker.start = worker.start, None
            started = time.monotonic()
            delay = options.interval_s
            try:
                result = await self._reconciler.tick(ref, pending_first=kicked, start=start)
            except FleetNotFoundError:
                logger.info("reconcile loop: fleet %s is gone; its worker stops", ref)
                self._workers.pop(worker.fleet_id, None)
                return
            except (ClockSkewedError, SchemaNewerError) as exc:
                # The gate logged why (the clock's also recorded an event); the loop keeps
                # polling it: a clock back in bounds, or a store downgraded, resumes.
                if failing is None:
                    failing_since = time.monotonic()
                failing = "clock skewed" if isinstance(exc, ClockSkewedError) else "schema newer"
            except StateStoreUnavailableError as exc:
                message = f"state store unavailable: {exc}"
                now = time.monotonic()
                if failing != message:
                    logger.warning("reconcile of fleet %s: %s", ref, message)
                    if failing is None:
                        failing_since = now
                    warned_at = now
                elif now - warned_at >= options.repeat_warning_s:
                    # A persisting failure stays visible in the log, not one line at its start.
                    logger.warning(
                        "reconcile of fleet %s: no tick succeeded for %.0f s: %s",
                        ref,
                        now - failing_since,
                        message,
                    )
                    warned_at = now
                failing = message
            except Exception:  # one bad tick must not end this fleet's loop
                logger.exception("reconcile of fleet %s failed", ref)
                if failing is None:
                    failing_since = time.monotonic()
                failing = "unexpected failure"
            else:
                if failing is not None:
                    logger.info(
                        "reconcile of fleet %s recovered after %.1f s",
                        ref,
                        time.monotonic() - failing_since,
                    )
                    failing = None
                if result.in_flight or result.confirming:
                    delay = options.busy_interval_s
            await self._pause(worker, started, delay)

    async def _pause(self, worker: _Worker, started: float, delay: float) -> None:
        if self._stopping.is_set():
            return
        stop = asyncio.ensure_future(self._stopping.wait())
        wake = asyncio.ensure_future(worker.wake.wait())
        try:
            await asyncio.wait(
                (stop, wake),
                timeout=max(0.0, started + delay - time.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            stop.cancel()
            wake.cancel()
        gap = started + self._options.kick_gap_s - time.monotonic()
        if gap > 0 and not self._stopping.is_set():
            await asyncio.sleep(gap)
