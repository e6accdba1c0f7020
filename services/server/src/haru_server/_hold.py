"""Holding requests through a failover until the route moves (DESIGN 7.5).

A request that no server answered and of which nothing went to the client waits here, while
the fleet has ``autoFailover`` on or a promotion in flight, for the pointer to move; then it
is routed again. One releaser task per fleet lets its held requests go in arrival order. The
bound is ``HARU_FAILOVER_HOLD_MS`` (plus a promotion's step budgets up to the flip while one is
in flight), and at most ``HARU_FAILOVER_HOLD_MAX`` requests are held per process, never more
than half the connection cap. A request that reached an upstream is sent again at most once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from uuid import UUID

import aiohttp
from aiohttp import web
from haru_protocol import ErrorCode, Policy
from haru_web import ApiError, connection_cap

from haru_server._metrics import metrics_key
from haru_server._proxy_errors import UnansweredError, retry_headers, with_held
from haru_server._proxy_routes import RouteTable, promotion_budget_ms
from haru_server._route_cache import RouteCache
from haru_server._route_entries import RouteLookup
from haru_server._route_http import resolve_route

logger = logging.getLogger(__name__)

Attempt = Callable[[], Awaitable[tuple[RouteLookup[RouteTable], aiohttp.ClientResponse]]]
"""One try at routing a request and opening its upstream."""


@dataclass(slots=True, eq=False)
class _HeldItem:
    released: asyncio.Future[bool]
    revision: int
    unroutable: bool
    model: str
    fleet_id: UUID
    started: float
    """Clock reading at which the request was first held."""
    policy: Policy
    """The fleet's policy as last read (its promotion budgets bound the hold)."""
    deadline: float = 0.0
    timer: asyncio.TimerHandle | None = None


def _settle_held(future: asyncio.Future[bool], released: bool) -> None:
    if not future.done():
        future.set_result(released)


