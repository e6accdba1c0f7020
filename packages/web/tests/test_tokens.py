"""Token files followed without a restart: :class:`TokenSource` on a fake monotonic clock."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from haru_web import (
    ServerLimits,
    TokenConfigError,
    TokenSource,
    bearer_middleware,
    error_middleware,
    serving,
    token_source,
)

OLD = "old-token-0123456789abcdef"
NEW = "new-token-0123456789abcdef"
NAME = "HARU_TEST_TOKEN_FILE"


class FakeMonotonic:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def write(path: Path, text: str) -> None:
    """Replace the file as an operator's tooling does: a new file renamed over the old."""
    staged = path.with_suffix(".new")
    staged.write_text(text, encoding="utf-8")
    os.replace(staged, path)


def bearer(token: str) -> str:
    return f"Bearer {token}"


@pytest.fixture
def clock() -> FakeMonotonic:
    return FakeMonotonic()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(OLD + "\n", encoding="utf-8")
    return path


def follow(path: Path, clock: FakeMonotonic, *, overlap_s: float = 0.0) -> TokenSource:
    return TokenSource.from_file(path, name=NAME, monotonic=clock, overlap_s=overlap_s)


def test_a_rotated_file_is_used_once_a_look_is_due(
    token_file: Path, clock: FakeMonotonic, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="haru_web")
    source = follow(token_file, clock)
    assert source.current() == OLD
    write(token_file, f"  {NEW}\n")
    clock.advance(0.5)
    assert source.current() == OLD  # looked at most once a second
    assert source.matches(bearer(OLD))
    clock.advance(0.5)
    assert source.current() == NEW
    assert source.matches(bearer(NEW))
    assert not source.matches(bearer(OLD))  # no overlap by default
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert f"{NAME} changed: the new token is in use" in caplog.text
    assert OLD not in caplog.text
    assert NEW not in caplog.text


def test_a_file_rewritten_in_place_is_seen_too(token_file: Path, clock: FakeMonotonic) -> None:
    source = follow(token_file, clock)
    with token_file.open("w", encoding="utf-8") as handle:  # same inode, new size
        handle.write(NEW + "-longer")
    clock.advance(1)
    assert source.current() == NEW + "-longer"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("", "is empty"),
        ("   \n", "is empty"),
        ("short", "5 characters long"),
        (None, "cannot read"),
    ],
)
def test_an_unusable_new_file_keeps_the_old_token_and_warns_once(
    token_file: Path,
    clock: FakeMonotonic,
    caplog: pytest.LogCaptureFixture,
    content: str | None,
    reason: str,
) -> None:
    caplog.set_level(logging.INFO, logger="haru_web")
    source = follow(token_file, clock)
    if content is None:
        token_file.unlink()
    else:
        write(token_file, content)
    for _ in range(3):  # three looks at the same bad file: one warning
        clock.advance(1)
        assert source.current() == OLD
        assert source.matches(bearer(OLD))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert reason in warnings[0].getMessage()
    assert "keeping the previous token" in warnings[0].getMessage()
    assert str(token_file) in warnings[0].getMessage()
    assert OLD not in caplog.text
    if content and content.strip():
        assert content.strip() not in caplog.text
    write(token_file, NEW)  # fixed: the next look takes it
    clock.advance(1)
    assert source.current() == NEW


def test_a_file_made_readable_again_is_read(
    token_file: Path, clock: FakeMonotonic, caplog: pytest.LogCaptureFixture
) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    source = follow(token_file, clock)
    write(token_file, NEW)
    token_file.chmod(0)
    clock.advance(1)
    assert source.current() == OLD
    assert "Permission denied" in caplog.text
    token_file.chmod(0o600)  # the content and mtime are unchanged: only ctime moves
    clock.advance(1)
    assert source.current() == NEW


def test_the_previous_token_matches_within_the_overlap_only(
    token_file: Path, clock: FakeMonotonic, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="haru_web")
    source = follow(token_file, clock, overlap_s=30)
    write(token_file, NEW)
    clock.advance(1)
    assert source.current() == NEW
    assert source.matches(bearer(NEW))
    assert source.matches(bearer(OLD))
    assert not source.matches(bearer("third-token-0123456789"))
    assert not source.matches(None)
    clock.advance(29.9)
    assert source.matches(bearer(OLD))
    clock.advance(0.1)
    assert not source.matches(bearer(OLD))
    assert source.matches(bearer(NEW))
    assert "the previous one is accepted for 30 s more" in caplog.text


def test_the_same_token_written_again_changes_nothing(
    token_file: Path, clock: FakeMonotonic, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="haru_web")
    source = follow(token_file, clock, overlap_s=30)
    write(token_file, OLD + "\n\n")
    clock.advance(1)
    assert source.current() == OLD
    assert caplog.records == []


def test_a_source_built_from_an_old_token_reads_its_file_at_the_first_look(
    token_file: Path, clock: FakeMonotonic
) -> None:
    # A service parses its settings first and builds its sources later: the file may have
    # changed in between.
    write(token_file, NEW)
    source = TokenSource(OLD, path=token_file, name=NAME, monotonic=clock)
    assert source.current() == OLD
    clock.advance(1)
    assert source.current() == NEW


def test_a_source_whose_file_is_gone_at_the_first_look_warns(
    token_file: Path, clock: FakeMonotonic, caplog: pytest.LogCaptureFixture
) -> None:
    token_file.unlink()
    source = TokenSource(OLD, path=token_file, name=NAME, monotonic=clock)
    clock.advance(1)
    assert source.current() == OLD
    assert "cannot read" in caplog.text


def test_constant_sources_and_sources_from_the_environment(
    token_file: Path, clock: FakeMonotonic
) -> None:
    constant = TokenSource.constant(OLD)
    assert constant.path is None
    assert constant.current() == OLD
    inline = token_source({"T": OLD}, "T")
    assert inline is not None
    assert inline.path is None
    assert token_source({}, "T") is None
    followed = token_source({"T_FILE": str(token_file)}, "T", monotonic=clock)
    assert followed is not None
    assert followed.path == token_file
    write(token_file, NEW)
    clock.advance(1)
    assert followed.current() == NEW
    with pytest.raises(TokenConfigError, match="not both"):
        token_source({"T_FILE": str(token_file), "T": OLD}, "T")
    with pytest.raises(TokenConfigError, match="cannot read"):
        token_source({"T_FILE": str(token_file.with_name("missing"))}, "T")


async def test_the_bearer_middleware_asks_the_source_on_every_request(
    token_file: Path,
) -> None:
    # A real clock and a real socket: the new token opens the API without a restart.
    source = TokenSource.from_file(token_file, name=NAME, recheck_s=0)
    app = web.Application(middlewares=[error_middleware, bearer_middleware(source)])

    async def thing(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app.router.add_get("/v1/thing", thing)
    async with (
        serving(app, host="127.0.0.1", port=0, limits=ServerLimits(), shutdown_timeout=1) as up,
        aiohttp.ClientSession() as http,
    ):

        async def status(token: str) -> int:
            headers = {"Authorization": bearer(token)}
            async with http.get(f"{up.url}/v1/thing", headers=headers) as r:
                return r.status

        assert await status(OLD) == 200
        assert await status(NEW) == 401
        write(token_file, NEW)
        assert await status(NEW) == 200
        assert await status(OLD) == 401
