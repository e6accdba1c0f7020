"""Stored rows to read models: every row is validated, and a bad one is reported, not repaired."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from haru_protocol import (
    Event,
    FleetRoutePointer,
    FleetSnapshot,
    Operation,
    PolicyPatch,
    resolve_policy,
)
from pydantic import ValidationError

from haru_db._errors import MalformedFleetStateError

Row = Mapping[str, Any]


@contextmanager
def malformed(what: str) -> Iterator[None]:
    """Report a stored value that fails to decode or validate as :class:`MalformedFleetStateError`.

    The message names the record and the failing locations, never the stored values (a URL in
    a stored document may carry credentials).
    """
    try:
        yield
    except ValidationError as exc:
        locations = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['type']}"
            for err in exc.errors(include_input=False, include_url=False)
        )
        raise MalformedFleetStateError(f"{what} fails validation ({locations})") from exc
    except (ValueError, TypeError) as exc:
        # JSON text that does not parse, a timestamp or UUID SQLite cannot decode.
        raise MalformedFleetStateError(f"{what} cannot be decoded ({type(exc).__name__})") from exc


def operation_from_row(row: Row) -> Operation:
    """Validate one ``operations`` row."""
    with malformed(f"operation {row['id']}"):
        return Operation.model_validate(
            {
                "id": row["id"],
                "fleet_id": row["fleet_id"],
                "kind": row["kind"],
                "state": row["state"],
                "target_domain_id": row["target_domain_id"],
                "source_domain_id": row["source_domain_id"],
                "current_step": row["current_step"],
                "step_started_at": row["step_started_at"],
                "error": row["error"],
                "routing_committed": row["routing_committed"],
                "created_at": row["created_at"],
                "finished_at": row["finished_at"],
            }
        )


def event_from_row(row: Row) -> Event:
    """Validate one ``events`` row."""
    with malformed(f"event {row['id']}"):
        return Event.model_validate(
            {
                "id": row["id"],
                "fleet_id": row["fleet_id"],
                "domain_id": row["domain_id"],
                "slot_id": row["slot_id"],
                "operation_id": row["operation_id"],
                "type": row["type"],
                "payload": row["payload"],
                "created_at": row["created_at"],
            }
        )


def pointer_from_row(row: Row) -> FleetRoutePointer:
    """Validate the routing columns of one ``fleets`` row."""
    with malformed(f"fleet {row['id']}"):
        return FleetRoutePointer.model_validate(
            {
                "id": row["id"],
                "slug": row["slug"],
                "active_domain_id": row["active_domain_id"],
                "route_revision": row["route_revision"],
                "promotion_in_flight": bool(row["promotion_in_flight"]),
            }
        )


def _fill_model_urls(domain: dict[str, Any]) -> None:
    """Give a provisioned domain's bindings the serving URLs recorded for its machine."""
    urls = domain.pop("model_urls")
    if not isinstance(urls, dict) or not urls:
        return
    for slot in domain["slots"]:
        spec = slot["spec"]
        if not isinstance(spec, dict) or not isinstance(spec.get("models"), list):
            continue
        models = [
            {**m, "servingUrl": urls[m["name"]]}
            if isinstance(m, dict) and m.get("servingUrl") is None and m.get("name") in urls
            else m
            for m in spec["models"]
        ]
        slot["spec"] = {**spec, "models": models}


def snapshot_from_rows(rows: Sequence[Row]) -> FleetSnapshot:
    """Assemble one fleet from the rows of ``fleets LEFT JOIN domains LEFT JOIN slots``.

    Every row carries the fleet's columns (``f_*``), a domain's (``d_*``, null when the fleet
    has none) and a slot's (``s_*``, null when the domain has none). Domains are ordered by
    slug (code point), slots by (gpu_index, kind); the policy patch is resolved against the
    current defaults.
    """
    first = rows[0]
    what = f"fleet {first['f_id']}"
    with malformed(what):
        policy = resolve_policy(PolicyPatch.model_validate(first["f_policy"]))
    domains: dict[UUID, dict[str, Any]] = {}
    for row in rows:
        domain_id = row["d_id"]
        if domain_id is None:
            continue
        domain = domains.get(domain_id)
        if domain is None:
            domain = {
                "id": domain_id,
                "fleet_id": row["d_fleet_id"],
                "slug": row["d_slug"],
                "state": row["d_state"],
                "provider": row["d_provider"],
                "placement": row["d_placement"],
                "supervisor_url": row["d_supervisor_url"],
                "serving_base_url": row["d_serving_base_url"],
                "last_seen_at": row["d_last_seen_at"],
                "state_updated_at": row["d_state_updated_at"],
                "provisioning": row["d_provisioning"],
                "launch_attempt": row["d_launch_attempt"],
                "launch_started_at": row["d_launch_started_at"],
                "launched_at": row["d_launched_at"],
                "model_urls": row["d_model_urls"],
                "connect_failed_at": row["d_connect_failed_at"],
                "slots": [],
            }
            domains[domain_id] = domain
        if row["s_id"] is not None:
            domain["slots"].append(
                {
                    "id": row["s_id"],
                    "domain_id": row["s_domain_id"],
                    "gpu_index": row["s_gpu_index"],
                    "kind": row["s_kind"],
                    "state": row["s_state"],
                    "spec": row["s_spec"],
                }
            )
    ordered = sorted(domains.values(), key=lambda d: str(d["slug"]))
    for domain in ordered:
        domain["slots"].sort(key=lambda s: (s["gpu_index"], str(s["kind"])))
        _fill_model_urls(domain)
    with malformed(what):
        return FleetSnapshot.model_validate(
            {
                "id": first["f_id"],
                "slug": first["f_slug"],
                "display_name": first["f_display_name"],
                "active_domain_id": first["f_active_domain_id"],
                "route_revision": first["f_route_revision"],
                "route_lease_ms": first["f_route_lease_ms"],
                "policy": policy,
                "domains": ordered,
            }
        )
