"""The longest route lease any server process routes a fleet with.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

Frozen history: this file imports no haru_db code.

``fleets.route_lease_ms`` (int, null until a process records one): every server process that
keeps a route lease for a fleet (``HARU_ROUTE_LEASE_MS``) raises it to its own lease before it
routes with one, so it is the largest lease in use. The promotion's ``demote_old_sleep`` step
waits out this lease (plus a read and a margin) after the flip before it drains the old
active, whatever lease the process running the step has. It only ever grows.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Plain ADD/DROP COLUMN on both engines (as 0003): no batch rebuild of `fleets`.
    op.add_column("fleets", sa.Column("route_lease_ms", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("fleets", "route_lease_ms")
