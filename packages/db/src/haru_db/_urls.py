"""Database URL forms: one string picks the engine (PostgreSQL or the embedded SQLite file)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

Dialect = Literal["sqlite", "postgresql"]
"""The two engines of DESIGN 5.1."""

DEFAULT_DATABASE_FILE = "haru.db"
"""File name of the embedded SQLite database (in the working directory) when no URL is given."""

POSTGRES_DRIVER = "postgresql+psycopg"
SQLITE_DRIVER = "sqlite+aiosqlite"

_POSTGRES_SCHEMES = frozenset({"postgresql", "postgres", "postgresql+psycopg"})
_SQLITE_SCHEMES = frozenset({"sqlite", "sqlite+aiosqlite"})
_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_USERINFO_PASSWORD_RE = re.compile(r"(://[^:/@?#]*):[^@/?#]*@")
_QUERY_PASSWORD_RE = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)
_SECRET_QUERY_KEYS = frozenset({"password"})


def resolve_database_url(url: str | None, *, default_path: str = DEFAULT_DATABASE_FILE) -> str:
    """Turn what an operator wrote into the SQLAlchemy async URL haru-db connects with.

    Args:
        url: ``postgresql://...`` (also ``postgres://`` and ``postgresql+psycopg://``),
            ``sqlite:///path`` (also ``sqlite+aiosqlite:///path``), a bare filesystem path, or
            ``None``/blank for the embedded default file.
        default_path: The SQLite file used when ``url`` is unset, relative to the working
            directory.

    Returns:
        ``postgresql+psycopg://...`` or ``sqlite+aiosqlite:///<absolute path>``.

    Raises:
        ValueError: Another scheme or driver, a malformed URL, or an in-memory SQLite database
            (its state would vanish with the connection). The message is redacted.
    """
    text = (url or "").strip()
    if not text:
        return _sqlite_url(default_path, query={})
    if not _SCHEME_RE.match(text):
        if text == ":memory:":
            raise ValueError("an in-memory SQLite database cannot hold Haru's state")
        return _sqlite_url(text, query={})
    try:
        parsed = make_url(text)
    except (ArgumentError, ValueError) as exc:
        raise ValueError(f"malformed database URL {redact_database_url(text)!r}") from exc
    scheme = parsed.drivername.lower()
    if scheme in _POSTGRES_SCHEMES:
        return parsed.set(drivername=POSTGRES_DRIVER).render_as_string(hide_password=False)
    if scheme in _SQLITE_SCHEMES:
        if not parsed.database or parsed.database == ":memory:":
            raise ValueError("an in-memory SQLite database cannot hold Haru's state")
        return _sqlite_url(parsed.database, query=dict(parsed.query))
    raise ValueError(
        f"unsupported database URL {redact_database_url(text)!r}: use postgresql://..., "
        "sqlite:///path or a file path"
    )


def dialect_of(url: str) -> Dialect:
    """The engine a resolved URL (from :func:`resolve_database_url`) connects to."""
    return "postgresql" if make_url(url).get_backend_name() == "postgresql" else "sqlite"


def redact_database_url(url: str) -> str:
    """The URL with its password (user-info or ``password=`` query key) replaced by ``***``.

    Safe for log lines and error messages; a bare path is returned unchanged.
    """
    if not _SCHEME_RE.match(url.strip()):
        return url
    try:
        rendered = make_url(url.strip()).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        rendered = _USERINFO_PASSWORD_RE.sub(r"\1:***@", url)
    return _QUERY_PASSWORD_RE.sub(r"\1***", rendered)


def secrets_of(url: str) -> tuple[str, ...]:
    """Every credential string in ``url`` (to scrub from driver messages)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return ()
    found: list[str] = []
    if parsed.password:
        found.append(str(parsed.password))
    for key, value in parsed.query.items():
        if key.lower() in _SECRET_QUERY_KEYS:
            found.extend([value] if isinstance(value, str) else list(value))
    return tuple(s for s in found if s)


def _sqlite_url(path: str, *, query: dict[str, str | tuple[str, ...]]) -> str:
    # An absolute path makes every process (server, CLI, tests) open the same file whatever
    # its working directory, and makes the boot message unambiguous.
    absolute = Path(os.path.expanduser(path)).absolute()
    return URL.create(SQLITE_DRIVER, database=str(absolute), query=query).render_as_string(
        hide_password=False
    )
