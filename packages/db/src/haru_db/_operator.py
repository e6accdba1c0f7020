"""Operator helpers the server's ``haru`` CLI calls (``haru db upgrade``, ``haru seed``)."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

from haru_protocol import FleetLayout
from pydantic import ValidationError

from haru_db._errors import LayoutFileError
from haru_db._migrate import check_schema
from haru_db._store import LayoutApplyResult, StateStore


def load_layout_file(path: str | os.PathLike[str]) -> FleetLayout:
    """Read and validate a fleet layout document (DESIGN 3.4; strict: unknown keys are errors).

    Raises:
        LayoutFileError: The file cannot be read, is not JSON, or fails validation. The
            message lists every failing location.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LayoutFileError(f"cannot read layout {str(file)!r}: {exc}") from exc
    try:
        return FleetLayout.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors(include_url=False)
        )
        raise LayoutFileError(f"layout {str(file)!r} is invalid: {problems}") from exc


async def seed_layout_file(
    url: str | None,
    path: str | os.PathLike[str],
    *,
    at: datetime | None = None,
) -> LayoutApplyResult:
    """Apply the layout in ``path`` to the database at ``url`` (idempotent and additive).

    Args:
        url: Any form :func:`haru_db.resolve_database_url` accepts.
        path: A JSON fleet layout.
        at: The time written on created rows (default: the database's clock, now).

    Raises:
        LayoutFileError: The layout cannot be read or is invalid (nothing is written).
        SchemaOutdatedError: The database is not migrated (run ``haru db upgrade``).
        SchemaTooNewError: The database was migrated by a newer release.
        StateStoreUnavailableError: The database cannot be reached.
    """
    layout = load_layout_file(path)
    await check_schema(url)
    store = StateStore.open(url)
    try:
        return await store.apply_fleet_layout(
            layout, at=at if at is not None else await store.database_now()
        )
    finally:
        await store.close()