def held_cap(configured: int, max_connections: int) -> int:
    """Requests one process holds at once: ``configured``, at most half the connection cap.

    A held request keeps its client's connection open; past the listener's cap new
    connections are refused, health checks and the control API included. Half the cap (as
    lowered to fit the open-file limit) always stays for them and for requests being served.
    """
    return min(configured, connection_cap(max_connections) // 2)


class FailoverHold:
    """The requests of one process held for a failover, per fleet, and their releasers."""

    def __init__(
        self,
        cache: RouteCache[RouteTable],
        *,
        hold_s: float,
        hold_max: int,
        poll_s: float,
        monotonic: Callable[[], float],
    ) -> None:
        self.cache = cache
        self._hold = hold_s
        self.hold_max = hold_max
        """Requests held at once: ``HARU_FAILOVER_HOLD_MAX``, at most half the connection cap."""
        self._hold_poll = poll_s
        self._mono = monotonic
        self.holding = 0
        """Requests held right now."""
        self.over_cap = 0
        """Requests failed at once because ``hold_max`` requests were held already."""
        self._held: dict[UUID, list[_HeldItem]] = {}
        self._releasers: dict[UUID, asyncio.Task[None]] = {}

    async def dispatch(
        self, request: web.Request, ref: str, model: str, attempt: Attempt
    ) -> tuple[RouteLookup[RouteTable], aiohttp.ClientResponse, int | None]:
        """Open the upstream answer, holding the request through a failover when allowed.

        ``attempt`` routes the request and opens its upstream once (raising
        :class:`UnansweredError` when it may be held); it is called again after each release.

        A request reaches at most two upstreams: one that went away without answering
        (:attr:`UnansweredError.reached`) is sent again only after the route moved, once.
        """
        try:
            lookup, upstream = await attempt()
        except UnansweredError as exc:
            if not self._may_hold(exc.lookup):
                raise exc.error from None
            if self.holding >= self.hold_max:
                request.app[metrics_key].hold_refused(exc.lookup.routes.fleet_slug)
                raise self._over_cap(exc) from None
            failed = exc
        else:
            return lookup, upstream, None
        # Held: no server answered and nothing was sent to the client, so it may go to the
        # next active.
        reached = failed.reached
        self.holding += 1
        started = self._mono()
        try:
            while True:
                if not await self._held_until_release(ref, model, failed, started):
                    raise with_held(failed.error, started, self._mono()) from None
                try:
                    lookup, upstream = await attempt()
                except UnansweredError as exc:
                    if exc.reached and reached:
                        # Twice sent, twice unanswered: never a third time.
                        raise with_held(exc.error, started, self._mono()) from None
                    reached = reached or exc.reached
                    failed = exc
                    continue
                held_ms = int((self._mono() - started) * 1000)
                request.app[metrics_key].request_held(
                    lookup.routes.fleet_slug, retried=bool(reached)
                )
                return lookup, upstream, held_ms
        finally:
            self.holding -= 1

    def _over_cap(self, failed: UnansweredError) -> ApiError:
        self.over_cap += 1
        if self.over_cap == 1 or self.over_cap % 1000 == 0:  # one line per burst, not per request
            logger.warning(
                "fleet %s: %d requests already held (HARU_FAILOVER_HOLD_MAX); failing more at "
                "once with 503 (%d so far)",
                failed.lookup.routes.fleet_slug,
                self.holding,
                self.over_cap,
            )
        return ApiError(
            ErrorCode.OVERLOADED,
            f"{self.holding} requests are already held for a failover in this process "
            "(HARU_FAILOVER_HOLD_MAX); retry shortly",
            headers=retry_headers(failed.lookup),
        )

    def hold_deadline(self, fleet_id: UUID, started: float, policy: Policy) -> float:
        """When a request of ``fleet_id`` held since ``started`` gives up (monotonic seconds).

        ``HARU_FAILOVER_HOLD_MS`` after it was held; while a promotion is in flight, no sooner
        than that promotion's step budgets up to the flip (counted from when this process
        first saw it in flight) plus ``HARU_FAILOVER_HOLD_MS`` for the flip to reach it.
        """
        deadline = started + self._hold
        since = self.cache.promotion_since(fleet_id)
        if since is not None:
            deadline = max(deadline, since + promotion_budget_ms(policy) / 1000 + self._hold)
        return deadline

    def _arm(self, item: _HeldItem) -> None:
        """(Re)arm the timer that gives ``item`` up at its deadline, which may have moved."""
        if item.released.done():
            return
        deadline = self.hold_deadline(item.fleet_id, item.started, item.policy)
        if item.timer is not None and deadline == item.deadline:
            return
        now = self._mono()
        if now >= deadline:
            _settle_held(item.released, False)
            return
        if item.timer is not None:
            item.timer.cancel()
        item.deadline = deadline
        item.timer = asyncio.get_running_loop().call_later(deadline - now, self._expire, item)

    def _expire(self, item: _HeldItem) -> None:
        item.timer = None
        self._arm(item)

    async def _held_until_release(
        self, ref: str, model: str, failed: UnansweredError, started: float
    ) -> bool:
        """Queue behind the fleet's earlier held requests until the releaser lets this one go.

        One releaser task per fleet watches for the move and releases waiters in arrival
        order (their futures resolve in order, so they dispatch in order). False: the bound
        (:meth:`hold_deadline`) ran out first.
        """
        loop = asyncio.get_running_loop()
        fleet_id = failed.lookup.fleet_id
        routes = failed.lookup.routes
        item = _HeldItem(
            loop.create_future(),
            failed.lookup.snapshot.route_revision,
            # An upstream that went away (refused, or took the request and vanished) is only
            # left behind by a move; a missing route or slot may also come back in place.
            unroutable=not routes.routable or routes.unserved(model),
            model=model,
            fleet_id=fleet_id,
            started=started,
            policy=failed.lookup.snapshot.policy,
        )
        queue = self._held.setdefault(fleet_id, [])
        queue.append(item)
        if fleet_id not in self._releasers:
            self._releasers[fleet_id] = loop.create_task(self._release(ref, fleet_id))
        self._arm(item)
        try:
            return await item.released
        finally:
            if item.timer is not None:
                item.timer.cancel()
            if item in queue:
                queue.remove(item)

    async def _release(self, ref: str, fleet_id: UUID) -> None:
        """Release held requests of one fleet, in arrival order, once they can be served."""
        try:
            while queue := self._held.get(fleet_id):
                revision = min(item.revision for item in queue)
                await self.cache.wait_moved(fleet_id, revision, self._hold_poll)
                try:
                    lookup = await resolve_route(self.cache, ref)
                except ApiError:
                    continue
                now_revision = lookup.snapshot.route_revision
                # Held only for a promotion (no autoFailover) that ended without moving the
                # pointer: nothing will move it now, so the held requests fail at once.
                hopeless = not self._holds_for(lookup)
                for item in list(queue):
                    routes = lookup.routes
                    servable = routes.routable and not routes.unserved(item.model)
                    if now_revision > item.revision or (item.unroutable and servable):
                        queue.remove(item)
                        _settle_held(item.released, True)
                    elif hopeless:
                        queue.remove(item)
                        _settle_held(item.released, False)
                    else:
                        # A promotion that started, or ended, moves the bound.
                        item.policy = lookup.snapshot.policy
                        self._arm(item)
        finally:
            self._releasers.pop(fleet_id, None)
            if not self._held.get(fleet_id):
                self._held.pop(fleet_id, None)

    @property
    def releasers(self) -> list[asyncio.Task[None]]:
        return list(self._releasers.values())

    def _holds_for(self, lookup: RouteLookup[RouteTable]) -> bool:
        """Whether a failover may be coming: ``autoFailover`` on, or a promotion in flight."""
        return lookup.snapshot.policy.auto_failover or self.cache.promotion_in_flight(
            lookup.fleet_id
        )

    def _may_hold(self, lookup: RouteLookup[RouteTable]) -> bool:
        return self._hold > 0 and self.hold_max > 0 and self._holds_for(lookup)
