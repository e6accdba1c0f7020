"""The server's OpenAPI document: committed and current, complete, served without the store."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from haru_db import StateStore
from haru_server._app import create_app
from haru_server._clock import ManualClock
from haru_server._settings import Settings
from haru_server.openapi import ROUTES, api_table, main
from haru_web import openapi_document, render_openapi, undeclared_routes
from pydantic import SecretStr
from pytest_aiohttp import AiohttpClient

COMMITTED = Path(__file__).resolve().parents[1] / "openapi.json"
REGENERATE = "uv run python -m haru_server.openapi services/server/openapi.json"
TOKEN = "openapi-token-0123456789"


def test_the_committed_document_is_current() -> None:
    assert COMMITTED.read_text(encoding="utf-8") == render_openapi(api_table()), (
        f"services/server/openapi.json is stale: regenerate it with `{REGENERATE}`"
    )


def test_the_regenerate_command_writes_the_document(tmp_path: Path) -> None:
    target = tmp_path / "openapi.json"
    assert main([str(target)]) == 0
    assert target.read_text(encoding="utf-8") == COMMITTED.read_text(encoding="utf-8")


def test_every_registered_route_is_declared_and_every_declared_route_exists() -> None:
    app = create_app(
        Settings(reconcile_interval_ms=None),
        store=StateStore.open("postgresql://haru@127.0.0.1:1/haru"),
    )
    missing, extra = undeclared_routes(app, api_table())
    assert not missing, f"routes missing from haru_server/openapi.py ROUTES: {sorted(missing)}"
    assert not extra, f"ROUTES declares routes the app does not register: {sorted(extra)}"
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES)


def test_the_document_is_openapi_3_1_with_every_model_in_components() -> None:
    document = openapi_document(api_table())
    assert document["openapi"] == "3.1.0"
    schemas = document["components"]["schemas"]
    refs = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                refs.add(ref.removeprefix("#/components/schemas/"))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    assert refs <= set(schemas), refs - set(schemas)
    promote = document["paths"]["/v1/fleets/{ref}/promote"]["post"]
    assert promote["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/PromoteRequest"
    }
    assert set(promote["responses"]) >= {"200", "202", "401", "404", "409", "422", "503"}
    assert promote["security"] == [{"bearer": []}]
    error = promote["responses"]["409"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorBody"}
    assert "security" not in document["paths"]["/healthz"]["get"]
    # camelCase on the wire, as the models serialize.
    assert "targetDomainId" in schemas["PromoteRequest"]["properties"]
    assert schemas["PromoteRequest"]["additionalProperties"] is False


async def test_openapi_json_is_served_without_a_token_and_without_the_store(
    aiohttp_client: AiohttpClient,
) -> None:
    broken = StateStore.open("postgresql://haru@127.0.0.1:1/haru")
    clock = ManualClock(datetime(2030, 1, 1, tzinfo=UTC))
    app = create_app(
        Settings(api_token=SecretStr(TOKEN), reconcile_interval_ms=None), store=broken, clock=clock
    )
    client = await aiohttp_client(app)
    response = await client.get("/openapi.json")
    assert response.status == 200
    assert response.content_type == "application/json"
    assert await response.json() == json.loads(COMMITTED.read_text(encoding="utf-8"))
    # The same store fails every real route: the document was served without it.
    fleets = await client.get("/v1/fleets", headers={"Authorization": f"Bearer {TOKEN}"})
    assert fleets.status == 503
