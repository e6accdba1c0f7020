"""Haru supervisor: the agent on each GPU host (vLLM sleep/wake, training runs, GPU memory).

It serves the API of DESIGN 6.4 to the control plane, drives the local vLLM servers' admin
routes on 127.0.0.1, runs one preemptible trainer per training slot in its own process group,
and reports GPU memory from NVML or ``nvidia-smi``. Run it with ``haru-supervisor``.

The Python API is :mod:`haru_supervisor.api` (:func:`~haru_supervisor.api.create_app`, the
settings, the trainers, the vLLM admin client, the GPU readers). This package module imports
nothing itself, so the serving gateway (``haru-gateway``, :mod:`haru_supervisor._gateway`)
starts without the supervisor's application, settings or trainers.

The client that drives supervisors is its own distribution, ``haru-supervisor-client``: the
control plane and orchestrators install it without this package.
"""

from __future__ import annotations

__all__: tuple[str, ...] = ()
