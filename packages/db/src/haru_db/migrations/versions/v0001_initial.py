"""Initial schema: fleets, domains, slots, operations, events (DESIGN 5.2).

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Frozen history: this file imports no haru_db tables; it spells the schema out itself.

Cross-table atomicity on SQLite (which has no data-modifying CTEs) comes from two triggers
created here: a failed promote cleans up its target's slots, and a pointer move by
switch_active marks its operation routing_committed. PostgreSQL does both with a CTE in the
repository statement (it must also lock the operation row there), so it gets no trigger.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

_DOMAIN_STATES = ("provisioning", "ready", "degraded", "failed", "stopping", "stopped")
_PROVIDERS = ("static", "skypilot", "skyserve")
_INFERENCE_STATES = ("starting", "serving", "sleeping", "waking", "probing", "failed", "stopped")
_TRAINING_STATES = ("idle", "training", "stopping", "failed", "stopped")
_OPERATION_KINDS = ("promote", "demote")
_OPERATION_STATES = ("pending", "running", "succeeded", "failed", "cancelled")
_PROMOTE_STEPS = (
    "stop_training",
    "verify_gpu",
    "wake_vllm",
    "probe",
    "switch_active",
    "demote_old_sleep",
    "demote_old_train",
)
_DEMOTE_STEPS = ("sleep_vllm", "start_training")
_IN_FLIGHT = ("pending", "running")
_FINISHED = ("succeeded", "failed", "cancelled")

_SLUG_PATTERN = "^[a-z0-9]+(-[a-z0-9]+)*$"

_SQLITE_PROMOTE_FAILED_TRIGGER = """
CREATE TRIGGER trg_operations_promote_failed_cleanup
AFTER UPDATE OF state ON operations
FOR EACH ROW
WHEN NEW.state = 'failed' AND OLD.state IN ('pending', 'running') AND NEW.kind = 'promote'
BEGIN
    UPDATE slots
       SET state = 'failed', state_updated_at = NEW.updated_at, updated_at = NEW.updated_at
     WHERE domain_id = NEW.target_domain_id
       AND kind = 'inference'
       AND (state IN ('waking', 'probing')
            OR (state = 'serving'
                AND NOT EXISTS (SELECT 1 FROM fleets
                                 WHERE fleets.id = NEW.fleet_id
                                   AND fleets.active_domain_id = NEW.target_domain_id)));
    UPDATE slots
       SET state = 'training', state_updated_at = NEW.updated_at, updated_at = NEW.updated_at
     WHERE domain_id = NEW.target_domain_id
       AND kind = 'training'
       AND state = 'stopping';
END
"""

_SQLITE_SWITCH_TRIGGER = """
CREATE TRIGGER trg_fleets_switch_commits_routing
AFTER UPDATE ON fleets
FOR EACH ROW
WHEN NEW.last_switch_operation_id IS NOT NULL AND NEW.route_revision <> OLD.route_revision
BEGIN
    UPDATE operations
       SET routing_committed = 1, updated_at = NEW.updated_at
     WHERE id = NEW.last_switch_operation_id;
