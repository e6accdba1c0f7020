"""The control server's Python API: what embedding code and tests import.

Importing this module loads the whole server (the state store, SQLAlchemy, the aiohttp
server); the package's ``__init__`` stays empty so the CLI starts without them.
"""

from __future__ import annotations

from haru_server._app import create_app
from haru_server._clock import Clock, utc_now
from haru_server._control_plane import ControlPlane
from haru_server._errors import FleetNotFoundError, HaruServerError
from haru_server._loop import LoopOptions, ReconcileLoop
from haru_server._reconciler import Accepted, Reconciler, ReconcilerOptions, TickResult
from haru_server._serve import run_server
from haru_server._settings import Settings, SettingsError
from haru_server._steps import StepTuning

__all__ = (  # noqa: RUF022 -- grouped by topic
    # Application
    "create_app",
    "run_server",
    "Settings",
    "Clock",
    "utc_now",
    "ControlPlane",
    # Reconciler
    "Reconciler",
    "ReconcilerOptions",
    "StepTuning",
    "TickResult",
    "Accepted",
    "ReconcileLoop",
    "LoopOptions",
    # Errors
    "HaruServerError",
    "SettingsError",
    "FleetNotFoundError",
)
