"""The service application skeleton (guards, their order, the document) and answer observation."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from haru_protocol import ErrorCode
from haru_web import (
    OPENAPI_PATH,
    ApiError,
    ApiTable,
    FileToken,
    ListenerSettings,
    TokenSource,
    observe_answer,
    route,
    service_app,
)
from pydantic import SecretStr
from pytest_aiohttp import AiohttpClient

TOKEN = "service-app-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TABLE = ApiTable(
    title="t", version="1", description="d", routes=(route("GET", "/v1/x", "x", None),)
)


class _Service(ListenerSettings):
    guard_token = FileToken("HARU_T_TOKEN", "token", "token_file")

    token: SecretStr | None = None
    token_file: Path | None = None


def _recorder(seen: list[tuple[str, int]]) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await observe_answer(
            request, handler, lambda status, seconds: seen.append((request.path, status))
        )

    return middleware


async def _ok(_request: web.Request) -> web.Response:
    return web.json_response({})


async def _api_error(_request: web.Request) -> web.Response:
    raise ApiError(ErrorCode.OPERATION_CONFLICT, "busy")


async def _http_error(_request: web.Request) -> web.Response:
    raise web.HTTPRequestEntityTooLarge(max_size=1, actual_size=2)


async def _fault(_request: web.Request) -> web.Response:
    raise RuntimeError("boom")


async def test_the_guards_sit_between_what_a_service_adds_outside_and_inside(
    aiohttp_client: AiohttpClient,
) -> None:
    outside: list[tuple[str, int]] = []
    inside: list[tuple[str, int]] = []
    app = service_app(
        _Service(token=SecretStr(TOKEN)),
        TokenSource.constant(TOKEN),
        TABLE,
        outer=[_recorder(outside)],
        inner=[_recorder(inside)],
        unguarded={"/v1/own"},
    )
    for path, handler in (
        ("/v1/x", _ok),
        ("/v1/own", _ok),
        ("/v1/conflict", _api_error),
        ("/v1/large", _http_error),
        ("/v1/fault", _fault),
    ):
        app.router.add_get(path, handler)
    client = await aiohttp_client(app)
    assert (await client.get("/v1/x")).status == 401
    assert (await client.get("/v1/own")).status == 200  # checks its own credential
    assert (await client.get("/metrics")).status == 401  # behind the token, though unrouted
    for path, status in (("/v1/conflict", 409), ("/v1/large", 413), ("/v1/fault", 500)):
        response = await client.get(path, headers=AUTH)
        assert response.status == status
        assert (await response.json())["error"]["code"]
    document = await client.get(OPENAPI_PATH)
    assert document.status == 200
    assert (await document.json())["info"]["title"] == "t"
    # The refusals never reached what sits inside the guards; every answer passed outside.
    assert outside == [
        ("/v1/x", 401),
        ("/v1/own", 200),
        ("/metrics", 401),
        ("/v1/conflict", 409),
        ("/v1/large", 413),
        ("/v1/fault", 500),
        (OPENAPI_PATH, 200),
    ]
    assert inside == [
        ("/v1/own", 200),
        ("/v1/conflict", 409),
        ("/v1/large", 413),
        ("/v1/fault", 500),
        (OPENAPI_PATH, 200),
    ]


async def test_without_a_token_the_api_is_open_to_all_but_browsers(
    aiohttp_client: AiohttpClient,
) -> None:
    app = service_app(_Service(), None, TABLE)
    app.router.add_get("/v1/x", _ok)
    client = await aiohttp_client(app)
    assert (await client.get("/v1/x")).status == 200
    refused = await client.get("/v1/x", headers={"Origin": "https://elsewhere.example"})
    assert refused.status == 403


async def test_the_body_bound_is_the_services(aiohttp_client: AiohttpClient) -> None:
    async def read(request: web.Request) -> web.Response:
        return web.json_response({"size": len(await request.read())})

    app = service_app(_Service(), None, TABLE, client_max_size=8)
    app.router.add_post("/v1/x", read)
    client = await aiohttp_client(app)
    assert (await client.post("/v1/x", data=b"12345678")).status == 200
    assert (await client.post("/v1/x", data=b"123456789")).status == 413
