"""The proxy's refused upstream connects, recorded in the store for every replica to see.

When the proxy cannot connect to the active domain's serving endpoint (refused, or no route),
it stamps ``domains.connect_failed_at``: every server process's reconcile tick reads it with
the fleet, polls the domain's supervisor again at once, and cites it as corroboration of the
domain's loss (never as proof on its own). The stamp is written off the request path: a
bounded background task, at most one per domain per ``interval_s`` in this process, and at
most ``max_pending`` at once (more are dropped: the next second brings another).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from uuid import UUID

from haru_db import StateStore, StateStoreUnavailableError

from haru_server._clock import Clock
from haru_server._metrics import ServerMetrics

logger = logging.getLogger(__name__)

STAMP_INTERVAL_S = 1.0
"""At most one stamp per domain per this many seconds, per process."""

STAMP_TIMEOUT_S = 2.0
"""Bound of one stamp's store write."""

MAX_PENDING_STAMPS = 16
"""Stamp writes in flight at once; more are dropped."""


class ConnectStamps:
    """Records refused upstream connects per domain, rate-limited, off the request path."""

    def __init__(
        self,
        store: StateStore,
        clock: Clock,
        *,
        metrics: ServerMetrics | None,
        interval_s: float = STAMP_INTERVAL_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._clock = clock
        self._metrics = metrics
        self._interval = interval_s
        self._mono = monotonic
        self._last: dict[UUID, float] = {}
        self._pending: set[asyncio.Task[None]] = set()

    def __call__(self, fleet: str, domain_id: UUID) -> bool:
        """Stamp ``domain_id`` unless it was stamped within the interval; never blocks.

        Returns:
            True when a write was started.
        """
        now = self._mono()
        last = self._last.get(domain_id)
        if last is not None and now - last < self._interval:
            return False
        if len(self._pending) >= MAX_PENDING_STAMPS:
            return False
        self._last[domain_id] = now
        task = asyncio.create_task(self._write(fleet, domain_id), name="connect-failed-stamp")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return True

    async def _write(self, fleet: str, domain_id: UUID) -> None:
        try:
            async with asyncio.timeout(STAMP_TIMEOUT_S):
                await self._store.record_connect_failed(domain_id, at=self._clock())
        except (StateStoreUnavailableError, TimeoutError) as exc:
            logger.debug("fleet %s: connect failure of %s not recorded: %s", fleet, domain_id, exc)
            return
        if self._metrics is not None:
            self._metrics.connect_failed_stamped(fleet)

    async def aclose(self) -> None:
        """Wait for the stamps in flight (each is bounded), so none outlives the app."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
