"""The supervisor's OpenAPI document: committed and current, complete, served without a token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from haru_protocol import SupervisorConfig
from haru_supervisor.api import Settings, create_app
from haru_supervisor.openapi import ROUTES, api_table, main
from haru_web import openapi_document, render_openapi, undeclared_routes

COMMITTED = Path(__file__).resolve().parents[1] / "openapi.json"
REGENERATE = "uv run python -m haru_supervisor.openapi services/supervisor/openapi.json"
CONFIG = {"slots": [{"kind": "inference", "gpuIndex": 0, "models": [{"name": "m", "port": 9}]}]}


def test_the_committed_document_is_current() -> None:
    assert COMMITTED.read_text(encoding="utf-8") == render_openapi(api_table()), (
        f"services/supervisor/openapi.json is stale: regenerate it with `{REGENERATE}`"
    )


def test_the_regenerate_command_writes_the_document(tmp_path: Path) -> None:
    target = tmp_path / "openapi.json"
    assert main([str(target)]) == 0
    assert target.read_text(encoding="utf-8") == COMMITTED.read_text(encoding="utf-8")


def test_every_registered_route_is_declared_and_every_declared_route_exists() -> None:
    app = create_app(Settings(config=SupervisorConfig.model_validate(CONFIG)))
    missing, extra = undeclared_routes(app, api_table())
    assert not missing, f"routes missing from haru_supervisor/openapi.py ROUTES: {sorted(missing)}"
    assert not extra, f"ROUTES declares routes the app does not register: {sorted(extra)}"
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES)


def test_bodies_are_strict_and_optional_where_an_empty_body_is_accepted() -> None:
    document = openapi_document(api_table())
    sleep = document["paths"]["/v1/vllm/sleep"]["post"]
    assert sleep["requestBody"]["required"] is False
    assert set(sleep["responses"]) >= {"200", "400", "401", "404", "413", "415", "502"}
    schema = document["components"]["schemas"]["SleepRequest"]
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {"gpuIndex", "drainTimeoutMs"}
    assert document["paths"]["/v1/training/stop"]["post"]["responses"]["202"]


async def test_openapi_json_is_served_without_the_token(
    supervisor: Any, auth: dict[str, str]
) -> None:
    client = await supervisor(CONFIG)
    response = await client.get("/openapi.json")
    assert response.status == 200
    assert await response.json() == json.loads(COMMITTED.read_text(encoding="utf-8"))
    denied = await client.get("/v1/status")
    assert denied.status == 401
    allowed = await client.get("/v1/status", headers=auth)
    assert allowed.status == 200
