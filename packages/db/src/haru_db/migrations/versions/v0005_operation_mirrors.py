"""Operation CAS writes move their step's slot states in the same statement.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Frozen history: this file imports no haru_db code.

``operations.pending_mirrors`` (JSON, NULL between statements) carries the slot mirrors an
operation CAS applies: ``{"exit": M | null, "entry": M | null}`` with
``M = {"onSource", "kind", "from", "to", "countInto"}``. The exit mirror (the finished step's
proof, e.g. training slots to ``idle``) is applied first; the number of slots it moved is set
into the first appended event's payload under ``countInto`` (when given); the entry mirror
(the next step's first move, e.g. inference slots to ``waking``) is applied last. Each acts on
the operation's target domain, or its source domain with ``onSource``.

On SQLite one trigger (replacing 0002's) applies the mirrors, appends ``pending_events`` and
clears both columns, inside the CAS statement itself. PostgreSQL does the same with
data-modifying CTEs in the repository statement and never sets the columns.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None

_OLD_TRIGGER = """
CREATE TRIGGER trg_operations_append_pending_events
AFTER UPDATE OF pending_events ON operations
FOR EACH ROW
WHEN NEW.pending_events IS NOT NULL
BEGIN
    INSERT INTO events (fleet_id, domain_id, slot_id, operation_id, type, payload, created_at)
    SELECT NEW.fleet_id, NEW.target_domain_id, NULL, NEW.id,
           json_extract(value, '$.type'), json_extract(value, '$.payload'), NEW.updated_at
      FROM json_each(NEW.pending_events)
     ORDER BY CAST(key AS INTEGER);
    UPDATE operations SET pending_events = NULL WHERE id = NEW.id;
END
"""


# changes() in the INSERT is the number of rows the exit mirror's UPDATE (the trigger's most
# recently completed statement) moved.
_TRIGGER = """
CREATE TRIGGER trg_operations_pending_writes
AFTER UPDATE OF pending_events, pending_mirrors ON operations
FOR EACH ROW
WHEN NEW.pending_events IS NOT NULL OR NEW.pending_mirrors IS NOT NULL
BEGIN
    UPDATE slots
       SET state = json_extract(NEW.pending_mirrors, '$.exit.to'),
           state_updated_at = NEW.updated_at,
           updated_at = NEW.updated_at
     WHERE json_extract(NEW.pending_mirrors, '$.exit') IS NOT NULL
       AND domain_id = CASE WHEN json_extract(NEW.pending_mirrors, '$.exit.onSource')
                            THEN NEW.source_domain_id ELSE NEW.target_domain_id END
       AND kind = json_extract(NEW.pending_mirrors, '$.exit.kind')
       AND state IN (SELECT value FROM json_each(NEW.pending_mirrors, '$.exit.from'));
    INSERT INTO events (fleet_id, domain_id, slot_id, operation_id, type, payload, created_at)
    SELECT NEW.fleet_id, NEW.target_domain_id, NULL, NEW.id,
           json_extract(value, '$.type'),
           CASE WHEN CAST(key AS INTEGER) = 0
                 AND json_extract(NEW.pending_mirrors, '$.exit.countInto') IS NOT NULL
                THEN json_set(json_extract(value, '$.payload'),
                              '$.' || json_extract(NEW.pending_mirrors, '$.exit.countInto'),
                              changes())
                ELSE json_extract(value, '$.payload') END,
           NEW.updated_at
      FROM json_each(NEW.pending_events)
     ORDER BY CAST(key AS INTEGER);
    UPDATE slots
       SET state = json_extract(NEW.pending_mirrors, '$.entry.to'),
           state_updated_at = NEW.updated_at,
           updated_at = NEW.updated_at
     WHERE json_extract(NEW.pending_mirrors, '$.entry') IS NOT NULL
       AND domain_id = CASE WHEN json_extract(NEW.pending_mirrors, '$.entry.onSource')
                            THEN NEW.source_domain_id ELSE NEW.target_domain_id END
       AND kind = json_extract(NEW.pending_mirrors, '$.entry.kind')
       AND state IN (SELECT value FROM json_each(NEW.pending_mirrors, '$.entry.from'));
    UPDATE operations SET pending_events = NULL, pending_mirrors = NULL WHERE id = NEW.id;
END
"""


def upgrade() -> None:
    op.add_column("operations", sa.Column("pending_mirrors", sa.JSON(), nullable=True))
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS trg_operations_append_pending_events")
        op.execute(_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS trg_operations_pending_writes")
        op.execute(_OLD_TRIGGER)
    op.drop_column("operations", "pending_mirrors")
