"""A per-fleet fencing token, bumped by every operation CAS.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03

Frozen history: this file imports no haru_db code.

``fleets.fence`` (bigint, 0 for a fleet that never had an operation) grows by one in the same
statement as each operation write: create, claim, advance, complete and fail. While an
operation is in flight it is the only writer of its fleet's fence, so the fence read together
with the operation's ``current_step`` (one statement) is the token of that step: a server
process sends it with every supervisor call it makes for the step, and a supervisor refuses a
state-changing call whose token is lower than the highest it has seen for the fleet (a process
that stalled past another's CAS).

PostgreSQL bumps it with a data-modifying CTE in the repository statement. On SQLite two
triggers do it inside the operation's own statement: before the row of a claim, advance,
complete or fail changes (so the statement's ``RETURNING`` can read the new value), and after
the insert of a create (a conflicting create inserts nothing and bumps nothing). Neither
touches ``updated_at``, ``route_revision`` or the pointer: no route notification fires, and
0001's ``trg_fleets_switch_commits_routing`` (route revision changes only) stays as it is.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None

_CAS_TRIGGER = """
CREATE TRIGGER trg_operations_fence_cas
BEFORE UPDATE OF state, current_step ON operations
FOR EACH ROW
WHEN NEW.state IS NOT OLD.state OR NEW.current_step IS NOT OLD.current_step
BEGIN
    UPDATE fleets SET fence = fence + 1 WHERE id = NEW.fleet_id;
END
"""

_CREATE_TRIGGER = """
CREATE TRIGGER trg_operations_fence_create
AFTER INSERT ON operations
FOR EACH ROW
BEGIN
    UPDATE fleets SET fence = fence + 1 WHERE id = NEW.fleet_id;
END
"""


def upgrade() -> None:
    # Plain ADD COLUMN on both engines (as 0003 and 0006): no batch rebuild of `fleets`.
    op.add_column(
        "fleets",
        sa.Column("fence", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
    )
    if op.get_bind().dialect.name == "sqlite":
        op.execute(_CAS_TRIGGER)
        op.execute(_CREATE_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS trg_operations_fence_create")
        op.execute("DROP TRIGGER IF EXISTS trg_operations_fence_cas")
    op.drop_column("fleets", "fence")
