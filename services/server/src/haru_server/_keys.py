"""Typed application keys: every piece of app state lives behind one of these."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol
from uuid import UUID

from aiohttp import web
from haru_db import StateStore
from haru_web import TokenSource

from haru_server._clock import Clock as Clock
from haru_server._clock import StoreClock
from haru_server._loop import ReconcileLoop
from haru_server._provisioning import Provisioner
from haru_server._reconciler import Accepted, Reconciler
from haru_server._schema_gate import SchemaGate
from haru_server._settings import Settings


class FleetKicker(Protocol):
    """Asks the background loop to reconcile one fleet now (debounced; never blocks)."""

    def __call__(self, fleet_id: UUID, *, accepted: Accepted | None = None) -> None:
        """Kick ``fleet_id``; ``accepted``: the operation a request just created."""


settings_key = web.AppKey("settings", Settings)
store_key = web.AppKey("store", StateStore)
clock_key: web.AppKey[Clock] = web.AppKey("clock")
store_clock_key: web.AppKey[StoreClock | None] = web.AppKey("store_clock")
api_token_key: web.AppKey[TokenSource | None] = web.AppKey("api_token")
"""``HARU_API_TOKEN`` as each request asks it (follows ``HARU_API_TOKEN_FILE``)."""
"""The database-clock sampler behind ``clock_key``; None when a clock was injected."""
kick_fleet_key: web.AppKey[FleetKicker] = web.AppKey("kick_fleet")
reconciler_key = web.AppKey("reconciler", Reconciler)
"""Runs reconcile ticks (set at start-up, once the supervisor client session exists)."""
draining_key = web.AppKey("draining", asyncio.Event)
"""Set once a stop signal came and the server drains (``/readyz`` fails meanwhile)."""
loop_key: web.AppKey[ReconcileLoop | None] = web.AppKey("reconcile_loop")
"""The background loop, or None when ``HARU_RECONCILE_INTERVAL_MS`` turns it off."""
provisioner_key = web.AppKey("provisioner", Provisioner)
schema_gate_key = web.AppKey("schema_gate", SchemaGate)
"""Refuses reconcile ticks while a newer release's schema is in the store (``/readyz`` tells
it what each of its own schema checks found)."""
"""Drives ``skypilot`` domains; the domain routes read cluster status through it."""
promotion_accepted_key: web.AppKey[Callable[[UUID], None]] = web.AppKey("promotion_accepted")
"""Told the fleet id when this process accepts a promotion (its proxy then holds for it)."""
