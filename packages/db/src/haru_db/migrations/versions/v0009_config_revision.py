"""A configuration revision on fleets, domains and slots, for ``haru apply``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03

Frozen history: this file imports no haru_db code.

``config_revision`` (int, 1 for every existing row) counts the changes of a row's operator
configuration: the fleet's display name and policy, a domain's URLs, placement and
provisioning settings, a slot's spec. A plan made by ``haru apply`` carries the revisions it
was made on, and each change it applies is one compare-and-swap on that row's revision (which
it raises by one). State writes (heartbeats, transitions, operations) leave it alone.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None

TABLES = ("fleets", "domains", "slots")


def upgrade() -> None:
    # Plain ADD/DROP COLUMN on both engines (as 0006): no batch rebuild of the tables.
    for table in TABLES:
        op.add_column(
            table,
            sa.Column("config_revision", sa.Integer(), nullable=False, server_default=sa.text("1")),
        )


def downgrade() -> None:
    for table in reversed(TABLES):
        op.drop_column(table, "config_revision")
