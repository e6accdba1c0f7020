"""Typed application keys: every piece of app state lives behind one of these."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from uuid import UUID

from aiohttp import web
from haru_db import StateStore

from haru_server._settings import Settings

Clock = Callable[[], datetime]
"""Returns the current aware UTC time; injected so tests control budgets."""

FleetKicker = Callable[[UUID], None]
"""Asks the background loop to reconcile one fleet now (debounced; never blocks)."""

settings_key = web.AppKey("settings", Settings)
store_key = web.AppKey("store", StateStore)
clock_key = web.AppKey("clock", Clock)
kick_fleet_key = web.AppKey("kick_fleet", FleetKicker)
