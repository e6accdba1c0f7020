"""Haru control server: control API, reconciler, inference proxy and the haru CLI.

:func:`create_app` builds the aiohttp application (control API of DESIGN 7.2, the inference
proxy of 7.5, the reconcile loop of 7.3); :func:`run_server` boots it the way ``haru serve``
does (announce, migrate, listen, stop on a signal). :class:`Reconciler` runs reconcile ticks
against a :class:`haru_db.StateStore` and the domains' supervisors (through
:class:`haru_supervisor_client.SupervisorClient`, the only code that calls them);
:class:`ReconcileLoop` runs them in the background; :class:`ControlPlane` owns and wires
them (and the proxy) for the life of the app. :mod:`haru_server.control_client` is the
control API's HTTP client.

The names below are imported on first use (:pep:`562`), so ``haru --help`` and the CLI's HTTP
commands start without the state store (SQLAlchemy, Alembic) or the aiohttp server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


_HOMES = {
    "create_app": "_app",
    "Clock": "_clock",
    "utc_now": "_clock",
    "FleetNotFoundError": "_errors",
    "HaruServerError": "_errors",
    "ControlPlane": "_control_plane",
    "LoopOptions": "_loop",
    "ReconcileLoop": "_loop",
    "Reconciler": "_reconciler",
    "ReconcilerOptions": "_reconciler",
    "TickResult": "_reconciler",
    "Accepted": "_reconciler",
    "run_server": "_serve",
    "Settings": "_settings",
    "SettingsError": "_settings",
    "StepTuning": "_steps",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
