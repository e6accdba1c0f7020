"""snapshot_from_layout: a pure snapshot the decision functions accept."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from haru_core import (
    AlreadyActive,
    CreateOperation,
    InvalidTarget,
    decide_promotion,
    layout_id,
    snapshot_from_layout,
)
from haru_protocol import (
    DomainState,
    InferenceSlotState,
    SlotKind,
    TrainingSlotState,
    load_example_layout,
)

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def test_the_example_layout_becomes_a_snapshot_with_stable_ids() -> None:
    layout = load_example_layout()
    assert layout.active_domain_slug is not None
    snapshot = snapshot_from_layout(layout, now=NOW)
    assert snapshot == snapshot_from_layout(layout, now=NOW)
    assert snapshot.id == layout_id(layout.slug)
    assert snapshot.route_revision == 1
    active = snapshot.active_domain
    assert active is not None
    assert active.slug == layout.active_domain_slug
    assert active.id == layout_id(layout.slug, active.slug)
    for domain in snapshot.domains:
        assert domain.state is DomainState.PROVISIONING
        assert domain.last_seen_at is None
        for slot in domain.slots:
            if slot.kind is SlotKind.TRAINING:
                assert slot.state is TrainingSlotState.IDLE
            elif domain.id == active.id:
                assert slot.state is InferenceSlotState.SERVING
            else:
                assert slot.state is InferenceSlotState.SLEEPING


def test_observed_states_decide_whether_a_standby_can_be_promoted() -> None:
    layout = load_example_layout()
    standby = next(d.slug for d in layout.domains if d.slug != layout.active_domain_slug)
    target = layout_id(layout.slug, standby)
    unseen = snapshot_from_layout(layout, now=NOW)
    assert isinstance(decide_promotion(unseen, target), InvalidTarget)
    seen = snapshot_from_layout(layout, now=NOW, states={standby: DomainState.READY})
    domain = seen.domain(target)
    assert domain is not None
    assert domain.last_seen_at == NOW
    decision = decide_promotion(seen, target)
    assert isinstance(decision, CreateOperation)
    assert decision.target_domain_id == target
    moved = snapshot_from_layout(layout, now=NOW, active=standby, route_revision=2)
    assert isinstance(decide_promotion(moved, target), AlreadyActive)


def test_bad_arguments_are_refused() -> None:
    layout = load_example_layout()
    with pytest.raises(ValueError, match="timezone-aware"):
        snapshot_from_layout(layout, now=datetime(2030, 1, 1))  # noqa: DTZ001
    with pytest.raises(ValueError, match="nowhere"):
        snapshot_from_layout(layout, now=NOW, states={"nowhere": DomainState.READY})
    with pytest.raises(ValueError, match="nowhere"):
        snapshot_from_layout(layout, now=NOW, active="nowhere")
