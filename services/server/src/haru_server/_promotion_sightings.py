"""Promotions in flight as this process saw them: on its pointer reads, or accepted by itself.

The pointer read carries only whether a promotion is in flight, so the moment this process
first saw one is the earliest it can vouch for: the operation started at or before it, and its
step budgets run out no later than that plus their sum (the proxy's hold uses it).
"""

from __future__ import annotations

from collections.abc import Callable
from uuid import UUID


class PromotionSightings:
    """Fleet id -> (number of the newest read, monotonic reading of the first sighting or None).

    Args:
        max_fleets: Past four times this many fleets, only the ``keep`` ones are remembered.
        monotonic: Monotonic seconds.
    """

    def __init__(self, *, max_fleets: int, monotonic: Callable[[], float]) -> None:
        self._max = 4 * max_fleets
        self._monotonic = monotonic
        self._seen: dict[UUID, tuple[int, float | None]] = {}

    def since(self, fleet_id: UUID) -> float | None:
        """Monotonic reading at which the promotion now in flight was first seen, or None.

        A promotion that ends and another that starts between two reads look like one (the
        earlier sighting stays).
        """
        known = self._seen.get(fleet_id)
        return None if known is None else known[1]

    def note(
        self, fleet_id: UUID, seq: int, *, in_flight: bool, keep: Callable[[UUID], bool]
    ) -> None:
        """Read number ``seq`` saw a promotion of ``fleet_id`` in flight (or none)."""
        known = self._seen.get(fleet_id)
        if known is not None and known[0] > seq:
            return  # an older read finishing late (another spelling's) teaches nothing
        since = None
        if in_flight:
            since = known[1] if known is not None and known[1] is not None else self._monotonic()
        self._seen[fleet_id] = (seq, since)
        if len(self._seen) > self._max:
            self._seen = {k: v for k, v in self._seen.items() if keep(k) or k == fleet_id}
