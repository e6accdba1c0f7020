from __future__ import annotations

from pathlib import Path

import pytest
from haru_db import redact_database_url, resolve_database_url


def test_no_url_is_the_embedded_default_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    expected = f"sqlite+aiosqlite:///{tmp_path / 'haru.db'}"
    assert resolve_database_url(None) == expected
    assert resolve_database_url("  ") == expected
    assert resolve_database_url(None, default_path="state/x.db") == (
        f"sqlite+aiosqlite:///{tmp_path / 'state' / 'x.db'}"
    )


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://u:p@db:5432/haru", "postgresql+psycopg://u:p@db:5432/haru"),
        (
            "postgres://u:p@db/haru?sslmode=require",
            "postgresql+psycopg://u:p@db/haru?sslmode=require",
        ),
        ("postgresql+psycopg://u@db/haru", "postgresql+psycopg://u@db/haru"),
        (" postgresql://db/haru ", "postgresql+psycopg://db/haru"),
        ("sqlite:////var/lib/haru/state.db", "sqlite+aiosqlite:////var/lib/haru/state.db"),
        (
            "sqlite+aiosqlite:////var/lib/haru/state.db",
            "sqlite+aiosqlite:////var/lib/haru/state.db",
        ),
        ("/var/lib/haru/state.db", "sqlite+aiosqlite:////var/lib/haru/state.db"),
    ],
)
def test_url_forms(given: str, expected: str) -> None:
    assert resolve_database_url(given) == expected


def test_relative_forms_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_database_url("sqlite:///rel.db") == f"sqlite+aiosqlite:///{tmp_path / 'rel.db'}"
    assert resolve_database_url("data/rel.db") == f"sqlite+aiosqlite:///{tmp_path / 'data/rel.db'}"


def test_a_password_with_reserved_characters_survives() -> None:
    resolved = resolve_database_url("postgres://us%40er:p%3A%2Fss@db/haru")
    assert resolved == "postgresql+psycopg://us%40er:p%3A%2Fss@db/haru"


def test_a_path_with_a_question_mark_is_not_a_query() -> None:
    resolved = resolve_database_url("/srv/odd?name.db")
    assert resolved == "sqlite+aiosqlite:////srv/odd%3Fname.db"


@pytest.mark.parametrize(
    "given",
    [
        "mysql://u:secret@db/haru",
        "postgresql+asyncpg://u:secret@db/x",
        "sqlite://",
        ":memory:",
        "sqlite:///:memory:",
        "redis://u:secret@host",
    ],
)
def test_unsupported_urls_are_rejected_without_the_password(given: str) -> None:
    with pytest.raises(ValueError, match=r"unsupported|in-memory") as caught:
        resolve_database_url(given)
    assert "secret" not in str(caught.value)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql+psycopg://u:s3cret@db:5432/haru", "postgresql+psycopg://u:***@db:5432/haru"),
        (
            "postgresql://u@db/haru?password=s3cret&sslmode=require",
            "postgresql://u@db/haru?password=***&sslmode=require",
        ),
        ("postgresql://db/haru", "postgresql://db/haru"),
        ("/var/lib/haru.db", "/var/lib/haru.db"),
        ("sqlite+aiosqlite:////var/lib/haru.db", "sqlite+aiosqlite:////var/lib/haru.db"),
    ],
)
def test_redaction(given: str, expected: str) -> None:
    assert redact_database_url(given) == expected


def test_redaction_of_an_unparseable_url_still_hides_the_password() -> None:
    redacted = redact_database_url("postgresql://u:s3cret@db:notaport/haru")
    assert "s3cret" not in redacted
    assert "***" in redacted
