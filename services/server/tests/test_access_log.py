"""The server's access log: failed answers at INFO, the rest only at DEBUG, never a query."""

from __future__ import annotations

import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from haru_server._access_log import AccessLog


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def client() -> TestClient[web.Request, web.Application]:
    app = web.Application()
    app.router.add_get("/ok", ok)
    server = TestServer(app)
    await server.start_server(access_log_class=AccessLog)  # as run_server's AppRunner has it
    test_client = TestClient(server)
    await test_client.start_server()
    return test_client


def access_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "aiohttp.access"]


async def test_successes_are_silent_at_info_and_failures_are_logged_without_query(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    test_client = await client()
    try:
        assert (await test_client.get("/ok")).status == 200
        assert (await test_client.get("/missing?token=s3cret")).status == 404
    finally:
        await test_client.close()
    lines = access_lines(caplog)
    assert len(lines) == 1, [(r.levelno, r.getMessage()) for r in lines]
    assert lines[0].levelno == logging.INFO
    message = lines[0].getMessage()
    assert '"GET /missing" 404' in message
    assert "s3cret" not in message


async def test_every_answer_is_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="aiohttp.access")
    test_client = await client()
    try:
        assert (await test_client.get("/ok")).status == 200
    finally:
        await test_client.close()
    lines = access_lines(caplog)
    assert [(r.levelno, '"GET /ok" 200' in r.getMessage()) for r in lines] == [
        (logging.DEBUG, True)
    ]
