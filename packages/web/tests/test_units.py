"""Pure pieces: host names, tokens, validation summaries, the rate-limited log."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from haru_protocol import WireModel
from haru_web import (
    MIN_TOKEN_LENGTH,
    RateLimitedLog,
    TokenConfigError,
    check_token,
    describe_validation_error,
    is_loopback_host,
    resolve_token,
)
from pydantic import ValidationError


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("LOCALHOST:8700", True),
        ("app.localhost", True),
        ("127.0.0.1", True),
        ("127.1.2.3:80", True),
        ("[::1]:8701", True),
        ("::1", True),
        ("evil.example", False),
        ("localhost.evil.example", False),
        ("10.0.0.1:8700", False),
        ("[::2]", False),
        ("", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_tokens_are_trimmed_and_short_ones_refused() -> None:
    assert check_token("  " + "a" * MIN_TOKEN_LENGTH + "\n", name="T") == "a" * MIN_TOKEN_LENGTH
    assert check_token("   ", name="T") is None
    assert check_token(None, name="T") is None
    with pytest.raises(TokenConfigError, match="T is 3 characters long") as err:
        check_token("bin", name="T")
    assert "bin" not in str(err.value)


def test_token_files(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_text("file-token-0123456789\n")
    assert resolve_token({"T_FILE": str(path)}, "T") == "file-token-0123456789"
    assert resolve_token({"T": " inline-0123456789ab "}, "T") == "inline-0123456789ab"
    assert resolve_token({}, "T") is None
    with pytest.raises(TokenConfigError, match="not both"):
        resolve_token({"T_FILE": str(path), "T": "inline-0123456789ab"}, "T")
    with pytest.raises(TokenConfigError, match="T_FILE: cannot read"):
        resolve_token({"T_FILE": str(tmp_path / "missing")}, "T")
    path.write_text("\n")
    with pytest.raises(TokenConfigError, match="is empty"):
        resolve_token({"T_FILE": str(path)}, "T")


class Many(WireModel):
    """Five required fields."""

    a: int
    b: int
    c: int
    d: int
    e: int


def test_a_400_names_three_errors_and_counts_the_rest() -> None:
    with pytest.raises(ValidationError) as err:
        Many.model_validate({"a": "secret-input", "b": "x"})
    text = describe_validation_error(err.value)
    assert text.count(": ") == 4  # the prefix and three errors
    assert text.endswith("(and 2 more)")
    assert "secret-input" not in text


def test_the_rate_limited_log_counts_what_it_drops(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("t"), burst=2, window_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        for _ in range(5):
            log.warning("bad %s", "x")
        now[0] = 10.0
        log.warning("bad %s", "y")
    assert [r.getMessage() for r in caplog.records] == [
        "bad x",
        "bad x",
        "bad y (3 similar lines suppressed)",
    ]
