"""Haru state store: SQLAlchemy tables, Alembic migrations and compare-and-swap repository."""

__all__: tuple[str, ...] = ()
