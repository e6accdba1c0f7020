"""The step proofs and the route guard's arithmetic (DESIGN 7.3, 7.5)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from haru_core import (
    GPU_RELEASED_RATIO,
    ROUTE_GUARD_MARGIN_MS,
    ROUTE_READ_BOUND_MS,
    gpus_not_released,
    lease_guard_ms,
    models_not_in,
    training_not_idle,
    training_not_running,
)
from haru_protocol import GpuMemory, GpuMemoryResponse, TrainingRunState
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if TYPE_CHECKING:
    from conftest import FleetFactory

IDLE = TrainingRunState.IDLE
RUNNING = TrainingRunState.RUNNING
STOPPING = TrainingRunState.STOPPING


# ---- stop_training / start_training ----


def test_training_idle_is_proven_only_for_every_layout_slot(make: FleetFactory) -> None:
    beta = make.domain("beta", slots=[make.inference(0), make.training(0), make.training(1)])
    all_idle = make.status(training={0: (IDLE, ()), 1: (IDLE, ())})
    assert training_not_idle(beta, all_idle) == []
    one_stopping = make.status(training={0: (IDLE, ()), 1: (STOPPING, (7,))})
    assert training_not_idle(beta, one_stopping) == [1]
    # A GPU the supervisor does not report is not proven idle.
    assert training_not_idle(beta, make.status(training={0: (IDLE, ())})) == [1]
    # Training the layout does not bind is ignored.
    extra = make.status(training={0: (IDLE, ()), 1: (IDLE, ()), 5: (RUNNING, (9,))})
    assert training_not_idle(beta, extra) == []


def test_running_needs_a_live_process(make: FleetFactory) -> None:
    beta = make.domain("beta", slots=[make.inference(0), make.training(0)])
    assert training_not_running(beta, make.status(training={0: (RUNNING, (42,))})) == []
    # "running" with no pid proves nothing: the process may have exited already.
    assert training_not_running(beta, make.status(training={0: (RUNNING, ())})) == [0]
    assert training_not_running(beta, make.status(training={0: (STOPPING, (42,))})) == [0]
    assert training_not_running(beta, make.status()) == [0]


def test_a_domain_without_training_is_trivially_proven(make: FleetFactory) -> None:
    beta = make.domain("beta", slots=[make.inference(0)])
    status = make.status(training={0: (RUNNING, (1,))})
    assert training_not_idle(beta, status) == []
    assert training_not_running(beta, status) == []


# ---- wake / sleep ----


def test_models_proven_awake_or_asleep_against_the_layout(make: FleetFactory) -> None:
    beta = make.domain("beta", slots=[make.inference(0, "a", "b")])
    awake = make.status(models={"a": False, "b": False})
    assert models_not_in(beta, awake, asleep=False) == []
    assert models_not_in(beta, awake, asleep=True) == ["a", "b"]
    # Unproven (the server did not answer) is neither awake nor asleep.
    unknown = make.status(models={"a": None, "b": True})
    assert models_not_in(beta, unknown, asleep=True) == ["a"]
    assert models_not_in(beta, unknown, asleep=False) == ["a", "b"]
    # A model the supervisor omits is not proven; one the layout does not bind is ignored.
    partial = make.status(models={"a": True, "zzz": False})
    assert models_not_in(beta, partial, asleep=True) == ["b"]


# ---- verify_gpu ----


def _memory(*gpus: tuple[int, float, float]) -> GpuMemoryResponse:
    return GpuMemoryResponse(
        gpus=tuple(
            GpuMemory.model_validate({"index": i, "usedMiB": used, "totalMiB": total})
            for i, used, total in gpus
        )
    )


def test_gpu_release_threshold_is_inclusive(make: FleetFactory) -> None:
    beta = make.domain("beta", slots=[make.inference(0), make.training(0), make.training(1)])
    total = 143_771.0
    at_bar = total * GPU_RELEASED_RATIO
    assert gpus_not_released(beta, _memory((0, at_bar, total), (1, 0.0, total))) == []
    above = _memory((0, at_bar + 1, total), (1, 0.0, total))
    assert gpus_not_released(beta, above) == [0]


def test_a_missing_or_empty_gpu_is_not_released(make: FleetFactory) -> None:
    beta = make.domain("beta", slots=[make.inference(0), make.training(0), make.training(1)])
    assert gpus_not_released(beta, _memory((0, 0.0, 80_000.0))) == [1]
    assert gpus_not_released(beta, _memory((0, 0.0, 0.0), (1, 0.0, 1.0))) == [0]


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # `make` is stateless
@given(
    used=st.floats(min_value=0, max_value=200_000, allow_nan=False),
    total=st.floats(min_value=1, max_value=200_000, allow_nan=False),
)
def test_gpu_release_matches_the_ratio(make: FleetFactory, used: float, total: float) -> None:
    beta = make.domain("beta", slots=[make.inference(0), make.training(3)])
    held = gpus_not_released(beta, _memory((3, used, total)))
    assert (held == []) is (used / total <= GPU_RELEASED_RATIO)


# ---- the route guard ----


def test_lease_guard_adds_the_read_bound_and_the_margin() -> None:
    assert lease_guard_ms(300) == 300 + ROUTE_READ_BOUND_MS + ROUTE_GUARD_MARGIN_MS
    # A read per request still waits for one read and the dispatch margin.
    assert lease_guard_ms(0) == ROUTE_READ_BOUND_MS + ROUTE_GUARD_MARGIN_MS
    assert lease_guard_ms(1_000, read_bound_ms=0) == 1_000 + ROUTE_GUARD_MARGIN_MS
    with pytest.raises(ValueError, match="non-negative"):
        lease_guard_ms(-1)


@given(
    lease=st.integers(min_value=0, max_value=3_600_000),
    other=st.integers(min_value=0, max_value=3_600_000),
    bound=st.integers(min_value=0, max_value=10_000),
)
def test_lease_guard_outlasts_every_pointer_kept_from_before_the_flip(
    lease: int, other: int, bound: int
) -> None:
    # A pointer whose confirming read started at t <= flip is routed on until at most
    # t + lease + bound: the guard measured from the flip never ends before that.
    assert lease_guard_ms(lease, bound) >= lease + bound
    # A longer lease never shortens the guard (the store keeps the largest lease recorded).
    if other >= lease:
        assert lease_guard_ms(other, bound) >= lease_guard_ms(lease, bound)
