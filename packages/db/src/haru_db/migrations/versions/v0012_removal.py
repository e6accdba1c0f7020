"""Removed domains and slots, and configuration events in the statement of their change.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03

Frozen history: this file imports no haru_db code.

``domains.removed_at`` and ``slots.removed_at`` (NULL while the row is part of the fleet) mark
a row ``haru apply`` removed: events and operations keep referencing it, every read of the
fleet leaves it out, and the unique slug (domains) and GPU (slots) keys become partial indexes
over the rows not removed, so the same slug or GPU can be added again. On SQLite the keys were
table constraints: both tables are rebuilt (``haru_db.upgrade`` runs SQLite migrations with
foreign keys off and checks every key before the commit; the rows keep their ids).

``pending_events`` (JSON, NULL between statements) on ``fleets``, ``domains`` and ``slots``
carries the ``fleet.config.changed`` events of an apply's write: on SQLite the triggers created
here insert them into ``events`` and clear the column inside the write's own statement (as
0002 does for operations); PostgreSQL appends them with a data-modifying CTE and never sets it.
On SQLite ``trg_operations_insert_events`` does the same for ``operations.pending_events``
set by an operation's insert (0002's column): the events that say who asked for it are
appended by the insert's own statement.

On PostgreSQL an apply's write and a promotion serialize on the domain row: an operation's
insert takes a share lock on its target (and skips the insert when the target is removed,
re-read after the lock); a removal, and every configuration write of a domain or of a slot
(which locks its domain row first), re-checks for an in-flight operation that drives the
domain after its row lock, each in a statement of its own (READ COMMITTED gives each a fresh
view), and skips the row when one does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | None = None
depends_on: str | None = None

_IN_FLIGHT = "('pending', 'running')"

_SQLITE_TRIGGERS = {
    "trg_fleets_config_events": """
CREATE TRIGGER trg_fleets_config_events
AFTER UPDATE OF pending_events ON fleets
FOR EACH ROW
WHEN NEW.pending_events IS NOT NULL
BEGIN
    INSERT INTO events (fleet_id, domain_id, slot_id, operation_id, type, payload, created_at)
    SELECT NEW.id, NULL, NULL, NULL,
           json_extract(value, '$.type'), json_extract(value, '$.payload'), NEW.updated_at
      FROM json_each(NEW.pending_events)
     ORDER BY CAST(key AS INTEGER);
    UPDATE fleets SET pending_events = NULL WHERE id = NEW.id;
END
""",
    "trg_domains_config_events": """
CREATE TRIGGER trg_domains_config_events
AFTER UPDATE OF pending_events ON domains
FOR EACH ROW
WHEN NEW.pending_events IS NOT NULL
BEGIN
    INSERT INTO events (fleet_id, domain_id, slot_id, operation_id, type, payload, created_at)
    SELECT NEW.fleet_id, NEW.id, NULL, NULL,
           json_extract(value, '$.type'), json_extract(value, '$.payload'), NEW.updated_at
      FROM json_each(NEW.pending_events)
     ORDER BY CAST(key AS INTEGER);
    UPDATE domains SET pending_events = NULL WHERE id = NEW.id;
END
""",
    "trg_domains_insert_config_events": """
CREATE TRIGGER trg_domains_insert_config_events
AFTER INSERT ON domains
FOR EACH ROW
WHEN NEW.pending_events IS NOT NULL
BEGIN
    INSERT INTO events (fleet_id, domain_id, slot_id, operation_id, type, payload, created_at)
    SELECT NEW.fleet_id, NEW.id, NULL, NULL,
           json_extract(value, '$.type'), json_extract(value, '$.payload'), NEW.updated_at
      FROM json_each(NEW.pending_events)
     ORDER BY CAST(key AS INTEGER);
    UPDATE domains SET pending_events = NULL WHERE id = NEW.id;
END
""",
    "trg_slots_config_events": """
