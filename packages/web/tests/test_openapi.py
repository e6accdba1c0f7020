"""The OpenAPI generator on a toy route table: components, errors, completeness both ways."""

from __future__ import annotations

from aiohttp import web
from haru_protocol import Health, SleepRequest
from haru_web import (
    ApiTable,
    Param,
    health_routes,
    openapi_document,
    render_openapi,
    route,
    undeclared_routes,
)


async def handler(_request: web.Request) -> web.Response:
    return web.json_response({})


TABLE = ApiTable(
    title="toy",
    version="1",
    description="a toy",
    routes=(
        route("GET", "/healthz", "health", Health),
        route(
            "POST",
            "/v1/things/{ref}",
            "act",
            None,
            status=202,
            body=SleepRequest,
            errors=(404,),
            params=(Param(name="X-A", where="header", schema={"type": "string"}, description="a"),),
        ),
    ),
)


def test_paths_components_and_errors() -> None:
    document = openapi_document(TABLE)
    assert document["openapi"] == "3.1.0"
    assert set(document["components"]["schemas"]) >= {"Health", "SleepRequest", "ErrorBody"}
    act = document["paths"]["/v1/things/{ref}"]["post"]
    assert set(act["responses"]) == {"202", "400", "401", "403", "404", "413", "415", "500"}
    assert act["security"] == [{"bearer": []}]
    assert [p["name"] for p in act["parameters"]] == ["ref", "X-A"]
    assert act["parameters"][0] == {
        "name": "ref",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
    }
    health = document["paths"]["/healthz"]["get"]
    assert set(health["responses"]) == {"200", "403", "500"}
    assert "security" not in health
    assert render_openapi(TABLE) == render_openapi(TABLE)
    assert render_openapi(TABLE).endswith("}\n")


def test_undeclared_routes_are_found_both_ways() -> None:
    app = web.Application()
    app.router.add_get("/healthz", handler)
    app.router.add_get("/v1/extra", handler)
    missing, extra = undeclared_routes(app, TABLE)
    assert missing == {("GET", "/v1/extra")}
    assert extra == {("POST", "/v1/things/{ref}")}


def test_health_routes_document_the_probes_every_service_serves() -> None:
    routes = health_routes(liveness="Liveness (touches nothing)")
    table = ApiTable(title="t", version="1", description="d", routes=routes)
    paths = openapi_document(table)["paths"]
    assert list(paths) == ["/healthz", "/openapi.json", "/readyz", "/metrics"]
    assert paths["/healthz"]["get"]["summary"] == "Liveness (touches nothing)"
    assert {"200", "503"} <= set(paths["/readyz"]["get"]["responses"])
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert "401" in paths["/metrics"]["get"]["responses"]
    assert {r.tag for r in routes} == {"health"}
