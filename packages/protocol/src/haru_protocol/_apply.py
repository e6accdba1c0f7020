"""``haru apply``: the plan that compares a layout with a stored fleet, and its request bodies."""

from __future__ import annotations

from typing import Annotated, Literal
from uuid import UUID

from pydantic import Field, StrictBool, StrictInt

from haru_protocol._base import PeerModel, WireModel
from haru_protocol._layout import FleetLayout

PlanAction = Literal["+", "~", "-"]
"""``+`` added, ``~`` changed, ``-`` removed."""

PlanSubject = Literal["fleet", "policy", "domain", "slot", "model"]
"""What a plan item changes: the fleet row (display name), a policy key, a domain, a slot or
one model binding of an inference slot."""

ConfigRevision = Annotated[StrictInt, Field(ge=1)]
"""A row's configuration revision: it grows by one with every change ``haru apply`` (or a
policy PATCH) makes to that row."""


class PlanItem(PeerModel):
    """One difference between the layout and the stored fleet."""

    action: PlanAction
    subject: PlanSubject
    path: str
    """What it is, e.g. ``domain b / inference gpu 0 / model m``."""
    detail: str = ""
    """What changes (``servingUrl: http://a -> http://b``) and when it takes effect."""
    refused: str | None = None
    """Why this change is not applied; None when it can be."""


class RowRevision(PeerModel):
    """The configuration revision of one stored row, as the plan read it."""

    table: Literal["fleet", "domain", "slot"]
    id: UUID
    revision: ConfigRevision


class FleetPlan(PeerModel):
    """What applying a layout would change in the stored fleet (``POST .../apply``)."""

    slug: str
    fleet_id: UUID | None
    """None when the fleet does not exist yet (the apply creates it)."""
    items: tuple[PlanItem, ...]
    revisions: tuple[RowRevision, ...]
    """The revisions the plan was made on; an apply carrying them is refused (409
    ``plan_stale``) once any of them moved."""
    notes: tuple[str, ...] = ()
    """Things the layout says that an apply never changes (e.g. ``activeDomainSlug``)."""

    @property
    def refused(self) -> tuple[PlanItem, ...]:
        """The items that block the apply."""
        return tuple(i for i in self.items if i.refused is not None)


class ApplyRequest(WireModel):
    """Body of ``POST /v1/fleets/{ref}/apply``."""

    layout: FleetLayout
    dry_run: StrictBool = False
    """Only answer the plan; change nothing."""
    revisions: tuple[RowRevision, ...] | None = None
    """The plan's revisions (from a dry run): refused with 409 ``plan_stale`` when the stored
    fleet moved since. Omitted: the plan is made and applied in one request (each row is still
    swapped against the revision that plan read)."""


class ApplyResponse(PeerModel):
    """Answer of ``POST /v1/fleets/{ref}/apply``."""

    plan: FleetPlan
    applied: StrictBool
    """Whether the changes were made (False for a dry run)."""
    fleet_id: UUID | None
    """The fleet's id (after an apply that created it, the new id)."""


def render_plan(plan: FleetPlan) -> str:
    """The plan as text: one line per item, a refusal indented under its item."""
    refused = len(plan.refused)
    header = f"fleet {plan.slug}: " + (
        "no changes"
        if not plan.items
        else f"{len(plan.items)} change(s)" + (f", {refused} refused" if refused else "")
    )
    lines = [header]
    for item in plan.items:
        line = f"  {item.action} {item.path}"
        if item.detail:
            line += f": {item.detail}"
        lines.append(line)
        if item.refused is not None:
            lines.append(f"      refused: {item.refused}")
    lines.extend(f"  note: {note}" for note in plan.notes)
    return "\n".join(lines)
