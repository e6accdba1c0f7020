"""Hostile clients at the listener: undecodable tokens, forged log lines, floods of half-sent
heads from one address, and ``X-Forwarded-For`` from whoever sends it. Real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web
from haru_web import (
    ServerLimits,
    bearer_middleware,
    configure_logging,
    error_middleware,
    forwarded_client,
    parse_trusted_proxies,
    peer_group,
    serving,
)

TOKEN = "edge-test-token-0123456789abcdef"
READ_S = 5.0  # generous: only a hang makes it expire
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
HALF_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def build_app() -> web.Application:
    app = web.Application(middlewares=[error_middleware, bearer_middleware(TOKEN)])

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/thing", healthz)
    return app


@contextlib.asynccontextmanager
async def serve(**limits: object) -> AsyncIterator[int]:
    bounds = ServerLimits(**{"header_timeout_s": 30.0, **limits})  # type: ignore[arg-type]
    async with serving(
        build_app(), host="127.0.0.1", port=0, limits=bounds, shutdown_timeout=1.0
    ) as listening:
        yield listening.port


@pytest.fixture
def log_text() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = configure_logging(log_format="text", level=logging.INFO, stream=stream)
    try:
        yield stream
    finally:
        logging.getLogger().removeHandler(handler)


async def exchange(port: int, raw: bytes, *, source: str = "127.0.0.1") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), READ_S)
    finally:
        writer.close()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), READ_S) is not None
    except ConnectionError:
        return True


async def test_a_bearer_token_that_is_not_utf8_is_a_plain_401(
    log_text: io.StringIO, caplog: pytest.LogCaptureFixture
) -> None:
    raw = b"GET /v1/thing HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    async with serve() as port:
        for token in (b"\xff\xfe" + TOKEN.encode(), TOKEN.encode() + b"\xc3\x28", b"\x80" * 20):
            answer = await exchange(port, raw + b"Authorization: Bearer " + token + b"\r\n\r\n")
            assert status_of(answer) == 401, answer
            body = json.loads(answer.partition(b"\r\n\r\n")[2])
            assert body["error"]["code"] == "unauthorized"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "Traceback" not in log_text.getvalue()


async def test_half_sent_heads_of_one_peer_do_not_lock_out_another(
    log_text: io.StringIO,
) -> None:
    # The per-peer bound is above the cap: the global eviction alone must keep room.
    async with serve(max_connections=20, max_connections_per_peer=1000) as port:
        flood = []
        for _ in range(200):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=("127.0.0.2", 0)
            )
            writer.write(HALF_HEAD)
            flood.append((reader, writer))
        for _, writer in flood:
            await writer.drain()
        # The server evicted all but the cap's worth (an event, not a sleep).
        evicted = await asyncio.gather(*(closed_by_server(r) for r, _ in flood[:180]))
        assert all(evicted)
        for _ in range(3):
            answer = await exchange(port, HEALTHZ, source="127.0.0.1")
            assert status_of(answer) == 200, answer
        for _, writer in flood:
            writer.close()
    assert "closing an idle or half-sent connection of 127.0.0.2" in log_text.getvalue()


async def test_the_per_peer_bound_keeps_one_address_to_its_share() -> None:
    others = []
    async with serve(max_connections=50, max_connections_per_peer=5) as port:
        flood = []
        for _ in range(40):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=("127.0.0.2", 0)
            )
            writer.write(HALF_HEAD)
            flood.append((reader, writer))
        # 35 of the 40 were evicted by the peer's own newer connections.
        assert all(await asyncio.gather(*(closed_by_server(r) for r, _ in flood[:35])))
        # Another address is not limited by that peer's bound.
        for _ in range(10):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=("127.0.0.3", 0)
            )
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            others.append((reader, writer))
        for reader, _ in others:
            line = await asyncio.wait_for(reader.readline(), READ_S)
            assert line.startswith(b"HTTP/1.1 200")
        answer = await exchange(port, HEALTHZ, source="127.0.0.1")
        assert status_of(answer) == 200
        for _, writer in flood + others:
            writer.close()


def test_forwarded_for_is_read_only_from_trusted_proxies() -> None:
    trusted = parse_trusted_proxies("10.0.0.0/8, 192.0.2.7")
    assert forwarded_client("127.0.0.1", "203.0.113.9", trusted) == "127.0.0.1"
    assert forwarded_client("127.0.0.1", "203.0.113.9", ()) == "127.0.0.1"
    assert forwarded_client("192.0.2.7", "203.0.113.9", trusted) == "203.0.113.9"
    # Right to left past trusted hops; what the client itself wrote further left is ignored.
    assert forwarded_client("10.1.1.1", "1.1.1.1, 203.0.113.9, 10.2.2.2", trusted) == (
        "203.0.113.9"
    )
    # A non-address entry stops the walk at the proxy that passed it on.
    assert forwarded_client("10.1.1.1", "203.0.113.9, evil\r\nx", trusted) == "10.1.1.1"
    assert forwarded_client("10.1.1.1", "10.3.3.3", trusted) == "10.3.3.3"
    assert forwarded_client("::ffff:10.1.1.1", "2001:db8::1", trusted) == "2001:db8::1"
    assert forwarded_client(None, "203.0.113.9", trusted) == "-"
    with pytest.raises(ValueError, match="not an IP address"):
        parse_trusted_proxies("10.0.0.0/8, proxy.example")
    assert parse_trusted_proxies(" , ") == ()


def test_ipv6_peers_count_by_their_64() -> None:
    assert peer_group("2001:db8:1:2:aaaa::1") == peer_group("2001:db8:1:2:bbbb::2")
    assert peer_group("2001:db8:1:3::1") != peer_group("2001:db8:1:2::1")
    assert peer_group("::ffff:192.0.2.1") == "192.0.2.1"
    assert peer_group(None) == "-"


def _fail(message: str) -> None:
    raise ValueError(message)


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_every_format_escapes_control_characters(log_format: str) -> None:
    stream = io.StringIO()
    handler = configure_logging(log_format=log_format, level=logging.INFO, stream=stream)  # type: ignore[arg-type]
    try:
        logger = logging.getLogger("haru_web.test")
        forged = "2026-01-01 00:00:00,000 WARNING haru_server: forged"
        logger.info(
            "GET %s", f"/a\r\n{forged}\x1b[2J\u2028\u202e\udcff", extra={"path": f"/a\n{forged}"}
        )
        try:
            _fail(f"bad\n{forged}")
        except ValueError:
            logger.exception("failed on %s", "x\ny")
    finally:
        logging.getLogger().removeHandler(handler)
    text = stream.getvalue()
    for char in "\r\x1b\u2028\u202e\udcff":
        assert char not in text
    lines = text.splitlines()
    assert not [line for line in lines if line.startswith(forged)]
    if log_format == "json":
        records = [json.loads(line) for line in lines]
        assert records[0]["message"] == (f"GET /a\\r\\n{forged}\\x1b[2J\\u2028\\u202e\\udcff")
        assert records[0]["path"] == f"/a\\n{forged}"
        assert records[1]["message"] == "failed on x\\ny"
    else:
        assert lines[0].endswith(f"GET /a\\r\\n{forged}\\x1b[2J\\u2028\\u202e\\udcff")
        assert lines[1].endswith("failed on x\\ny")
        # The traceback keeps its lines, indented: the exception's text starts none.
        assert all(line.startswith("    ") for line in lines[2:])
        assert f"    {forged}" in lines
