"""Where the proxies saw a domain refuse connections: ``domains.connect_failed_at``.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03

Frozen history: this file imports no haru_db code.

A server process whose proxy cannot connect to the active domain's serving endpoint (refused,
or no route) stamps the time here, at most once a second per domain and process, off the
request path. Every replica's reconcile tick reads it with the fleet: a newer stamp makes it
poll the domain's supervisor again at once, and it corroborates (never replaces) the strong
evidence that the domain's host is gone. The stamp only moves forward. Neither ``updated_at``
nor the route pointer moves, so no route notification fires and no cached snapshot is
invalidated by it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Plain ADD COLUMN on both engines (as 0003, 0006 and 0007): no batch rebuild of `domains`.
    op.add_column("domains", sa.Column("connect_failed_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("domains", "connect_failed_at")
