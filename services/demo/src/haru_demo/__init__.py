"""Haru demo: a whole local fleet on one machine without GPUs, and the ``haru demo`` command.

:class:`DemoTopology` starts emulated vLLM servers (haru-sim), one real supervisor per domain
and the real server as child processes on 127.0.0.1, then brings the standby to standby
posture the way an operator would; ``haru demo`` (registered under the ``haru.commands``
entry-point group, see :mod:`haru_demo._command`) runs it with a scenario, a live view and
steady SDK traffic (:class:`ChatTraffic`). :mod:`haru_demo.localfleet` is the in-process
variant (emulated vLLM servers and supervisors in the caller's event loop) that tests and
benchmarks use.
"""

from haru_sim.nvidia_smi import EmulatedGpu, GpuModel, write_nvidia_smi

from haru_demo._options import (
    DemoDomain,
    DemoTimings,
    HostPlacement,
    TopologyOptions,
    UnboundModel,
    VllmServer,
)
from haru_demo._posture import active_slug, is_standby_posture
from haru_demo._procs import DemoError, find_stray_trainers, log_tail
from haru_demo._scenario import fetch_events, operation_budget_s, promote_budget_s
from haru_demo._topology import DemoTopology
from haru_demo._traffic import ChatTraffic, RequestRecord, TrafficSummary

__all__ = (  # noqa: RUF022 -- grouped by topic
    # Topology
    "DemoTopology",
    "TopologyOptions",
    "HostPlacement",
    "DemoTimings",
    "DemoDomain",
    "VllmServer",
    "UnboundModel",
    "active_slug",
    "is_standby_posture",
    # Traffic and scenario
    "ChatTraffic",
    "RequestRecord",
    "TrafficSummary",
    "fetch_events",
    "promote_budget_s",
    "operation_budget_s",
    # Emulated GPUs
    "EmulatedGpu",
    "GpuModel",
    "write_nvidia_smi",
    # Processes and errors
    "DemoError",
    "find_stray_trainers",
    "log_tail",
)