CREATE TRIGGER trg_slots_config_events
AFTER UPDATE OF pending_events ON slots
FOR EACH ROW
WHEN NEW.pending_events IS NOT NULL
BEGIN
    INSERT INTO events (fleet_id, domain_id, slot_id, operation_id, type, payload, created_at)
    SELECT (SELECT fleet_id FROM domains WHERE id = NEW.domain_id), NEW.domain_id, NEW.id, NULL,
           json_extract(value, '$.type'), json_extract(value, '$.payload'), NEW.updated_at
      FROM json_each(NEW.pending_events)
     ORDER BY CAST(key AS INTEGER);
    UPDATE slots SET pending_events = NULL WHERE id = NEW.id;
END
""",
    "trg_slots_insert_config_events": """
CREATE TRIGGER trg_slots_insert_config_events
AFTER INSERT ON slots
FOR EACH ROW
WHEN NEW.pending_events IS NOT NULL
BEGIN
    INSERT INTO events (fleet_id, domain_id, slot_id, operation_id, type, payload, created_at)
    SELECT (SELECT fleet_id FROM domains WHERE id = NEW.domain_id), NEW.domain_id, NEW.id, NULL,
           json_extract(value, '$.type'), json_extract(value, '$.payload'), NEW.updated_at
      FROM json_each(NEW.pending_events)
     ORDER BY CAST(key AS INTEGER);
    UPDATE slots SET pending_events = NULL WHERE id = NEW.id;
END
""",
    # An operation's insert appends its first events (as 0005's trigger does for its CAS).
    "trg_operations_insert_events": """
CREATE TRIGGER trg_operations_insert_events
AFTER INSERT ON operations
FOR EACH ROW
WHEN NEW.pending_events IS NOT NULL
BEGIN
    INSERT INTO events (fleet_id, domain_id, slot_id, operation_id, type, payload, created_at)
    SELECT NEW.fleet_id, NEW.target_domain_id, NULL, NEW.id,
           json_extract(value, '$.type'), json_extract(value, '$.payload'), NEW.created_at
      FROM json_each(NEW.pending_events)
     ORDER BY CAST(key AS INTEGER);
    UPDATE operations SET pending_events = NULL WHERE id = NEW.id;
END
""",
    # SQLite runs one writer at a time: a removal committed first is seen here.
    "trg_operations_target_not_removed": """
CREATE TRIGGER trg_operations_target_not_removed
BEFORE INSERT ON operations
FOR EACH ROW
WHEN (SELECT removed_at FROM domains WHERE id = NEW.target_domain_id) IS NOT NULL
BEGIN
    SELECT RAISE(IGNORE);
END
""",
}

_PG_FUNCTIONS = (
    """
CREATE FUNCTION haru_operation_target_not_removed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Waits for a removal of the target in progress; this statement then reads its outcome.
    PERFORM 1 FROM domains
     WHERE id = NEW.target_domain_id AND removed_at IS NULL
       FOR SHARE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$
""",
    """
CREATE TRIGGER trg_operations_target_not_removed
BEFORE INSERT ON operations
FOR EACH ROW EXECUTE FUNCTION haru_operation_target_not_removed()
""",
    f"""
CREATE FUNCTION haru_domain_removal_not_driven() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Runs with the row locked: an operation inserted meanwhile has committed and is seen.
    PERFORM 1 FROM operations
     WHERE state IN {_IN_FLIGHT}
       AND (target_domain_id = NEW.id OR source_domain_id = NEW.id);
    IF FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM fleets WHERE active_domain_id = NEW.id;
    IF FOUND THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$
""",
    """
CREATE TRIGGER trg_domains_removal_not_driven
BEFORE UPDATE OF removed_at ON domains
FOR EACH ROW
WHEN (OLD.removed_at IS NULL AND NEW.removed_at IS NOT NULL)
EXECUTE FUNCTION haru_domain_removal_not_driven()
""",
    f"""
CREATE FUNCTION haru_domain_config_not_driven() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM operations
     WHERE state IN {_IN_FLIGHT}
       AND (target_domain_id = NEW.id OR source_domain_id = NEW.id);
    IF FOUND THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$
""",
    f"""
CREATE FUNCTION haru_slot_config_not_driven() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A slot's write locks its domain row, as an operation's insert shares it.
    PERFORM 1 FROM domains WHERE id = NEW.domain_id FOR NO KEY UPDATE;
    PERFORM 1 FROM operations
     WHERE state IN {_IN_FLIGHT}
       AND (target_domain_id = NEW.domain_id OR source_domain_id = NEW.domain_id);
    IF FOUND THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END
