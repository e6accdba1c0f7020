"""Errors of haru-db.

Hierarchy::

    HaruDbError
    ├── StateStoreUnavailableError   (driver, connection or timeout failure of a statement)
    ├── StateStoreReadOnlyError      (the database would refuse writes: checked at start-up)
    ├── MalformedFleetStateError     (a stored row or JSON document fails validation)
    ├── ConstraintViolationError     (a write broke a schema constraint, e.g. an unknown id)
    ├── SchemaTooNewError            (the database is migrated past what this code knows)
    ├── SchemaOutdatedError          (the database is not migrated to this code's head)
    ├── LayoutFileError              (a layout file cannot be read or fails validation)
    └── BackupError                  (an online backup could not be taken)

``haru_core.InvalidTransitionError`` is not wrapped: a caller that asks for a (from, to) pair the
state tables forbid gets it unchanged, before any SQL runs.
"""

from __future__ import annotations


class HaruDbError(Exception):
    """Root of haru-db's exceptions."""


class StateStoreUnavailableError(HaruDbError):
    """The database could not run a statement (connection, driver or timeout failure).

    The message names the redacted database URL and the driver's error class; it never
    carries credentials. The original exception is chained as ``__cause__``.
    """


class StateStoreReadOnlyError(HaruDbError):
    """The database would refuse every write; raised by the start-up writability check.

    A read-only SQLite file or directory, or a read-only PostgreSQL session; the message
    says which.
    """


class MalformedFleetStateError(HaruDbError):
    """A stored row or JSON document fails validation; it is reported, never repaired."""


class ConstraintViolationError(HaruDbError):
    """A write broke a schema constraint (an unknown fleet, domain or slot id, a bad value).

    Expected races (a second in-flight operation, a duplicate layout row) are handled inside
    the repository and never surface as this error; it signals a caller bug.
    """


class DomainRemovedError(HaruDbError):
    """An operation was asked for a domain ``haru apply`` removed (no operation is created)."""

    def __init__(self, domain_id: object) -> None:
        super().__init__(f"domain {domain_id} was removed from its fleet")
        self.domain_id = domain_id


class SchemaTooNewError(HaruDbError):
    """The database's schema revision is unknown to this code (a newer release migrated it)."""

    def __init__(self, revision: str) -> None:
        super().__init__(
            f"database schema revision {revision!r} is unknown to this version of haru-db "
            "(it was migrated by a newer release); upgrade Haru instead of downgrading the schema"
        )
        self.revision = revision


class SchemaOutdatedError(HaruDbError):
    """The database is not migrated to this code's head revision (run ``haru db upgrade``)."""

    def __init__(self, revision: str | None, head: str) -> None:
        current = "no schema" if revision is None else f"revision {revision!r}"
        super().__init__(
            f"database has {current}, this code needs {head!r}; run `haru db upgrade` first"
        )
        self.revision = revision
        self.head = head


class LayoutFileError(HaruDbError):
    """A fleet layout file cannot be read, is not JSON, or fails validation."""


class BackupError(HaruDbError):
    """An online backup of the SQLite store could not be taken (the message says why)."""
