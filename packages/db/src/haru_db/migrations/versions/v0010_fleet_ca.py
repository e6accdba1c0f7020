"""The per-fleet CA of provisioned domains and the certificate issued to each domain.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03

Frozen history: this file imports no haru_db code.

``fleet_cas`` holds one CA per fleet: its PEM certificate and its private key sealed with the
server's store key (``HARU_STORE_KEY_FILE``; the key never reaches the database).
``domain_certs`` records, per provisioned domain, the leaf certificate issued before its
latest launch: the launch attempt, the DNS name the server checks, the SHA-256 fingerprint of
the leaf (what an operator can pin) and its expiry. The leaf's key is never stored: it reaches
the host only as a SkyPilot secret.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None


def _when() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "fleet_cas",
        sa.Column("fleet_id", sa.Uuid(as_uuid=True), nullable=False),
        sa.Column("cert_pem", sa.Text(), nullable=False),
        sa.Column("sealed_key", sa.Text(), nullable=False),
        sa.Column("created_at", _when(), nullable=False),
        sa.ForeignKeyConstraint(["fleet_id"], ["fleets.id"], name="fk_fleet_cas_fleet_id_fleets"),
        sa.PrimaryKeyConstraint("fleet_id", name="pk_fleet_cas"),
    )
    op.create_table(
        "domain_certs",
        sa.Column("domain_id", sa.Uuid(as_uuid=True), nullable=False),
        sa.Column("fleet_id", sa.Uuid(as_uuid=True), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("server_name", sa.Text(), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("not_after", _when(), nullable=False),
        sa.Column("issued_at", _when(), nullable=False),
        sa.ForeignKeyConstraint(
            ["domain_id"], ["domains.id"], name="fk_domain_certs_domain_id_domains"
        ),
        sa.ForeignKeyConstraint(
            ["fleet_id"], ["fleets.id"], name="fk_domain_certs_fleet_id_fleets"
        ),
        sa.PrimaryKeyConstraint("domain_id", name="pk_domain_certs"),
    )
    op.create_index("ix_domain_certs_fleet_id", "domain_certs", ["fleet_id"])


def downgrade() -> None:
    op.drop_index("ix_domain_certs_fleet_id", table_name="domain_certs")
    op.drop_table("domain_certs")
    op.drop_table("fleet_cas")
