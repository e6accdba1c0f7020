"""Errors raised by haru-sim.

Hierarchy::

    SimError                      root of every error this package raises
    ├── SimConfigError            a configuration or fault value is invalid (also a ValueError)
    ├── SimStateError             a handle was used in the wrong state: not started, started twice
    └── SimUnsupportedError       a fault needs something this server does not have
                                  (``refuse`` needs a listener owned by :class:`VllmSim`)
"""

from __future__ import annotations


class SimError(Exception):
    """Root of every error raised by haru-sim."""


class SimConfigError(SimError, ValueError):
    """A configuration or fault value is invalid."""


class SimStateError(SimError, RuntimeError):
    """A handle was used in the wrong state (not started, or started twice)."""


class SimUnsupportedError(SimError):
    """A fault cannot be applied to this server.

    ``refuse`` closes the listening socket, which only a server started through
    :class:`VllmSim` owns; an app mounted by a test client cannot stop listening.
    """
