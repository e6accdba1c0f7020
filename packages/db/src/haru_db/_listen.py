"""Route pointer notifications: one dedicated PostgreSQL connection LISTENing for pointer moves.

Migration 0002 makes every pointer move ``NOTIFY haru_route`` in the compare-and-swap's own
transaction. :class:`RouteListener` keeps one autocommit psycopg connection (outside the
engine's pool: a LISTEN belongs to its session) and hands each notification's pointer to a
callback. When the connection fails it reconnects with exponential backoff; notifications sent
while it was down are lost, which is why it is only an accelerator: the route lease's polling
keeps running whatever the listener does, and bounds how long a missed move can go unseen.
SQLite has no NOTIFY: :meth:`RouteListener.run` returns at once there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from haru_protocol import FleetRoutePointer
from sqlalchemy.engine import make_url

from haru_db._urls import dialect_of, redact_database_url, secrets_of

logger = logging.getLogger(__name__)

ROUTE_CHANNEL: Final = "haru_route"
"""The NOTIFY channel of pointer moves (see migration 0002)."""

_CONNECT_TIMEOUT_S: Final = 10


class RouteListener:
    """Delivers every committed pointer move to ``on_move`` while :meth:`run` runs.

    Args:
        url: A resolved database URL (:func:`haru_db.resolve_database_url`).
        on_move: Called in the event loop with each moved pointer (must not block).
        on_connect: Called after each (re)connection has started listening: moves committed
            while the listener was down were missed, so a caller may re-confirm what it holds.
        min_backoff_s: First pause before a reconnection; it doubles up to ``max_backoff_s``.
        max_backoff_s: Longest pause between reconnections.
    """

    def __init__(
        self,
        url: str,
        on_move: Callable[[FleetRoutePointer], None],
        *,
        on_connect: Callable[[], None] | None = None,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
    ) -> None:
        self._url = url
        self._on_move = on_move
        self._on_connect = on_connect
        self._min_backoff = min_backoff_s
        self._max_backoff = max_backoff_s
        self.connected = asyncio.Event()
        """Set while the connection is listening (tests and diagnostics)."""
        self.notifications = 0
        """Pointer moves delivered so far."""

    @property
    def supported(self) -> bool:
        """Whether the database can notify at all (PostgreSQL)."""
        return dialect_of(self._url) == "postgresql"

    async def run(self) -> None:
        """Listen until cancelled, reconnecting with backoff; returns at once on SQLite."""
        if not self.supported:
            return
        # Imported here: a SQLite server never loads the PostgreSQL driver (about 8 MiB).
        import psycopg

        conninfo = (
            make_url(self._url).set(drivername="postgresql").render_as_string(hide_password=False)
        )
        backoff = self._min_backoff
        while True:
            try:
                await self._listen(conninfo)
                # _listen only returns when the server ended the notification stream.
                logger.warning("route listener: connection closed by the server; reconnecting")
            except (psycopg.Error, OSError) as exc:
                logger.warning(
                    "route listener: %s (%s); lease polling carries on, retrying in %.1f s",
                    self._scrub(str(exc)).strip() or type(exc).__name__,
                    redact_database_url(self._url),
                    backoff,
                )
            if self.connected.is_set():
                backoff = self._min_backoff  # it was up: start the backoff over
            self.connected.clear()
            await asyncio.sleep(backoff)
            backoff = min(self._max_backoff, backoff * 2)

    async def _listen(self, conninfo: str) -> None:
        import psycopg

        conn = await psycopg.AsyncConnection.connect(
            conninfo,
            autocommit=True,
            connect_timeout=_CONNECT_TIMEOUT_S,
            application_name="haru-route-listener",
        )
        async with conn:
            await conn.execute(f"LISTEN {ROUTE_CHANNEL}")
            self.connected.set()
            logger.info("route listener: listening for pointer moves")
            if self._on_connect is not None:
                self._on_connect()
            async for notify in conn.notifies():
                self._deliver(notify.payload)

    def _deliver(self, payload: str) -> None:
        try:
            pointer = FleetRoutePointer.model_validate_json(payload)
        except ValueError as exc:  # pydantic's ValidationError
            logger.error(  # noqa: TRY400  # the message says it all; no traceback
                "route listener: ignoring a malformed notification: %s", exc
            )
            return
        self.notifications += 1
        self._on_move(pointer)

    def _scrub(self, text: str) -> str:
        for secret in secrets_of(self._url):
            text = text.replace(secret, "***")
        return text
