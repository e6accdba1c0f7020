"""The proofs a promotion's steps wait for, and the route guard's arithmetic (DESIGN 7.3, 7.5).

A step is done only when a supervisor's answer proves its effect. Each function here takes a
domain as the layout binds it and one supervisor answer, and names what the answer does NOT
yet prove (an empty list is the proof). A slot or model the answer omits is never proven.
"""

from __future__ import annotations

from haru_protocol import (
    DomainSnapshot,
    GpuMemoryResponse,
    SlotKind,
    SupervisorStatus,
    TrainingRunState,
)

from haru_core._bindings import inference_bindings, training_slots
from haru_core._heartbeat import model_sleep_states

GPU_RELEASED_RATIO = 0.25
"""A training GPU whose used memory is at most this share of its total counts as released.
A sleeping vLLM on the same GPU keeps a small footprint (CUDA context, the allocator's pool),
so "zero" is never the bar; a trainer still alive holds far more than a quarter."""

ROUTE_READ_BOUND_MS = 250
"""The bound on one route-pointer read: well above a healthy p99 (a few ms), short enough that
a hung store turns into stale serving before clients notice. A slower read counts as failed."""

ROUTE_GUARD_MARGIN_MS = 250
"""Added to lease + read bound before the old active is drained: a request routed just before
its lease ran out still has to be dispatched."""


def _training_runs(status: SupervisorStatus) -> dict[int, tuple[TrainingRunState, int]]:
    runs: dict[int, tuple[TrainingRunState, int]] = {}
    for slot in status.slots:
        if slot.kind is SlotKind.TRAINING and slot.training is not None:
            runs[slot.gpu_index] = (slot.training.state, len(slot.training.pids))
    return runs


def training_not_idle(domain: DomainSnapshot, status: SupervisorStatus) -> list[int]:
    """GPUs of the layout's training slots whose run is not reported idle (missing included).

    The proof of ``stop_training``: every trainer of the domain has exited.
    """
    runs = _training_runs(status)
    return [
        s.gpu_index
        for s in training_slots(domain)
        if runs.get(s.gpu_index, (None, 0))[0] is not TrainingRunState.IDLE
    ]


def training_not_running(domain: DomainSnapshot, status: SupervisorStatus) -> list[int]:
    """GPUs of the layout's training slots not reported running with a pid.

    The proof of ``start_training`` and ``demote_old_train``: a state of "running" without a
    live process proves nothing.
    """
    runs = _training_runs(status)
    not_running: list[int] = []
    for slot in training_slots(domain):
        state, pids = runs.get(slot.gpu_index, (None, 0))
        if state is not TrainingRunState.RUNNING or pids == 0:
            not_running.append(slot.gpu_index)
    return not_running


def models_not_in(domain: DomainSnapshot, status: SupervisorStatus, *, asleep: bool) -> list[str]:
    """Layout-bound models of ``domain`` not proven asleep (or awake); omitted ones included.

    With ``asleep=False`` the proof of ``wake_vllm``; with ``asleep=True`` the proof of the
    sleep steps. A model reported with ``sleeping: null`` (its server did not answer) is
    neither.
    """
    sleeping = model_sleep_states(status)
    return [b.name for b in inference_bindings(domain) if sleeping.get(b.name) is not asleep]


def gpus_not_released(domain: DomainSnapshot, memory: GpuMemoryResponse) -> list[int]:
    """GPUs of the layout's training slots still holding more than ``GPU_RELEASED_RATIO``.

    The proof of ``verify_gpu``. A GPU missing from the report, or reporting no total, is not
    released.
    """
    by_index = {g.index: g for g in memory.gpus}
    held: list[int] = []
    for slot in training_slots(domain):
        gpu = by_index.get(slot.gpu_index)
        if gpu is None or gpu.total_mib <= 0 or gpu.used_mib / gpu.total_mib > GPU_RELEASED_RATIO:
            held.append(slot.gpu_index)
    return held


def lease_guard_ms(lease_ms: int, read_bound_ms: int = ROUTE_READ_BOUND_MS) -> int:
    """How long after a flip every process has stopped routing to the old active.

    A process routes on a pointer whose confirming read started at most ``lease_ms`` plus one
    read (bounded by ``read_bound_ms``) ago; ``ROUTE_GUARD_MARGIN_MS`` covers the dispatch of
    a request routed just before that. With ``lease_ms`` = 0 (a read per request) only the
    read and the margin remain. The old active may be drained and put to sleep only once this
    has passed since the flip.
    """
    if lease_ms < 0 or read_bound_ms < 0:
        raise ValueError("lease and read bound are non-negative durations")
    return lease_ms + read_bound_ms + ROUTE_GUARD_MARGIN_MS
