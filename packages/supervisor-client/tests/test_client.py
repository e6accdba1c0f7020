"""The supervisor client: one typed error per failure, every call bounded, token presented."""

from __future__ import annotations

import asyncio
import errno
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from haru_supervisor_client import (
    MAX_RESPONSE_BYTES,
    PROBE_REPLY_MARGIN_S,
    SupervisorBadResponseError,
    SupervisorClient,
    SupervisorConnectError,
    SupervisorRejectedError,
    SupervisorTimeoutError,
    SupervisorUnauthorizedError,
    SupervisorUnreachableError,
    connect_failure,
    probe_timeout_ms,
)
from pytest_aiohttp import AiohttpServer

STATUS = {
    "slots": [
        {
            "gpuIndex": 0,
            "kind": "inference",
            "models": [{"name": "m", "port": 1, "sleeping": False}],
        },
        {"gpuIndex": 0, "kind": "training", "training": {"state": "running", "pids": [7]}},
    ],
    "ready": True,
    "futureField": {"ignored": True},
}


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def serve(
    aiohttp_server: AiohttpServer,
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    *,
    path: str = "/v1/status",
    method: str = "GET",
) -> str:
    app = web.Application()
    app.router.add_route(method, path, handler)
    server = await aiohttp_server(app)
    return str(server.make_url("/"))


async def test_status_parses_leniently_and_presents_the_token(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response(STATUS)

    url = await serve(aiohttp_server, handler)
    status = await SupervisorClient(session, token="  s3cret ").status(url, timeout_s=2)
    assert status.ready is True
    assert status.slots[1].training is not None
    assert status.slots[1].training.pids == (7,)
    assert seen == ["Bearer s3cret"]


async def test_no_token_sends_no_authorization(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    seen: list[str | None] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response(STATUS)

    url = await serve(aiohttp_server, handler)
    await SupervisorClient(session, token=None).status(url, timeout_s=2)
    assert seen == [None]


@pytest.mark.parametrize("code", [401, 403])
async def test_401_and_403_are_unauthorized(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession, code: int
) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "unauthorized", "message": "no"}}, status=code)

    url = await serve(aiohttp_server, handler)
    with pytest.raises(SupervisorUnauthorizedError) as caught:
        await SupervisorClient(session, token="wrong").status(url, timeout_s=2)
    assert caught.value.status == code
    assert "wrong" not in str(caught.value)


async def test_other_error_status_is_rejected_with_the_envelope_code(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    async def handler(request: web.Request) -> web.Response:
        body = {"error": {"code": "upstream_unreachable", "message": "m1 failed"}}
        return web.json_response(body, status=502)

    url = await serve(aiohttp_server, handler, path="/v1/vllm/sleep", method="POST")
    with pytest.raises(SupervisorRejectedError) as caught:
        await SupervisorClient(session, token=None).sleep(url, timeout_s=2, drain_timeout_ms=10)
    assert caught.value.status == 502
    assert caught.value.code == "upstream_unreachable"
    assert "m1 failed" in str(caught.value)


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[]", b'{"slots": "nope", "ready": true}', b'{"ready": true}'],
)
async def test_malformed_answers_are_bad_responses(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession, body: bytes
) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    url = await serve(aiohttp_server, handler)
    with pytest.raises(SupervisorBadResponseError):
        await SupervisorClient(session, token=None).status(url, timeout_s=2)


