"""Fixtures of haru-core's tests: a small factory of valid fleet snapshots."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from haru_protocol import (
    Cloud,
    DomainSnapshot,
    DomainState,
    FleetSnapshot,
    InferenceSlotSpec,
    InferenceSlotState,
    ModelBinding,
    ModelStatus,
    Placement,
    Policy,
    Provider,
    SlotKind,
    SlotSnapshot,
    SlotStatus,
    SupervisorStatus,
    TrainingRunState,
    TrainingSlotSpec,
    TrainingSlotState,
    TrainingStatus,
)

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
"""The fixed "now" of every test (core never reads a clock)."""

_NAMESPACE = uuid.UUID("6f1c1d2e-0000-4000-8000-000000000000")


@dataclass(frozen=True)
class SlotDraft:
    """A slot before it belongs to a domain."""

    kind: SlotKind
    gpu_index: int
    state: InferenceSlotState | TrainingSlotState
    models: tuple[str, ...] = ()


class FleetFactory:
    """Builds valid snapshots with deterministic ids (uuid5 of the slugs)."""

    now = NOW
    fleet_id = uuid.uuid5(_NAMESPACE, "fleet")

    def domain_id(self, slug: str) -> uuid.UUID:
        """The id every domain with ``slug`` gets."""
        return uuid.uuid5(_NAMESPACE, f"domain/{slug}")

    def inference(
        self,
        gpu_index: int = 0,
        *models: str,
        state: InferenceSlotState = InferenceSlotState.SERVING,
    ) -> SlotDraft:
        """An inference slot serving ``models`` (default: one model ``m-<gpu>``)."""
        return SlotDraft(SlotKind.INFERENCE, gpu_index, state, models or (f"m-{gpu_index}",))

    def training(
        self, gpu_index: int = 0, *, state: TrainingSlotState = TrainingSlotState.IDLE
    ) -> SlotDraft:
        """A training slot."""
        return SlotDraft(SlotKind.TRAINING, gpu_index, state)

    def slot(self, domain_slug: str, draft: SlotDraft) -> SlotSnapshot:
        """The snapshot of ``draft`` inside the domain ``domain_slug``."""
        domain_id = self.domain_id(domain_slug)
        spec: InferenceSlotSpec | TrainingSlotSpec
        if draft.kind is SlotKind.INFERENCE:
            spec = InferenceSlotSpec(
                gpu_index=draft.gpu_index,
                models=tuple(
                    ModelBinding(name=m, serving_url=f"http://{domain_slug}.test:8000/{m}")
                    for m in draft.models
                ),
            )
        else:
            spec = TrainingSlotSpec(
                gpu_index=draft.gpu_index,
                command=("train",),
                checkpoint_dir=f"/ckpt/{domain_slug}",
            )
        return SlotSnapshot(
            id=uuid.uuid5(domain_id, f"{draft.kind.value}/{draft.gpu_index}"),
            domain_id=domain_id,
            gpu_index=draft.gpu_index,
            kind=draft.kind,
            state=draft.state,
            spec=spec,
        )

    def domain(
        self,
        slug: str,
        *,
        state: DomainState = DomainState.READY,
        slots: Sequence[SlotDraft] | None = None,
        supervisor: bool = True,
        serving: bool = True,
        last_seen_at: datetime | None = NOW,
        state_updated_at: datetime = NOW - timedelta(minutes=10),
    ) -> DomainSnapshot:
        """A domain; by default ready, just seen, with one serving inference slot on GPU 0.

        ``supervisor``/``serving`` False leave the supervisor URL / serving base URL unset.
        """
        drafts = (self.inference(0),) if slots is None else tuple(slots)
        return DomainSnapshot(
            id=self.domain_id(slug),
            fleet_id=self.fleet_id,
            slug=slug,
            state=state,
            provider=Provider.STATIC,
            placement=Placement(cloud=Cloud.AWS, region="r-1", accelerator="EXAMPLE-GPU"),
            supervisor_url=f"http://{slug}.test:8701" if supervisor else None,
            serving_base_url=f"http://{slug}.test:8800" if serving else None,
            last_seen_at=last_seen_at,
            state_updated_at=state_updated_at,
            slots=tuple(self.slot(slug, d) for d in drafts),
        )

    def fleet(
        self,
        *domains: DomainSnapshot,
        active: str | None = None,
        policy: Policy | None = None,
        route_revision: int = 1,
    ) -> FleetSnapshot:
        """A fleet of ``domains`` whose routing pointer targets the domain slugged ``active``."""
        return FleetSnapshot(
            id=self.fleet_id,
            slug="test-fleet",
            display_name=None,
            active_domain_id=None if active is None else self.domain_id(active),
            route_revision=route_revision,
            policy=policy or Policy(),
            domains=domains,
        )

    def status(
        self,
        *,
        models: dict[str, bool | None] | None = None,
        training: dict[int, tuple[TrainingRunState, tuple[int, ...]]] | None = None,
        ready: bool = False,
    ) -> SupervisorStatus:
        """A supervisor status: all ``models`` on one inference slot, training runs by GPU."""
        slots: list[SlotStatus] = []
        if models:
            slots.append(
                SlotStatus(
                    gpu_index=0,
                    kind=SlotKind.INFERENCE,
                    models=tuple(
                        ModelStatus(name=name, port=9000 + i, sleeping=sleeping)
                        for i, (name, sleeping) in enumerate(models.items())
                    ),
                )
            )
        for gpu, (state, pids) in (training or {}).items():
            slots.append(
                SlotStatus(
                    gpu_index=gpu,
                    kind=SlotKind.TRAINING,
                    training=TrainingStatus(state=state, pids=pids),
                )
            )
        return SupervisorStatus(slots=tuple(slots), ready=ready)


@pytest.fixture
def make() -> FleetFactory:
    """The snapshot factory."""
    return FleetFactory()
