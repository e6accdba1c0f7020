"""The route cache's failure state: is the store unreachable, which fleets are served stale.

Both are transitions logged once (per process, per fleet), not once per request. After a failed
pointer read the outage memo lets requests serve stale without asking the store for a while,
one probe at a time afterwards, so an outage costs one bounded wait per memo, not one per
request (DESIGN 7.5).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from uuid import UUID

logger = logging.getLogger("haru_server._route_cache")


class StoreOutage:
    """Whether the last pointer read failed, and how long to skip reading because of it.

    Args:
        memo_s: After a failed read, serve stale without reading for this long.
        monotonic: Monotonic seconds.
    """

    def __init__(self, *, memo_s: float, monotonic: Callable[[], float]) -> None:
        self._memo = memo_s
        self._monotonic = monotonic
        self._active = False
        self._until = 0.0
        self.probing = False
        """A read that may end the outage is in flight (the others keep serving stale)."""

    @property
    def active(self) -> bool:
        """Whether the last pointer read failed (and none has succeeded since)."""
        return self._active

    def memo_running(self) -> bool:
        """Whether a read failed less than the memo ago."""
        return self._monotonic() < self._until

    def enter(self, exc: BaseException) -> None:
        """A pointer read failed for want of the store."""
        self._until = self._monotonic() + self._memo
        if not self._active:
            self._active = True
            logger.warning("route cache: state store unreachable (%s); failing open", exc)

    def leave(self) -> None:
        """A pointer read was answered."""
        if self._active:
            self._active = False
            logger.info("route cache: state store reachable again")


class StaleFleets:
    """The fleets this process serves with routing the store has not confirmed."""

    def __init__(self) -> None:
        self._stale: set[UUID] = set()

    def enter(self, fleet_id: UUID, slug: str, revision: int, why: str) -> None:
        """``fleet_id`` is served stale at ``revision`` because of ``why``."""
        if fleet_id not in self._stale:
            self._stale.add(fleet_id)
            logger.warning(
                "fleet %s (%s): serving cached routing at revision %d (stale): %s",
                slug,
                fleet_id,
                revision,
                why,
            )

    def leave(self, fleet_id: UUID, slug: str, revision: int) -> None:
        """The store confirmed ``fleet_id``'s routing at ``revision`` again."""
        if fleet_id in self._stale:
            self._stale.discard(fleet_id)
            logger.info(
                "fleet %s (%s): routing confirmed by the state store again (revision %d)",
                slug,
                fleet_id,
                revision,
            )

    def drop(self, fleet_id: UUID, slug: str) -> None:
        """``fleet_id``'s cache entry is gone: it is no longer served at all."""
        if fleet_id in self._stale:
            self._stale.discard(fleet_id)
            logger.warning(
                "fleet %s (%s): no longer serving stale routing (entry dropped)", slug, fleet_id
            )
