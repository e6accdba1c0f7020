"""Output of the ``haru`` commands: Rich tables, JSON documents, and the views of fleets and events.

Tables use the terminal's width, and plain ASCII at an unbounded width when stdout is not a
terminal (piped output stays 7-bit and is never truncated); JSON goes straight to stdout.
Rich is imported on first use, not when the CLI is built.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from functools import cache
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from datetime import datetime
    from uuid import UUID

    from haru_protocol import Event, FleetSnapshot, Policy
    from rich.console import Console
    from rich.table import Table

PIPED_WIDTH: Final = 100_000
"""Console width when stdout is not a terminal: tables are never truncated or wrapped."""


# No emoji codes either: a server's ":warning:" prints as typed.
@cache
def _console() -> Console:
    from rich.console import Console

    console = Console(highlight=False, emoji=False)
    if not console.is_terminal:
        console = Console(highlight=False, emoji=False, width=PIPED_WIDTH, soft_wrap=True)
    return console


def _table(*headers: str, **options: Any) -> Table:
    """A Rich table in plain ASCII when stdout is not a terminal (piped output stays 7-bit)."""
    from rich import box
    from rich.table import Table

    return Table(*headers, box=box.HEAVY_HEAD if _console().is_terminal else box.ASCII, **options)


def _escape(value: object) -> str:
    """``value`` as text that Rich prints verbatim (a server's ``[red]`` is not markup)."""
    from rich.markup import escape

    return escape(str(value))


def _cells(*values: object) -> list[str]:
    """Table cells that print verbatim (a table cell is Rich markup otherwise)."""
    return [_escape(value) for value in values]


def _print_json(document: str) -> None:
    # Straight to stdout: no console markup, highlighting or wrapping of the JSON text.
    sys.stdout.write(document + "\n")
    sys.stdout.flush()


@cache
def _err_console() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False, emoji=False)


def _ago(at: datetime | None) -> str:
    import datetime as dt

    if at is None:
        return "never"
    seconds = (dt.datetime.now(dt.UTC) - at).total_seconds()
    return f"{seconds:.1f}s ago" if seconds < 120 else at.isoformat(timespec="seconds")


def render_fleet(fleet: FleetSnapshot) -> list[Table]:
    """The fleet as two tables: its domains, then their slots."""
    from haru_core import is_active
    from rich.text import Text

    shown = fleet.slug if fleet.display_name is None else f"{fleet.slug} ({fleet.display_name})"
    domains = _table(
        "domain",
        "role",
        "state",
        "provider",
        "supervisor",
        "last seen",
        title=Text(f"fleet {shown}"),
    )
    slots = _table("domain", "gpu", "kind", "state", "models / command")
    for domain in fleet.domains:
        role = "[bold green]active[/]" if is_active(fleet, domain) else "standby"
        domains.add_row(
            _escape(domain.slug),
            role,
            *_cells(
                domain.state.value,
                domain.provider.value,
                domain.supervisor_url or "-",
                _ago(domain.last_seen_at),
            ),
        )
        for slot in domain.slots:
            spec = slot.inference_spec
            detail = (
                ", ".join(m.name for m in spec.models)
                if spec is not None
                else " ".join(slot.training_spec.command if slot.training_spec else ())
            )
            slots.add_row(
                *_cells(domain.slug, slot.gpu_index, slot.kind.value, slot.state.value, detail)
            )
    active = fleet.active_domain
    domains.caption = Text(
        f"id {fleet.id}  active domain {active.slug if active is not None else '-'}  "
        f"route revision {fleet.route_revision}  "
        f"autoFailover {'on' if fleet.policy.auto_failover else 'off'}"
    )
    return [domains, slots, render_policy(fleet.policy)]


def render_policy(policy: Policy) -> Table:
    """The resolved policy, one key a line, with the default where the value differs."""
    from haru_protocol import Policy, policy_differences

    defaults = {key: value for key, _, value in policy_differences(policy, Policy())}
    table = _table("policy key", "value", "default", title="policy (resolved)")
    for key, value in policy.model_dump(mode="json").items():
        entries = value.items() if isinstance(value, dict) else [(None, value)]
        for inner, shown in entries:
            name = key if inner is None else f"{key}.{inner}"
            default = defaults.get(name)
            table.add_row(name, str(shown), "" if name not in defaults else str(default))
    return table


def event_domain(event: Event, domains: Mapping[UUID, str]) -> str:
    """The event's domain by slug (its id when the fleet no longer has it; ``-`` for none)."""
    if event.domain_id is None:
        return "-"
    return domains.get(event.domain_id, str(event.domain_id))


def format_event(event: Event, domains: Mapping[UUID, str] | None = None) -> str:
    """One event as one line (its domain by slug, from ``domains``)."""
    import json
    from datetime import UTC

    from haru_protocol import UntypedEventPayload

    data = event.data
    if isinstance(data, UntypedEventPayload):
        # A type this CLI does not know, or a payload that does not fit its model: as stored.
        payload = json.dumps(data.data, separators=(",", ":"), sort_keys=True)
        if data.error is not None:
            payload += f"  (malformed {event.type} payload: {data.error})"
    else:
        payload = json.dumps(data.model_dump(mode="json"), separators=(",", ":"), sort_keys=True)
    stamp = event.created_at.astimezone(UTC).isoformat(timespec="milliseconds")
    domain = event_domain(event, domains or {})
    return f"{event.id:>6}  {stamp}  {domain:<12} {event.type:<36} {payload}"
