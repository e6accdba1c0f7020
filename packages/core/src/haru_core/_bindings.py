"""What a domain's layout binds: its slots by kind and the models its inference slots serve."""

from __future__ import annotations

from typing import Literal

from haru_protocol import (
    DomainSnapshot,
    FleetSnapshot,
    InferenceSlotSpec,
    ModelBinding,
    SlotKind,
    SlotSnapshot,
)


def inference_slots(domain: DomainSnapshot) -> tuple[SlotSnapshot, ...]:
    """The inference slots of ``domain``, in layout order."""
    return tuple(s for s in domain.slots if s.kind is SlotKind.INFERENCE)


def training_slots(domain: DomainSnapshot) -> tuple[SlotSnapshot, ...]:
    """The training slots of ``domain``, in layout order."""
    return tuple(s for s in domain.slots if s.kind is SlotKind.TRAINING)


def slot_bindings(slot: SlotSnapshot) -> tuple[ModelBinding, ...]:
    """The models the layout binds to ``slot`` (none for a training slot)."""
    spec = slot.spec
    return spec.models if isinstance(spec, InferenceSlotSpec) else ()


def inference_bindings(domain: DomainSnapshot) -> tuple[ModelBinding, ...]:
    """Every model of every inference slot of ``domain``, in layout order."""
    return tuple(b for s in inference_slots(domain) for b in slot_bindings(s))


def has_inference_bindings(domain: DomainSnapshot) -> bool:
    """Whether ``domain`` serves at least one model (without one it can never be active)."""
    return any(slot_bindings(s) for s in inference_slots(domain))


def is_active(fleet: FleetSnapshot, domain: DomainSnapshot) -> bool:
    """Whether the routing pointer of ``fleet`` targets ``domain``; every other one is a standby."""
    return fleet.active_domain_id is not None and fleet.active_domain_id == domain.id


def domain_role(fleet: FleetSnapshot, domain: DomainSnapshot) -> Literal["active", "standby"]:
    """``"active"`` or ``"standby"``, the role events and logs name (see :func:`is_active`)."""
    return "active" if is_active(fleet, domain) else "standby"
