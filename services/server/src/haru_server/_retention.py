"""The periodic retention prune (``HARU_RETENTION_DAYS``): a background task of each process.

Once at start-up and then every :data:`PRUNE_INTERVAL_S`, it deletes what
:meth:`haru_db.StateStore.prune_history` allows: finished operations and events older than the
retention, by the app clock. A run is bounded (:data:`PRUNE_MAX_BATCHES` statements of
:data:`haru_db.DEFAULT_PRUNE_BATCH` rows); a backlog is worked off over the following runs.
It never runs on a request's path, and a failure only delays it to the next run. Several
processes may prune at once: each statement deletes whatever rows are still there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import timedelta

from haru_db import HaruDbError, PruneCounts, StateStore

from haru_server._clock import Clock
from haru_server._metrics import ServerMetrics

logger = logging.getLogger(__name__)

PRUNE_INTERVAL_S = 3600.0
"""Pause between two prunes of one process."""

PRUNE_MAX_BATCHES = 20
"""Delete statements one run may take (each of at most ``DEFAULT_PRUNE_BATCH`` rows)."""

STOP_GRACE_S = 5.0
"""At stop, how long a run in progress may finish before it is cancelled."""


class Pruner:
    """Prunes the store every ``interval_s`` until :meth:`stop`.

    Args:
        store: The state store.
        clock: The app clock; the cutoff is its time minus ``retention``.
        retention: How long finished operations and events are kept.
        metrics: Counts the deleted rows (``haru_pruned_rows_total``).
    """

    def __init__(
        self,
        store: StateStore,
        clock: Clock,
        *,
        retention: timedelta,
        metrics: ServerMetrics,
        interval_s: float = PRUNE_INTERVAL_S,
        max_batches: int = PRUNE_MAX_BATCHES,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        if retention <= timedelta(0):
            raise ValueError("retention must be positive")
        self._store = store
        self._clock = clock
        self._retention = retention
        self._metrics = metrics
        self._interval_s = interval_s
        self._max_batches = max_batches
        self._stop_grace_s = stop_grace_s
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the background task (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="haru-retention")

    async def stop(self) -> None:
        """Stop the task; a run in progress finishes first (bounded by ``stop_grace_s``).

        Cancelling a statement mid-way would cost its pooled connection; past the grace it is
        cancelled anyway (each statement commits whole or not at all).
        """
        self._stopping.set()
        task, self._task = self._task, None
        if task is None:
            return
        _, pending = await asyncio.wait((task,), timeout=self._stop_grace_s)
        if pending:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def run_once(self) -> PruneCounts | None:
        """One bounded prune; None when the store failed (logged, tried again next run)."""
        before = self._clock() - self._retention
        try:
            counts = await self._store.prune_history(before=before, max_batches=self._max_batches)
        except HaruDbError as exc:
            logger.warning(
                "retention: prune failed, tried again in %.0f s: %s", self._interval_s, exc
            )
            return None
        self._metrics.pruned(events=counts.events, operations=counts.operations)
        if counts.events or counts.operations:
            logger.info(
                "retention: pruned %d event(s) and %d finished operation(s) older than %s",
                counts.events,
                counts.operations,
                before.isoformat(timespec="seconds"),
            )
        else:
            logger.debug("retention: nothing older than %s to prune", before.isoformat())
        return counts

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.run_once()
            except Exception:  # one bad run must not end the task
                logger.exception("retention: prune failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await self._stopping.wait()
