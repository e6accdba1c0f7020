"""Small asyncio helpers of the inference proxy: a disconnect watch and a kick debouncer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Protocol
from uuid import UUID

from aiohttp import web


class ClientGoneError(Exception):
    """The client closed its connection while its request was being served."""


class DisconnectWatch:
    """Cancels the serving task when the client's connection closes.

    aiohttp leaves a handler running after its client disconnected (unless the server runs
    with ``handler_cancellation``), so without this a request waiting for upstream headers
    would keep the upstream generating for nobody. The check is a timer callback, free when
    nothing happens; a cancel it caused surfaces as :class:`ClientGoneError`.
    """

    __slots__ = ("_handle", "_interval", "_loop", "_request", "_task", "fired")

    def __init__(self, request: web.BaseRequest, interval_s: float) -> None:
        self._request = request
        self._interval = interval_s
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - handlers always run in a task
            raise RuntimeError("a disconnect watch needs a running task")
        self._task = task
        self._handle: asyncio.TimerHandle | None = None
        self.fired = False

    def _check(self) -> None:
        transport = self._request.transport
        if transport is None or transport.is_closing():
            self.fired = True
            self._handle = None
            self._task.cancel()
        else:
            self._handle = self._loop.call_later(self._interval, self._check)

    async def __aenter__(self) -> DisconnectWatch:
        self._handle = self._loop.call_later(self._interval, self._check)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        # Our own cancel is swallowed, unless someone else cancelled the task as well.
        if (
            self.fired
            and exc_type is not None
            and issubclass(exc_type, asyncio.CancelledError)
            and self._task.uncancel() == 0
        ):
            raise ClientGoneError from exc


class FleetKicker(Protocol):
    """Whom the proxy asks for a reconcile of a fleet now (the control plane, in the server)."""

    def kick(self, fleet_id: UUID) -> None:
        """Reconcile ``fleet_id`` soon (debounced by the receiver; never blocks)."""


class KickDebouncer:
    """Asks for an out-of-band reconcile at most once per interval per fleet."""

    __slots__ = ("_clock", "_interval", "_kicker", "_last")

    def __init__(
        self, kicker: FleetKicker | None, *, interval_s: float, clock: Callable[[], float]
    ) -> None:
        self._kicker = kicker
        self._interval = interval_s
        self._clock = clock
        self._last: dict[UUID, float] = {}

    def __call__(self, fleet_id: UUID) -> bool:
        """Kick ``fleet_id`` unless it was kicked within the interval; True when it kicked."""
        if self._kicker is None:
            return False
        now = self._clock()
        last = self._last.get(fleet_id)
        if last is not None and now - last < self._interval:
            return False
        self._last[fleet_id] = now
        if len(self._last) > 1024:
            self._last = {k: t for k, t in self._last.items() if now - t < self._interval}
        self._kicker.kick(fleet_id)
        return True
