"""Typed application keys: every piece of app state lives behind one of these.

The running parts (reconciler, loop, provisioner, proxy) are the control plane's
(``app[control_plane_key]``); the keys beside it hold plain values read by modules that need
no more than that.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web
from haru_db import StateStore
from haru_web import TokenSource

from haru_server._clock import Clock as Clock
from haru_server._clock import StoreClock
from haru_server._schema_gate import SchemaGate
from haru_server._settings import Settings

if TYPE_CHECKING:
    from haru_server._control_plane import ControlPlane

settings_key = web.AppKey("settings", Settings)
store_key = web.AppKey("store", StateStore)
clock_key: web.AppKey[Clock] = web.AppKey("clock")
store_clock_key: web.AppKey[StoreClock | None] = web.AppKey("store_clock")
api_token_key: web.AppKey[TokenSource | None] = web.AppKey("api_token")
"""``HARU_API_TOKEN`` as each request asks it (follows ``HARU_API_TOKEN_FILE``)."""
"""The database-clock sampler behind ``clock_key``; None when a clock was injected."""
control_plane_key: web.AppKey[ControlPlane] = web.AppKey("control_plane")
"""The server's runtime: the reconciler, the loop, the provisioner and the proxy."""
draining_key = web.AppKey("draining", asyncio.Event)
"""Set once a stop signal came and the server drains (``/readyz`` fails meanwhile)."""
schema_gate_key = web.AppKey("schema_gate", SchemaGate)
"""Refuses reconcile ticks while a newer release's schema is in the store (``/readyz`` tells
it what each of its own schema checks found)."""
