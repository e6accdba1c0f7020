"""Events of a route switch and of a degrade in their write's statement; two history indexes.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03

Frozen history: this file imports no haru_db code.

On SQLite the ``pending_events`` triggers of ``fleets`` and ``domains`` (0012) now also take
an ``operationId`` from each pending document (the 32-digit hex form SQLite stores a UUID
in), and the fleet's a ``domainId`` and a ``revisionInto`` key: the document's payload gets
the written row's ``route_revision`` under that key. So ``switch_active`` appends its
``routing.switched`` (with the operation, the target domain and the revision the switch
wrote) and a best-effort degrade its ``operation.step.timeout_best_effort`` in the
statement of the write they describe. A document without these keys is stored as before.
PostgreSQL needs no change: its CTEs name these values themselves.

Indexes on both engines: ``operations (fleet_id, created_at)`` for a fleet's recent
operations (promotion backoff and the prune's ranking) and ``events (operation_id)`` for the
foreign key's check when the prune deletes an operation.
"""

from __future__ import annotations

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None

_TEMPLATE = """
CREATE TRIGGER trg_{table}_config_events
AFTER UPDATE OF pending_events ON {table}
FOR EACH ROW
WHEN NEW.pending_events IS NOT NULL
BEGIN
    INSERT INTO events (fleet_id, domain_id, slot_id, operation_id, type, payload, created_at)
    SELECT {fleet}, {domain}, NULL, {operation},
           json_extract(value, '$.type'), {payload}, NEW.updated_at
      FROM json_each(NEW.pending_events)
     ORDER BY CAST(key AS INTEGER);
    UPDATE {table} SET pending_events = NULL WHERE id = NEW.id;
END
"""

_PAYLOAD = "json_extract(value, '$.payload')"
_OPERATION = "json_extract(value, '$.operationId')"

_TRIGGERS_0013 = {
    "fleets": _TEMPLATE.format(
        table="fleets",
        fleet="NEW.id",
        domain="json_extract(value, '$.domainId')",
        operation=_OPERATION,
        payload=(
            "CASE WHEN json_extract(value, '$.revisionInto') IS NULL THEN "
            f"{_PAYLOAD} ELSE json_set({_PAYLOAD}, "
            "'$.' || json_extract(value, '$.revisionInto'), NEW.route_revision) END"
        ),
    ),
    "domains": _TEMPLATE.format(
        table="domains",
        fleet="NEW.fleet_id",
        domain="NEW.id",
        operation=_OPERATION,
        payload=_PAYLOAD,
    ),
}
_TRIGGERS_0012 = {
    "fleets": _TEMPLATE.format(
        table="fleets", fleet="NEW.id", domain="NULL", operation="NULL", payload=_PAYLOAD
    ),
    "domains": _TEMPLATE.format(
        table="domains",
        fleet="NEW.fleet_id",
        domain="NEW.id",
        operation="NULL",
        payload=_PAYLOAD,
    ),
}


def _replace_triggers(triggers: dict[str, str]) -> None:
    for table, ddl in triggers.items():
        op.execute(f"DROP TRIGGER IF EXISTS trg_{table}_config_events")
        op.execute(ddl)


def upgrade() -> None:
    """Add the indexes; on SQLite, recreate the two triggers with the new keys."""
    op.create_index(
        op.f("ix_operations_fleet_id_created_at"), "operations", ["fleet_id", "created_at"]
    )
    op.create_index(op.f("ix_events_operation_id"), "events", ["operation_id"])
    if op.get_bind().dialect.name == "sqlite":
        _replace_triggers(_TRIGGERS_0013)


def downgrade() -> None:
    """Back to 0012: the indexes go, the triggers are 0012's again."""
    if op.get_bind().dialect.name == "sqlite":
        _replace_triggers(_TRIGGERS_0012)
    op.drop_index(op.f("ix_events_operation_id"), table_name="events")
    op.drop_index(op.f("ix_operations_fleet_id_created_at"), table_name="operations")
