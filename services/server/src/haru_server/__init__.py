"""Haru control server: control API, reconciler, inference proxy and the haru CLI.

The Python API is :mod:`haru_server.api`: :func:`~haru_server.api.create_app` builds the
aiohttp application (control API of DESIGN 7.2, the inference proxy of 7.5, the reconcile loop
of 7.3); :func:`~haru_server.api.run_server` boots it the way ``haru serve`` does (announce,
migrate, listen, stop on a signal); :class:`~haru_server.api.Reconciler` runs reconcile ticks
against a :class:`haru_db.StateStore` and the domains' supervisors (through
:class:`haru_supervisor_client.SupervisorClient`, the only code that calls them);
:class:`~haru_server.api.ReconcileLoop` runs them in the background;
:class:`~haru_server.api.ControlPlane` owns and wires them (and the proxy) for the life of the
app. :mod:`haru_server.control_client` is the control API's HTTP client.

This package module imports nothing itself, so ``haru --help`` and the CLI's HTTP commands
(:mod:`haru_server.cli`) start without the state store (SQLAlchemy, Alembic) or the aiohttp
server; importing :mod:`haru_server.api` loads them.
"""

from __future__ import annotations

__all__: tuple[str, ...] = ()