async def test_oversized_answer_is_a_bad_response(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        chunk = b" " * 65536
        for _ in range(MAX_RESPONSE_BYTES // len(chunk) + 2):
            await response.write(chunk)
        return response

    url = await serve(aiohttp_server, handler)
    with pytest.raises(SupervisorBadResponseError):
        await SupervisorClient(session, token=None).status(url, timeout_s=5)


async def test_slow_supervisor_times_out_within_the_bound(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response(STATUS)

    url = await serve(aiohttp_server, handler)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(SupervisorTimeoutError):
        await SupervisorClient(session, token=None).status(url, timeout_s=0.1)
    assert loop.time() - started < 2
    release.set()


async def test_zero_bound_still_times_out_instead_of_waiting_forever(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response(STATUS)

    url = await serve(aiohttp_server, handler)
    with pytest.raises(SupervisorTimeoutError):
        await SupervisorClient(session, token=None).status(url, timeout_s=0)
    release.set()


async def test_refused_connection_is_unreachable(session: aiohttp.ClientSession) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(SupervisorConnectError) as caught:
        await SupervisorClient(session, token=None).status(f"http://127.0.0.1:{port}", timeout_s=2)
    assert isinstance(caught.value, SupervisorUnreachableError)
    assert caught.value.reason == "refused"


async def test_a_slow_answer_is_never_a_connect_failure(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response(STATUS)

    url = await serve(aiohttp_server, slow)
    with pytest.raises(SupervisorTimeoutError) as timed_out:
        await SupervisorClient(session, token=None).status(url, timeout_s=0.1)
    assert connect_failure(timed_out.value) is None
    release.set()


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (errno.ECONNREFUSED, "refused"),
        (errno.EHOSTUNREACH, "no_route"),
        (errno.ENETUNREACH, "no_route"),
        (errno.EHOSTDOWN, "no_route"),
        (errno.ETIMEDOUT, None),
        (errno.ECONNRESET, None),
    ],
)
def test_connect_failures_are_told_by_their_errno(code: int, reason: str | None) -> None:
    assert connect_failure(OSError(code, "x")) == reason
    assert connect_failure(TimeoutError()) is None


async def test_redirect_is_not_followed(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    async def handler(request: web.Request) -> web.Response:
        raise web.HTTPFound("http://example.invalid/steal")

    url = await serve(aiohttp_server, handler)
    with pytest.raises(SupervisorRejectedError) as caught:
        await SupervisorClient(session, token="t").status(url, timeout_s=2)
    assert caught.value.status == 302


async def test_bodies_are_camel_case_and_keep_path_prefix(
    aiohttp_server: AiohttpServer, session: aiohttp.ClientSession
) -> None:
    seen: list[tuple[str, object]] = []

    async def stop(request: web.Request) -> web.Response:
        seen.append((request.path, await request.json()))
        return web.json_response({"status": "ok"}, status=202)

    async def probe(request: web.Request) -> web.Response:
        seen.append((request.path, await request.json()))
        return web.json_response(
            {"ok": True, "results": [{"model": "m", "ok": True, "latencyMs": 1.5}]}
        )

    app = web.Application()
    app.router.add_post("/prefix/v1/training/stop", stop)
    app.router.add_post("/prefix/v1/probe", probe)
    server = await aiohttp_server(app)
    base = str(server.make_url("/prefix"))
    client = SupervisorClient(session, token=None)
    await client.stop_training(base, timeout_s=2, grace_ms=1500)
    result = await client.probe(base, timeout_s=10, prompt="hi", max_tokens=3)
    assert result.ok
    assert seen == [
        ("/prefix/v1/training/stop", {"graceMs": 1500}),
        # The per-model bound sent is the call's bound minus PROBE_REPLY_MARGIN_S.
        ("/prefix/v1/probe", {"prompt": "hi", "maxTokens": 3, "timeoutMs": 8000}),
    ]


@pytest.mark.parametrize(
    ("call_timeout_s", "expected_ms"),
    [(60.0, 58_000), (10.0, 8_000), (4.0, 2_000), (3.0, 1_500), (0.5, 250), (0.0, 1)],
)
def test_the_probe_bound_sits_inside_the_call_bound(
    call_timeout_s: float, expected_ms: int
) -> None:
    assert probe_timeout_ms(call_timeout_s) == expected_ms
    assert PROBE_REPLY_MARGIN_S == 2.0


async def test_unusable_base_url_is_unreachable(session: aiohttp.ClientSession) -> None:
    with pytest.raises(SupervisorUnreachableError):
        await SupervisorClient(session, token=None).status("ftp://host/", timeout_s=1)


def test_importing_the_client_loads_neither_the_supervisor_nor_the_server() -> None:
    # A fresh interpreter: this test process has long imported everything.
    script = (
        "import sys, haru_supervisor_client as c\n"
        "assert c.SupervisorClient and c.SupervisorCallError\n"
        "elsewhere = ('aiohttp.web', 'haru_supervisor', 'haru_exec', 'haru_web', 'haru_core',\n"
        "             'sqlalchemy', 'haru_db', 'haru_server')\n"
        "print(sorted(m for m in elsewhere if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