END
"""


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _slug_check(column: str, dialect: str) -> str:
    if dialect == "postgresql":
        return f"length({column}) <= 63 AND {column} ~ '{_SLUG_PATTERN}'"
    return (
        f"length({column}) BETWEEN 1 AND 63 AND {column} NOT GLOB '*[^a-z0-9-]*' "
        f"AND {column} NOT GLOB '-*' AND {column} NOT GLOB '*-' AND {column} NOT GLOB '*--*'"
    )


def _timestamp(name: str, *, nullable: bool = False) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    uuid = sa.Uuid(as_uuid=True)

    # The pointer key fleets -> domains closes a cycle: SQLite accepts the forward reference
    # inline (keys are checked per row), PostgreSQL gets it once both tables exist.
    pointer_key = sa.ForeignKeyConstraint(
        ["id", "active_domain_id"],
        ["domains.fleet_id", "domains.id"],
        name=op.f("fk_fleets_id_active_domain_id_domains"),
    )
    op.create_table(
        "fleets",
        sa.Column("id", uuid, nullable=False),
        sa.Column("slug", sa.String(63), nullable=False),
        sa.Column("display_name", sa.Text(), nullable=True),
        sa.Column("active_domain_id", uuid, nullable=True),
        sa.Column("route_revision", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("policy", sa.JSON(), nullable=False),
        sa.Column("last_switch_operation_id", uuid, nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fleets")),
        sa.UniqueConstraint("slug", name=op.f("uq_fleets_slug")),
        sa.CheckConstraint(_slug_check("slug", dialect), name=op.f("ck_fleets_slug_format")),
        sa.CheckConstraint("route_revision > 0", name=op.f("ck_fleets_route_revision_positive")),
        *([pointer_key] if dialect == "sqlite" else []),
    )
    op.create_table(
        "domains",
        sa.Column("id", uuid, nullable=False),
        sa.Column("fleet_id", uuid, nullable=False),
        sa.Column("slug", sa.String(63), nullable=False),
        sa.Column("state", sa.String(16), server_default=sa.text("'provisioning'"), nullable=False),
        sa.Column("provider", sa.String(16), nullable=False),
        sa.Column("placement", sa.JSON(), nullable=False),
        sa.Column("supervisor_url", sa.Text(), nullable=True),
        sa.Column("serving_base_url", sa.Text(), nullable=True),
        _timestamp("last_seen_at", nullable=True),
        _timestamp("state_updated_at"),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_domains")),
        sa.ForeignKeyConstraint(
            ["fleet_id"], ["fleets.id"], name=op.f("fk_domains_fleet_id_fleets")
        ),
        sa.UniqueConstraint("fleet_id", "slug", name=op.f("uq_domains_fleet_id_slug")),
        sa.UniqueConstraint("fleet_id", "id", name=op.f("uq_domains_fleet_id_id")),
        sa.CheckConstraint(_slug_check("slug", dialect), name=op.f("ck_domains_slug_format")),
        sa.CheckConstraint(_in("state", _DOMAIN_STATES), name=op.f("ck_domains_state_valid")),
        sa.CheckConstraint(_in("provider", _PROVIDERS), name=op.f("ck_domains_provider_valid")),
    )
    if dialect != "sqlite":
        op.create_foreign_key(
            op.f("fk_fleets_id_active_domain_id_domains"),
            "fleets",
            "domains",
            ["id", "active_domain_id"],
            ["fleet_id", "id"],
        )
    op.create_table(
        "slots",
        sa.Column("id", uuid, nullable=False),
        sa.Column("domain_id", uuid, nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        _timestamp("state_updated_at"),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_slots")),
        sa.ForeignKeyConstraint(
            ["domain_id"], ["domains.id"], name=op.f("fk_slots_domain_id_domains")
        ),
        sa.UniqueConstraint(
            "domain_id", "gpu_index", "kind", name=op.f("uq_slots_domain_id_gpu_index_kind")
        ),
        sa.CheckConstraint("gpu_index >= 0", name=op.f("ck_slots_gpu_index_non_negative")),
        sa.CheckConstraint(
            _in("kind", ("inference", "training")), name=op.f("ck_slots_kind_valid")
        ),
        sa.CheckConstraint(
            f"(kind = 'inference' AND {_in('state', _INFERENCE_STATES)}) OR "
            f"(kind = 'training' AND {_in('state', _TRAINING_STATES)})",
            name=op.f("ck_slots_state_valid_for_kind"),
        ),
    )
    op.create_table(
        "operations",
        sa.Column("id", uuid, nullable=False),
        sa.Column("fleet_id", uuid, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), server_default=sa.text("'pending'"), nullable=False),
        sa.Column("target_domain_id", uuid, nullable=False),
        sa.Column("source_domain_id", uuid, nullable=True),
        sa.Column("current_step", sa.String(32), nullable=True),
        _timestamp("step_started_at", nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("routing_committed", sa.Boolean(), server_default=sa.false(), nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        _timestamp("finished_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operations")),
        sa.ForeignKeyConstraint(
            ["fleet_id"], ["fleets.id"], name=op.f("fk_operations_fleet_id_fleets")
        ),
        sa.ForeignKeyConstraint(
            ["fleet_id", "target_domain_id"],
            ["domains.fleet_id", "domains.id"],
            name=op.f("fk_operations_fleet_id_target_domain_id_domains"),
        ),
        sa.ForeignKeyConstraint(
            ["fleet_id", "source_domain_id"],
            ["domains.fleet_id", "domains.id"],
            name=op.f("fk_operations_fleet_id_source_domain_id_domains"),
        ),
        sa.CheckConstraint(_in("kind", _OPERATION_KINDS), name=op.f("ck_operations_kind_valid")),
        sa.CheckConstraint(_in("state", _OPERATION_STATES), name=op.f("ck_operations_state_valid")),
        sa.CheckConstraint(
            "current_step IS NULL OR "
            f"(kind = 'promote' AND {_in('current_step', _PROMOTE_STEPS)}) OR "
            f"(kind = 'demote' AND {_in('current_step', _DEMOTE_STEPS)})",
            name=op.f("ck_operations_step_valid_for_kind"),
        ),
        sa.CheckConstraint(
            "state <> 'running' OR current_step IS NOT NULL",
            name=op.f("ck_operations_running_has_step"),
        ),
        sa.CheckConstraint(
            f"({_in('state', _IN_FLIGHT)} AND finished_at IS NULL) OR "
            f"({_in('state', _FINISHED)} AND finished_at IS NOT NULL)",
            name=op.f("ck_operations_finished_at_iff_finished"),
        ),
    )
    op.create_index(
        op.f("uq_operations_one_in_flight_per_fleet"),
        "operations",
        ["fleet_id"],
        unique=True,
        postgresql_where=sa.text(_in("state", _IN_FLIGHT)),
        sqlite_where=sa.text(_in("state", _IN_FLIGHT)),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("fleet_id", uuid, nullable=False),
        sa.Column("domain_id", uuid, nullable=True),
        sa.Column("slot_id", uuid, nullable=True),
        sa.Column("operation_id", uuid, nullable=True),
        sa.Column("type", sa.String(128), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        sa.ForeignKeyConstraint(
            ["fleet_id"], ["fleets.id"], name=op.f("fk_events_fleet_id_fleets")
        ),
        sa.ForeignKeyConstraint(
            ["domain_id"], ["domains.id"], name=op.f("fk_events_domain_id_domains")
        ),
        sa.ForeignKeyConstraint(["slot_id"], ["slots.id"], name=op.f("fk_events_slot_id_slots")),
        sa.ForeignKeyConstraint(
            ["operation_id"], ["operations.id"], name=op.f("fk_events_operation_id_operations")
        ),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_events_fleet_id_id"), "events", ["fleet_id", "id"])

    if dialect == "sqlite":
        op.execute(_SQLITE_PROMOTE_FAILED_TRIGGER)
        op.execute(_SQLITE_SWITCH_TRIGGER)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS trg_fleets_switch_commits_routing")
        op.execute("DROP TRIGGER IF EXISTS trg_operations_promote_failed_cleanup")
    op.drop_index(op.f("ix_events_fleet_id_id"), table_name="events")
    op.drop_table("events")
    op.drop_index(op.f("uq_operations_one_in_flight_per_fleet"), table_name="operations")
    op.drop_table("operations")
    op.drop_table("slots")
    if dialect == "sqlite":
        # SQLite drops a table with an implicit DELETE that the pointer key would refuse.
        op.execute("UPDATE fleets SET active_domain_id = NULL")
    else:
        op.drop_constraint(
            op.f("fk_fleets_id_active_domain_id_domains"), "fleets", type_="foreignkey"
        )
    op.drop_table("domains")
    op.drop_table("fleets")