$$
""",
    """
CREATE TRIGGER trg_domains_config_not_driven
BEFORE UPDATE OF config_revision ON domains
FOR EACH ROW
WHEN (NEW.config_revision <> OLD.config_revision)
EXECUTE FUNCTION haru_domain_config_not_driven()
""",
    """
CREATE TRIGGER trg_slots_config_not_driven
BEFORE UPDATE OF config_revision ON slots
FOR EACH ROW
WHEN (NEW.config_revision <> OLD.config_revision)
EXECUTE FUNCTION haru_slot_config_not_driven()
""",
)


def _when() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        # The rebuild drops and renames tables that others reference: haru_db.upgrade runs
        # SQLite migrations with foreign keys off and checks them all before the commit; the
        # legacy rename leaves the triggers that name the tables alone.
        op.execute("PRAGMA legacy_alter_table = ON")
    op.add_column("fleets", sa.Column("pending_events", sa.JSON(), nullable=True))
    for table, key, name in (
        ("domains", ["fleet_id", "slug"], "uq_domains_fleet_id_slug"),
        ("slots", ["domain_id", "gpu_index", "kind"], "uq_slots_domain_id_gpu_index_kind"),
    ):
        if sqlite:
            with op.batch_alter_table(table, recreate="always") as batch:
                batch.add_column(sa.Column("removed_at", _when(), nullable=True))
                batch.add_column(sa.Column("pending_events", sa.JSON(), nullable=True))
                batch.drop_constraint(name, type_="unique")
        else:
            op.add_column(table, sa.Column("removed_at", _when(), nullable=True))
            op.add_column(table, sa.Column("pending_events", sa.JSON(), nullable=True))
            op.drop_constraint(name, table, type_="unique")
        op.create_index(
            name,
            table,
            key,
            unique=True,
            postgresql_where=sa.text("removed_at IS NULL"),
            sqlite_where=sa.text("removed_at IS NULL"),
        )
    if sqlite:
        op.execute("PRAGMA legacy_alter_table = OFF")
        for ddl in _SQLITE_TRIGGERS.values():
            op.execute(ddl)
    else:
        for ddl in _PG_FUNCTIONS:
            op.execute(ddl)


def downgrade() -> None:
    """Back to 0011; refused (a unique violation) while a removed slug or GPU was added again."""
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        for name in reversed(_SQLITE_TRIGGERS):
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
        op.execute("PRAGMA legacy_alter_table = ON")
    else:
        op.execute("DROP TRIGGER IF EXISTS trg_slots_config_not_driven ON slots")
        op.execute("DROP TRIGGER IF EXISTS trg_domains_config_not_driven ON domains")
        op.execute("DROP FUNCTION IF EXISTS haru_slot_config_not_driven()")
        op.execute("DROP FUNCTION IF EXISTS haru_domain_config_not_driven()")
        op.execute("DROP TRIGGER IF EXISTS trg_domains_removal_not_driven ON domains")
        op.execute("DROP FUNCTION IF EXISTS haru_domain_removal_not_driven()")
        op.execute("DROP TRIGGER IF EXISTS trg_operations_target_not_removed ON operations")
        op.execute("DROP FUNCTION IF EXISTS haru_operation_target_not_removed()")
    for table, key, name in (
        ("slots", ["domain_id", "gpu_index", "kind"], "uq_slots_domain_id_gpu_index_kind"),
        ("domains", ["fleet_id", "slug"], "uq_domains_fleet_id_slug"),
    ):
        op.drop_index(name, table_name=table)
        if sqlite:
            with op.batch_alter_table(table, recreate="always") as batch:
                batch.drop_column("pending_events")
                batch.drop_column("removed_at")
                batch.create_unique_constraint(name, key)
        else:
            op.drop_column(table, "pending_events")
            op.drop_column(table, "removed_at")
            op.create_unique_constraint(name, table, key)
    if sqlite:
        op.execute("PRAGMA legacy_alter_table = OFF")
    op.drop_column("fleets", "pending_events")
