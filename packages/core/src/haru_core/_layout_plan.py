"""``haru apply``: compare a layout with the stored fleet and decide what may change.

The rules (the server README's "Changing a running fleet" gives the reasoning):

- the fleet's display name and policy change at once (the policy is read at every tick);
- a domain that an in-flight operation drives (its target or its source) changes nothing;
- on the active domain, a change that would move traffic is refused: a model removed, a
  model's ``servingUrl`` changed, the domain's ``servingBaseUrl`` or ``supervisorUrl``
  changed (promote another domain first, then apply); adding a model or a slot moves none;
- a standby's slots, models and URLs may change while no operation drives it;
- a domain may be removed while it is neither active nor driven by an operation (a
  provisioned one is torn down); a slot may be removed while no operation drives its domain,
  except an inference slot of the active domain (it would move traffic) and a training slot
  whose trainer runs;
- a provider cannot change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from haru_protocol import (
    DomainLayout,
    DomainSnapshot,
    FleetLayout,
    FleetPlan,
    FleetSnapshot,
    InferenceSlotSpec,
    ModelBinding,
    Operation,
    PlanAction,
    PlanItem,
    PlanSubject,
    Provider,
    RowRevision,
    SlotSnapshot,
    SlotSpec,
    TrainingSlotSpec,
    TrainingSlotState,
)

PROMOTE_AWAY = "promote another domain first (`haru promote`), then apply"


@dataclass(frozen=True, slots=True)
class FleetRowChange:
    """New display name and policy of the fleet row."""

    fleet_id: UUID
    display_name: str | None
    policy: dict[str, Any]
    items: tuple[PlanItem, ...]


@dataclass(frozen=True, slots=True)
class DomainAdd:
    """A domain the layout lists and the store lacks (inserted with its slots)."""

    layout: DomainLayout
    items: tuple[PlanItem, ...]


@dataclass(frozen=True, slots=True)
class DomainRowChange:
    """New URLs, placement and provisioning settings of one domain row."""

    domain_id: UUID
    layout: DomainLayout
    moves_traffic: bool
    """Whether the change would move traffic were the domain active (re-checked by the write)."""
    items: tuple[PlanItem, ...]


@dataclass(frozen=True, slots=True)
class SlotAdd:
    """A slot the layout lists on a stored domain that lacks it."""

    domain_id: UUID
    spec: SlotSpec
    items: tuple[PlanItem, ...]


@dataclass(frozen=True, slots=True)
class SlotRowChange:
    """A new spec for one slot row."""

    slot_id: UUID
    domain_id: UUID
    spec: SlotSpec
    moves_traffic: bool
    items: tuple[PlanItem, ...]


@dataclass(frozen=True, slots=True)
class DomainRemove:
    """A stored domain the layout no longer lists (its row is marked removed)."""

    domain_id: UUID
    items: tuple[PlanItem, ...]


@dataclass(frozen=True, slots=True)
class SlotRemove:
    """A slot of a stored domain the layout no longer lists (its row is marked removed)."""

    slot_id: UUID
    domain_id: UUID
    moves_traffic: bool
    """Whether it serves models (re-checked against the active pointer by the write)."""
    items: tuple[PlanItem, ...]


RowChange = (
    FleetRowChange
    | DomainAdd
    | DomainRowChange
    | SlotAdd
    | SlotRowChange
    | DomainRemove
    | SlotRemove
)
"""One write of an apply: a compare-and-swap on one row, or an insert."""


@dataclass(frozen=True, slots=True)
class LayoutPlan:
    """The plan as shown (:attr:`plan`) and the writes that carry it out (:attr:`changes`)."""

    plan: FleetPlan
    changes: tuple[RowChange, ...] = field(default=())


def _item(
    action: PlanAction,
    subject: PlanSubject,
    path: str,
    detail: str = "",
    refused: str | None = None,
) -> PlanItem:
    return PlanItem(action=action, subject=subject, path=path, detail=detail, refused=refused)


def _shown(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_shown(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    return str(value)


def _slot_name(spec: SlotSpec) -> str:
    return f"{spec.kind.value} gpu {spec.gpu_index}"


def plan_layout(
    fleet: FleetSnapshot | None,
    layout: FleetLayout,
    *,
    stored_policy: Mapping[str, Any] | None,
    in_flight: Operation | None,
    revisions: Mapping[tuple[str, UUID], int],
) -> LayoutPlan:
    """The plan that brings ``fleet`` (None: not stored yet) to ``layout``.

    Args:
        fleet: The stored fleet, read after ``revisions``.
        layout: The operator's layout.
        stored_policy: The operator's stored policy values (camelCase), as stored.
        in_flight: The fleet's in-flight operation, if any.
        revisions: Each stored row's configuration revision, keyed on
            ``("fleet" | "domain" | "slot", id)``, read before ``fleet``.
    """
    rows = tuple(
        RowRevision(table=table, id=row_id, revision=revision)  # type: ignore[arg-type]
        for (table, row_id), revision in sorted(revisions.items(), key=lambda kv: str(kv[0]))
    )
    if fleet is None:
        return _plan_new(layout)
    items: list[PlanItem] = []
    changes: list[RowChange] = []
    fleet_change = _fleet_change(fleet, layout, stored_policy or {})
    if fleet_change is not None:
        changes.append(fleet_change)
    stored = {d.slug: d for d in fleet.domains}
    for domain in layout.domains:
        found = stored.get(domain.slug)
        if found is None:
            changes.append(DomainAdd(layout=domain, items=_added_domain_items(domain)))
        else:
            changes.extend(_domain_changes(fleet, found, domain, in_flight))
    listed = {d.slug for d in layout.domains}
    changes.extend(
        _removed_domain(fleet, d, in_flight) for d in fleet.domains if d.slug not in listed
    )
    for change in changes:
        items.extend(change.items)
    notes: list[str] = []
    active = fleet.active_domain
    if layout.active_domain_slug is not None and (
        active is None or active.slug != layout.active_domain_slug
    ):
        notes.append(
            f"activeDomainSlug {layout.active_domain_slug!r} names the first active only; the "
            f"active domain is {'none' if active is None else repr(active.slug)} and moves "
            "only by promotion"
        )
    plan = FleetPlan(
        slug=fleet.slug,
        fleet_id=fleet.id,
        items=tuple(items),
        revisions=rows,
        notes=tuple(notes),
    )
    return LayoutPlan(plan=plan, changes=tuple(changes))


def _plan_new(layout: FleetLayout) -> LayoutPlan:
    items = [_item("+", "fleet", f"fleet {layout.slug}")]
    for key, value in sorted(({} if layout.policy is None else layout.policy.stored()).items()):
        items.append(_item("+", "policy", f"policy {key}", _shown(value)))
    for domain in layout.domains:
        items.extend(_added_domain_items(domain))
    plan = FleetPlan(slug=layout.slug, fleet_id=None, items=tuple(items), revisions=())
    return LayoutPlan(plan=plan)


def _fleet_change(
    fleet: FleetSnapshot, layout: FleetLayout, stored_policy: Mapping[str, Any]
) -> FleetRowChange | None:
    items: list[PlanItem] = []
    if fleet.display_name != layout.display_name:
        items.append(
            _item(
                "~",
                "fleet",
                f"fleet {fleet.slug}",
                f"displayName: {_shown(fleet.display_name)} -> {_shown(layout.display_name)}",
            )
        )
    wanted = {} if layout.policy is None else layout.policy.stored()
    for key in sorted(stored_policy.keys() | wanted.keys()):
        old, new = stored_policy.get(key), wanted.get(key)
        if old == new:
            continue
        action: PlanAction = "+" if old is None else "-" if new is None else "~"
        detail = (
            f"{_shown(old)} -> {_shown(new)}"
            if action == "~"
            else _shown(new)
            if action == "+"
            else f"{_shown(old)} (back to the default)"
        )
        items.append(_item(action, "policy", f"policy {key}", detail + ", at the next tick"))
    if not items:
        return None
    return FleetRowChange(
        fleet_id=fleet.id, display_name=layout.display_name, policy=wanted, items=tuple(items)
    )


def _added_domain_items(domain: DomainLayout) -> tuple[PlanItem, ...]:
    items = [
        _item(
            "+",
            "domain",
            f"domain {domain.slug}",
            f"{domain.provider.value}, provisioning until its first good heartbeat",
        )
    ]
    for spec in domain.slots:
        items.extend(_added_slot_items(domain.slug, spec))
    return tuple(items)


def _added_slot_items(domain_slug: str, spec: SlotSpec) -> list[PlanItem]:
    path = f"domain {domain_slug} / {_slot_name(spec)}"
    if isinstance(spec, TrainingSlotSpec):
        return [_item("+", "slot", path, " ".join(spec.command))]
    items = [_item("+", "slot", path)]
    items.extend(_item("+", "model", f"{path} / model {m.name}", _binding(m)) for m in spec.models)
    return items


def _binding(model: ModelBinding) -> str:
    return "" if model.serving_url is None else f"servingUrl {model.serving_url}"


def _driver(domain: DomainSnapshot, in_flight: Operation | None) -> str | None:
    if in_flight is None or domain.id not in (
        in_flight.target_domain_id,
        in_flight.source_domain_id,
    ):
        return None
    return (
        f"operation {in_flight.id} ({in_flight.kind.value}) drives domain {domain.slug!r}; "
        "apply again when it has finished"
    )


def _domain_changes(
    fleet: FleetSnapshot,
    stored: DomainSnapshot,
    domain: DomainLayout,
    in_flight: Operation | None,
) -> list[RowChange]:
    active = fleet.active_domain_id == stored.id
    driven = _driver(stored, in_flight)
    path = f"domain {domain.slug}"
    changes: list[RowChange] = []
    if stored.provider is not domain.provider:
        item = _item(
            "~",
            "domain",
            path,
            f"provider: {stored.provider.value} -> {domain.provider.value}",
            "a domain's provider cannot change: add a domain with a new slug instead",
        )
        return [DomainRowChange(stored.id, domain, True, (item,))]
    items: list[PlanItem] = []
    moves = False
    # A provisioned domain's URLs are Haru's record of its machine, never the layout's.
    provisioned = domain.provider is not Provider.STATIC
    for key, old, new, traffic in (
        ("supervisorUrl", stored.supervisor_url, domain.supervisor_url, not provisioned),
        ("servingBaseUrl", stored.serving_base_url, domain.serving_base_url, not provisioned),
        (
            "placement",
            stored.placement.model_dump(mode="json"),
            domain.placement.model_dump(mode="json"),
            False,
        ),
        (
            "provisioning",
            None if stored.provisioning is None else stored.provisioning.model_dump(mode="json"),
            None if domain.provider is Provider.STATIC else domain.settings.model_dump(mode="json"),
            False,
        ),
    ):
        if old == new or (provisioned and key in ("supervisorUrl", "servingBaseUrl")):
            continue
        moves = moves or traffic
        refused = driven or (
            f"domain {domain.slug!r} is active and this would move its traffic: {PROMOTE_AWAY}"
            if traffic and active
            else None
        )
        when = "" if traffic else " (at the domain's next launch)"
        items.append(
            _item("~", "domain", path, f"{key}: {_shown(old)} -> {_shown(new)}{when}", refused)
        )
    if items:
        changes.append(DomainRowChange(stored.id, domain, moves, tuple(items)))
    by_key = {(s.kind, s.gpu_index): s for s in stored.slots}
    for spec in domain.slots:
        slot = by_key.pop((spec.kind, spec.gpu_index), None)
        if slot is None:
            added = _added_slot_items(domain.slug, spec)
            if driven is not None:
                added[0] = added[0].model_copy(update={"refused": driven})
            changes.append(SlotAdd(stored.id, spec, tuple(added)))
            continue
        change = _slot_change(
            domain.slug, slot, spec, active=active, driven=driven, provisioned=provisioned
        )
        if change is not None:
            changes.append(change)
    changes.extend(_removed_slot(domain.slug, slot, active, driven) for slot in by_key.values())
    return changes


def _removed_slot(
    domain_slug: str, slot: SlotSnapshot, active: bool, driven: str | None
) -> SlotRemove:
    serving = isinstance(slot.spec, InferenceSlotSpec)
    refused = driven
    if refused is None and serving and active:
        refused = (
            f"domain {domain_slug!r} is active and this would move its traffic: {PROMOTE_AWAY}"
        )
    if refused is None and slot.state in (TrainingSlotState.TRAINING, TrainingSlotState.STOPPING):
        refused = (
            f"its trainer is {slot.state.value}: remove the slot while domain {domain_slug!r} "
            "is active (its trainer stopped) or once the trainer has stopped"
        )
    detail = (
        "models " + ",".join(m.name for m in slot.spec.models)
        if isinstance(slot.spec, InferenceSlotSpec)
        else " ".join(slot.spec.command)
    )
    item = _item(
        "-", "slot", f"domain {domain_slug} / {_slot_name(slot.spec)}", detail, refused=refused
    )
    return SlotRemove(slot.id, slot.domain_id, serving, (item,))


def _slot_change(
    domain_slug: str,
    slot: SlotSnapshot,
    spec: SlotSpec,
    *,
    active: bool,
    driven: str | None,
    provisioned: bool,
) -> SlotRowChange | None:
    path = f"domain {domain_slug} / {_slot_name(spec)}"
    old, new = slot.spec, spec
    if provisioned and isinstance(old, InferenceSlotSpec):
        # The snapshot fills in the serving URLs recorded for the machine; the spec has none.
        bare = tuple(m.model_copy(update={"serving_url": None}) for m in old.models)
        old = old.model_copy(update={"models": bare})
    if old.model_dump(mode="json") == new.model_dump(mode="json"):
        return None
    traffic_refusal = (
        f"domain {domain_slug!r} is active and this would move its traffic: {PROMOTE_AWAY}"
    )
    items: list[PlanItem] = []
    moves = False
    if isinstance(old, TrainingSlotSpec) and isinstance(new, TrainingSlotSpec):
        for key, was_text, now_text in (
            ("command", " ".join(old.command), " ".join(new.command)),
            ("checkpointDir", old.checkpoint_dir, new.checkpoint_dir),
        ):
            if was_text != now_text:
                items.append(
                    _item(
                        "~",
                        "slot",
                        path,
                        f"{key}: {was_text} -> {now_text} (a running trainer keeps running)",
                        driven,
                    )
                )
    elif isinstance(old, InferenceSlotSpec) and isinstance(new, InferenceSlotSpec):
        before = {m.name: m for m in old.models}
        after = {m.name: m for m in new.models}
        for name, model in after.items():
            was = before.get(name)
            where = f"{path} / model {name}"
            if was is None:
                items.append(_item("+", "model", where, _binding(model), driven))
                continue
            first = was.model_dump(mode="json")
            second = model.model_dump(mode="json")
            for key in sorted(first.keys() | second.keys()):
                if first.get(key) == second.get(key):
                    continue
                traffic = key == "servingUrl"
                moves = moves or traffic
                refused = driven or (traffic_refusal if traffic and active else None)
                when = "" if traffic else " (at the domain's next launch)"
                detail = f"{key}: {_shown(first.get(key))} -> {_shown(second.get(key))}{when}"
                items.append(_item("~", "model", where, detail, refused))
        for name in before.keys() - after.keys():
            moves = True
            items.append(
                _item(
                    "-",
                    "model",
                    f"{path} / model {name}",
                    refused=driven or (traffic_refusal if active else None),
                )
            )
    return SlotRowChange(slot.id, slot.domain_id, spec, moves, tuple(_ordered(items)))


def _ordered(items: Sequence[PlanItem]) -> list[PlanItem]:
    order = {"+": 0, "~": 1, "-": 2}
    return sorted(items, key=lambda i: (order[i.action], i.path))


def _removed_domain(
    fleet: FleetSnapshot, domain: DomainSnapshot, in_flight: Operation | None
) -> DomainRemove:
    if fleet.active_domain_id == domain.id:
        refused: str | None = f"domain {domain.slug!r} is the active domain: {PROMOTE_AWAY}"
    else:
        refused = _driver(domain, in_flight)
    detail = domain.provider.value
    if domain.provider is not Provider.STATIC:
        detail += ", torn down (as `haru domain down`)"
    return DomainRemove(
        domain.id, (_item("-", "domain", f"domain {domain.slug}", detail, refused),)
    )
