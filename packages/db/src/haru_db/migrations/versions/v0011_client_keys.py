"""Inference client keys: the proxy's credentials apart from the admin token.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03

Frozen history: this file imports no haru_db code.

``client_keys`` holds one row per key: its id (what logs and metrics name), the operator's
name for it, the SHA-256 of the key (the key itself is shown once at creation and never
stored), the fleets and models it may use (JSON lists; NULL means any), its per-process
request-rate limit (NULL means none), and when it was created and revoked.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None


def _when() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "client_keys",
        sa.Column("id", sa.Uuid(as_uuid=True), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("fleets", sa.JSON(), nullable=True),
        sa.Column("models", sa.JSON(), nullable=True),
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("created_at", _when(), nullable=False),
        sa.Column("revoked_at", _when(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_client_keys"),
        sa.UniqueConstraint("key_hash", name="uq_client_keys_key_hash"),
    )


def downgrade() -> None:
    op.drop_table("client_keys")
