"""Slow clients, connection caps and protocol errors, on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager as AsyncContextManager

import pytest
from aiohttp import web
from haru_protocol import WireModel
from haru_web import (
    Listening,
    ServerLimits,
    bearer_middleware,
    browser_guard_middleware,
    error_middleware,
    parse_body,
    serving,
)

TOKEN = "web-test-token-0123456789abcdef"


class Echo(WireModel):
    """A body with one required field."""

    name: str


def build_app(*, token: str | None, gate: asyncio.Event | None = None) -> web.Application:
    app = web.Application(
        middlewares=[
            error_middleware,
            browser_guard_middleware(open_api=token is None),
            bearer_middleware(token),
        ]
    )

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def echo(request: web.Request) -> web.Response:
        body = await parse_body(request, Echo, limit=1024)
        return web.json_response({"name": body.name})

    async def wait(_request: web.Request) -> web.Response:
        assert gate is not None
        await gate.wait()
        return web.json_response({"waited": True})

    app.router.add_get("/healthz", healthz)
    app.router.add_post("/v1/echo", echo)
    app.router.add_get("/v1/wait", wait)
    return app


Serve = Callable[..., AsyncContextManager[Listening]]


@pytest.fixture
def serve() -> Serve:
    @contextlib.asynccontextmanager
    async def run(
        *, token: str | None = None, gate: asyncio.Event | None = None, **limits: float
    ) -> AsyncIterator[Listening]:
        app = build_app(token=token, gate=gate)
        bounds = ServerLimits(**limits)  # type: ignore[arg-type]
        async with serving(
            app, host="127.0.0.1", port=0, limits=bounds, shutdown_timeout=1.0
        ) as listening:
            yield listening

    return run


READ_S = 5.0  # generous: only a hang makes it expire


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def read_all(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.read(), READ_S)


def split(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


async def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await connect(port)
    writer.write(raw)
    await writer.drain()
    try:
        return split(await read_all(reader))
    finally:
        writer.close()


async def test_a_half_sent_head_is_answered_408_and_closed(serve: Serve) -> None:
    async with serve(header_timeout_s=0.2) as listening:
        reader, writer = await connect(listening.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        await writer.drain()
        status, headers, body = split(await read_all(reader))
        writer.close()
    assert status == 408
    assert headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_timeout"


async def test_a_connection_that_sends_nothing_is_closed(serve: Serve) -> None:
    async with serve(header_timeout_s=0.2) as listening:
        reader, writer = await connect(listening.port)
        status, _, _ = split(await read_all(reader))
        writer.close()
    assert status == 408


async def test_a_stalled_body_is_cut_after_the_idle_bound(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with serve(body_idle_timeout_s=0.2, header_timeout_s=5) as listening:
        reader, writer = await connect(listening.port)
        writer.write(
            b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"name": '
        )
        await writer.drain()
        assert await read_all(reader) == b""
        writer.close()
    assert "request body silent" in caplog.text
    assert "499 POST /v1/echo" in caplog.text


async def test_a_body_that_keeps_coming_is_not_cut(serve: Serve) -> None:
    async with serve(body_idle_timeout_s=0.3, header_timeout_s=5) as listening:
        reader, writer = await connect(listening.port)
        payload = b'{"name": "' + b"x" * 8 + b'"}'
        writer.write(
            b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n"
        )
        for byte in payload:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.02)
        status, _, body = split(await read_all(reader))
        writer.close()
    assert status == 200
    assert json.loads(body) == {"name": "xxxxxxxx"}


async def test_idle_connections_over_the_cap_do_not_starve_healthz(serve: Serve) -> None:
    async with serve(max_connections=4, header_timeout_s=30) as listening:
        idle = [await connect(listening.port) for _ in range(8)]
        await asyncio.sleep(0)  # let the server accept them all
        for _ in range(3):
            status, _, body = await exchange(
                listening.port,
                b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
            )
            assert status == 200
            assert json.loads(body) == {"ok": True}
        # The evicted ones were closed cleanly (EOF), the others are still open.
        closed = 0
        for reader, writer in idle:
            try:
                data = await asyncio.wait_for(reader.read(), 0.05)
            except TimeoutError:
                data = None
            closed += data == b""
            writer.close()
    # 8 idle + 3 probes through a cap of 4: at least 5 evicted, and never one in use.
    assert 5 <= closed <= 7


async def test_busy_connections_at_the_cap_get_a_clean_503(serve: Serve) -> None:
    gate = asyncio.Event()
    async with serve(max_connections=2, gate=gate) as listening:
        busy = []
        for _ in range(2):
            reader, writer = await connect(listening.port)
            writer.write(b"GET /v1/wait HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await writer.drain()
            busy.append((reader, writer))
        await asyncio.sleep(0.05)
        reader, writer = await connect(listening.port)
        status, _headers, body = split(await read_all(reader))
        writer.close()
        gate.set()
        for r, w in busy:
            assert (await asyncio.wait_for(r.readline(), READ_S)).startswith(b"HTTP/1.1 200")
            w.close()
    assert status == 503
    assert json.loads(body)["error"]["code"] == "overloaded"


@pytest.mark.parametrize(
    "line", [b"GET /healthz HTTP/2.0", b"GET /healthz HTTP/0.9", b"GET /healthz"]
)
async def test_http_versions_other_than_1_0_and_1_1_are_refused(serve: Serve, line: bytes) -> None:
    async with serve() as listening:
        status, _, body = await exchange(listening.port, line + b"\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 505
    assert json.loads(body)["error"]["code"] == "http_version_not_supported"


FUZZ = [
    b"GET /v1/echo HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() + b"\x01\r\n\r\n",
    b"GET /v1/echo HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode() * 400 + b"\r\n\r\n",
    b"GET /v1/echo?t=" + TOKEN.encode() * 400 + b" HTTP/1.1\r\n\r\n",
    b"G\x00T /" + TOKEN.encode() + b" HTTP/1.1\r\n\r\n",
    b"GET /" + TOKEN.encode() + b" HTTP/7.7\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-" + TOKEN.encode() + b"\x7f: 1\r\n\r\n",
    b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: x"
    + TOKEN.encode()
    + b"\r\n\r\n",
    b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz"
    + TOKEN.encode()
    + b"\r\n",
    b"\x16\x03\x01" + TOKEN.encode(),
]


async def test_protocol_errors_never_echo_or_log_the_token(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    answers: list[bytes] = []
    async with serve(token=TOKEN) as listening:
        for _ in range(3):
            for raw in FUZZ:
                reader, writer = await connect(listening.port)
                writer.write(raw)
                await writer.drain()
                answers.append(await read_all(reader))
                writer.close()
    assert all(answers)
    for answer in answers:
        status, headers, body = split(answer)
        assert 400 <= status < 600
        assert headers["content-type"].startswith("application/json")
        assert set(json.loads(body)["error"]) == {"code", "message"}
    secret = TOKEN.encode()
    assert not [a for a in answers if secret in a]
    lines = [r.getMessage() + (r.exc_text or "") for r in caplog.records]
    assert not [line for line in lines if TOKEN in line]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # 27 malformed requests, but the protocol log is rate limited.
    protocol = [r for r in caplog.records if r.name == "haru_web.protocol"]
    assert 1 <= len(protocol) <= 10


async def test_a_client_that_left_is_access_logged_499(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    gate = asyncio.Event()
    async with serve(gate=gate) as listening:
        _reader, writer = await connect(listening.port)
        writer.write(b"GET /v1/wait HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.05)
        gate.set()
        for _ in range(100):
            if any(r.name == "aiohttp.access" for r in caplog.records):
                break
            await asyncio.sleep(0.02)
    access = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert len(access) == 1
    assert access[0].startswith("GET /v1/wait 499 ")
