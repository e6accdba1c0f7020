"""Haru control server: control API, reconciler, inference proxy and the haru CLI.

:func:`create_app` builds the aiohttp application (control API of SPEC 7.2, the inference
proxy of 7.5, the reconcile loop of 7.3); :func:`run_server` boots it the way ``haru serve``
does (announce, migrate, listen, stop on a signal). :class:`Reconciler` runs reconcile ticks
against a :class:`haru_db.StateStore` and the domains' supervisors (through
:class:`haru_supervisor.client.SupervisorClient`, the only code that calls them);
:class:`ReconcileLoop` runs them in the background. ``haru_server.localfleet`` (the ``demo``
extra) starts a whole fleet of emulated vLLM servers and real supervisors on one machine.
"""

from haru_server._app import create_app
from haru_server._clock import Clock, utc_now
from haru_server._errors import FleetNotFoundError, HaruServerError
from haru_server._loop import FleetKickers, LoopOptions, ReconcileLoop
from haru_server._reconciler import Reconciler, ReconcilerOptions, TickResult
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
    # Reconciler
    "Reconciler",
    "ReconcilerOptions",
    "StepTuning",
    "TickResult",
    "ReconcileLoop",
    "LoopOptions",
    "FleetKickers",
    # Errors
    "HaruServerError",
    "SettingsError",
    "FleetNotFoundError",
)
