"""Provisioned domains: their settings, launch claims and recorded addresses.

Revision ID: 0003
Revises: 0002
Create Date: 2025-03-01

Frozen history: this file imports no haru_db tables.

- ``domains.provisioning`` (JSON, null for static domains): the layout's provisioning
  settings, kept so the reconciler can render the domain's SkyPilot task.
- ``domains.launch_attempt`` (int, 0 = never launched): a launch is claimed by a CAS that
  moves it from N to N + 1, so a server that crashed during ``sky launch`` never launches the
  same cluster twice; ``launch_started_at``/``launched_at`` say when it started and returned.
- ``domains.model_urls`` (JSON object model -> serving URL): recorded with the supervisor URL
  once the cluster's address is known; snapshots fill each binding's ``servingUrl`` from it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


_COLUMNS = ("provisioning", "launch_attempt", "launch_started_at", "launched_at", "model_urls")


def upgrade() -> None:
    # Plain ADD/DROP COLUMN on both engines (SQLite >= 3.35): a batch rebuild of `domains`
    # would trip the foreign keys that point at it.
    op.add_column("domains", sa.Column("provisioning", sa.JSON(), nullable=True))
    op.add_column(
        "domains",
        sa.Column("launch_attempt", sa.Integer(), nullable=False, server_default=sa.text("0")),
    )
    op.add_column("domains", sa.Column("launch_started_at", sa.DateTime(timezone=True)))
    op.add_column("domains", sa.Column("launched_at", sa.DateTime(timezone=True)))
    op.add_column("domains", sa.Column("model_urls", sa.JSON(), nullable=True))


def downgrade() -> None:
    for column in reversed(_COLUMNS):
        op.drop_column("domains", column)
