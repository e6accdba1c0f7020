"""Operation CAS writes append their events in the same statement.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01

Frozen history: this file imports no haru_db tables.

``operations.pending_events`` (JSON, NULL between statements) carries the events an operation
CAS appends. On SQLite the trigger created here inserts them into ``events`` (with the
operation's fleet, target domain, id and ``updated_at``) and clears the column, inside the
CAS statement itself. PostgreSQL appends with a data-modifying CTE in the repository
statement and never sets the column.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

_SQLITE_APPEND_TRIGGER = """
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


def upgrade() -> None:
    op.add_column("operations", sa.Column("pending_events", sa.JSON(), nullable=True))
    if op.get_bind().dialect.name == "sqlite":
        op.execute(_SQLITE_APPEND_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS trg_operations_append_pending_events")
    op.drop_column("operations", "pending_events")
