"""The settable listening address and the browser guard of a deliberately open service."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from haru_web import (
    ServerLimits,
    browser_guard_middleware,
    choose_bind_host,
    error_middleware,
    is_loopback_bind,
    normalize_bind_host,
    serving,
)


@pytest.mark.parametrize(
    ("value", "normal"),
    [("0.0.0.0", "0.0.0.0"), ("[::]", "::"), (" ::1 ", "::1"), ("Haru-Server", "haru-server")],
)
def test_bind_hosts_are_normalised(value: str, normal: str) -> None:
    assert normalize_bind_host(value) == normal


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.9", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("server", False),
    ],
)
def test_loopback_binds(host: str, loopback: bool) -> None:
    assert is_loopback_bind(host) is loopback


def test_the_default_follows_the_token() -> None:
    assert choose_bind_host(None, token_set=True, allow_open=False, token_var="T") == "0.0.0.0"
    assert choose_bind_host(None, token_set=False, allow_open=True, token_var="T") == "127.0.0.1"
    with pytest.raises(ValueError, match=r"^HARU_HOST=:: is not a loopback address and T is"):
        choose_bind_host("::", token_set=False, allow_open=False, token_var="T")


def _app(*, check_host: bool) -> web.Application:
    app = web.Application(
        middlewares=[
            error_middleware,
            browser_guard_middleware(open_api=True, check_host=check_host),
        ]
    )

    async def fleets(_request: web.Request) -> web.Response:
        return web.json_response({"fleets": []})

    app.router.add_get("/v1/fleets", fleets)
    return app


@pytest.mark.parametrize("check_host", [True, False])
async def test_an_opted_in_open_service_answers_other_host_names_but_not_other_origins(
    check_host: bool,
) -> None:
    limits = ServerLimits()
    app = _app(check_host=check_host)
    async with serving(
        app, host="127.0.0.1", port=0, limits=limits, shutdown_timeout=1
    ) as listening:
        url = f"http://127.0.0.1:{listening.port}/v1/fleets"
        async with aiohttp.ClientSession() as http:
            async with http.get(url, headers={"Host": "haru-server:8700"}) as response:
                assert response.status == (403 if check_host else 200)
            headers = {"Host": "haru-server:8700", "Origin": "http://evil.example"}
            async with http.get(url, headers=headers) as response:
                assert response.status == 403
                body = await response.json()
                assert body["error"]["code"] == "forbidden"
