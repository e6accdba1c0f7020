"""join_url (never leaves the base origin or prefix) and the bearer-token helpers."""

from __future__ import annotations

import pytest
from haru_protocol import (
    HaruProtocolError,
    UrlJoinError,
    bearer_header,
    bearer_matches,
    join_url,
    normalize_token,
)

# ---- join_url ----


@pytest.mark.parametrize(
    ("base", "path", "expected"),
    [
        ("http://h:8000", "/v1/models", "http://h:8000/v1/models"),
        ("http://h:8000/", "/v1/models", "http://h:8000/v1/models"),
        (
            "http://h:8000/prefix",
            "/v1/chat/completions",
            "http://h:8000/prefix/v1/chat/completions",
        ),
        (
            "http://h:8000/prefix/",
            "v1/chat/completions",
            "http://h:8000/prefix/v1/chat/completions",
        ),
        (
            "http://h:8000/prefix?k=v",
            "/v1/chat/completions",
            "http://h:8000/prefix/v1/chat/completions?k=v",
        ),
        ("https://user@h.test/a/b?x=1&y=2", "/c", "https://user@h.test/a/b/c?x=1&y=2"),
        ("http://h:8000/prefix", "/v1/", "http://h:8000/prefix/v1/"),
        ("http://h:8000/prefix", "", "http://h:8000/prefix/"),
        ("http://h:8000/prefix", "//v1//sleep", None),
        ("http://h:8000/prefix#frag", "/x", "http://h:8000/prefix/x"),
        ("http://[::1]:8000/p", "/x", "http://[::1]:8000/p/x"),
        ("http://h/p", "/a%20b/c", "http://h/p/a%20b/c"),
    ],
)
def test_join_url(base: str, path: str, expected: str | None) -> None:
    if expected is None:
        with pytest.raises(UrlJoinError):
            join_url(base, path)
    else:
        assert join_url(base, path) == expected


@pytest.mark.parametrize(
    "path",
    [
        "http://evil.test/x",
        "https://evil.test",
        "//evil.test/x",
        "///x",
        "mailto:a@b",
        "file:///etc/passwd",
        "/v1/../admin",
        "../admin",
        "/v1/./x",
        "..",
        "/%2e%2e/admin",
        "/a/%2E%2E/b",
        "/.%2e/x",
        "/%2e/x",
        "/v1?debug=1",
        "/v1#frag",
        "?x=1",
        "/v1?",
    ],
)
def test_join_url_refuses_escapes(path: str) -> None:
    with pytest.raises(UrlJoinError) as info:
        join_url("http://h:8000/prefix?k=v", path)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, HaruProtocolError)


@pytest.mark.parametrize("base", ["h:8000", "/relative", "file:///x", "ftp://h/x", "http://", ""])
def test_join_url_refuses_bad_base(base: str) -> None:
    with pytest.raises(UrlJoinError, match="base URL"):
        join_url(base, "/v1")


def test_dots_inside_segment_names_are_fine() -> None:
    assert join_url("http://h/p", "/v1.0/..x/a..b") == "http://h/p/v1.0/..x/a..b"


# ---- bearer tokens ----


@pytest.mark.parametrize("expected", [None, "", "   ", "\t\n"])
@pytest.mark.parametrize("header", [None, "", "Bearer x", "Basic abc"])
def test_blank_expected_token_means_open(expected: str | None, header: str | None) -> None:
    assert bearer_matches(header, expected)


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer s3cret", True),
        ("bearer s3cret", True),
        ("BEARER s3cret", True),
        ("BeArEr s3cret", True),
        ("  Bearer s3cret  ", True),
        ("Bearer  s3cret", True),
        ("Bearer s3cret2", False),
        ("Bearer s3cre", False),
        ("Bearer S3CRET", False),
        ("Bearer", False),
        ("Bearer ", False),
        ("s3cret", False),
        ("Basic s3cret", False),
        ("Token s3cret", False),
        ("Bearers3cret", False),
        ("", False),
        (None, False),
        ("Bearer sécret", False),
    ],
)
def test_bearer_matches(header: str | None, ok: bool) -> None:
    assert bearer_matches(header, "s3cret") is ok


def test_expected_token_is_trimmed() -> None:
    assert bearer_matches("Bearer s3cret", "  s3cret\n")


def test_normalize_token() -> None:
    assert normalize_token(None) is None
    assert normalize_token("") is None
    assert normalize_token("  ") is None
    assert normalize_token(" t ") == "t"


def test_bearer_header() -> None:
    assert bearer_header(" t ") == {"Authorization": "Bearer t"}
    assert bearer_header("") == {}
    assert bearer_header(None) == {}
    token = "abc.def"
    assert bearer_matches(bearer_header(token)["Authorization"], token)


def test_a_token_that_was_not_utf8_on_the_wire_does_not_match() -> None:
    # An HTTP server keeps undecodable header bytes as lone surrogates.
    header = b"Bearer \xffs3cret".decode("utf-8", "surrogateescape")
    assert bearer_matches(header, "s3cret") is False
