"""Fencing: refuse state-changing calls from a server process that lost its operation step.

Several ``haru serve`` processes may drive one fleet; each operation write in their store
raises the fleet's fencing token, and a process sends the token of the step it acts for in
``X-Haru-Fence``. This book keeps the highest token seen per fleet and refuses (``409
stale_fence``) a state-changing call with a lower one: its sender stalled past another
process's write (a paused process, a slow network) and must not act any more.

The book lives in memory: a restarted supervisor accepts the first token it sees for a fleet
(the server's next write raises the token anyway). A call without the header (an operator's
own call) is accepted and logged (``_routes.admit_fence``).
"""

from __future__ import annotations

from typing import Final
from uuid import UUID

from cachetools import LRUCache
from haru_protocol import SupervisorFence

MAX_FLEETS: Final = 64
"""Fleets whose highest token is kept; the least recently fenced one is forgotten beyond it
(a supervisor serves the domains of one or a few fleets)."""


class FenceBook:
    """The highest fencing token seen per fleet."""

    def __init__(self, *, capacity: int = MAX_FLEETS) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._highest: LRUCache[UUID, int] = LRUCache(maxsize=capacity)

    def highest(self, fleet_id: UUID) -> int | None:
        """The highest token seen for ``fleet_id`` (None: none yet)."""
        return self._highest.get(fleet_id)

    def admit(self, fence: SupervisorFence) -> int | None:
        """Record ``fence`` unless a higher token was seen for its fleet.

        Synchronous (no await), so two calls cannot interleave between check and record.

        Returns:
            None when admitted (equal to the highest is admitted: several processes may act
            for the same step); otherwise the higher token that refuses it.
        """
        seen = self._highest.get(fence.fleet_id)
        if seen is not None and fence.token < seen:
            return seen
        # The least recently used fleet is evicted past the capacity.
        self._highest[fence.fleet_id] = fence.token
        return None
