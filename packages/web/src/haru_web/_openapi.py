"""OpenAPI 3.1 documents generated from a declared route table and the pydantic wire models.

A service declares one :class:`ApiRoute` per route it registers (method, path, request model,
response model per status, error statuses); :func:`openapi_document` turns the table into a
document whose ``components.schemas`` come from the models' own JSON schemas (never written by
hand), and :func:`undeclared_routes` compares the table with what an aiohttp application
actually registers. Errors are always the ``{"error": {"code", "message"}}`` envelope.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from aiohttp import web
from aiohttp.typedefs import Handler
from haru_protocol import ErrorBody, Health, Readiness
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from haru_web._middleware import is_api_path

OPENAPI_PATH: Final = "/openapi.json"
"""Where both services serve their document (outside ``/v1``: no token needed)."""

OPENAPI_VERSION: Final = "3.1.0"
REF_TEMPLATE: Final = "#/components/schemas/{model}"
BEARER_SCHEME: Final = "bearer"

_PATH_PARAM: Final = re.compile(r"\{([^}/]+)\}")

_REASONS: Final[Mapping[int, str]] = {
    200: "OK",
    202: "Accepted",
    400: "Invalid request (malformed body, query or header)",
    401: "Missing or invalid bearer token",
    403: "Refused by the browser guard (no token set: foreign Host or Origin)",
    404: "Not found",
    405: "Method not allowed",
    408: "The request was not sent in time",
    409: "Conflict with the current state",
    413: "Request body too large",
    415: "Body not sent as application/json",
    422: "The target cannot take this operation",
    500: "Unexpected failure (logged by the service)",
    501: "Not available on this host",
    502: "An upstream refused, failed or could not be reached",
    503: "Unavailable for now (retry later)",
    504: "An upstream did not answer in time",
}

BODY_ERRORS: Final = (400, 413, 415)
"""What every route with a request body may answer about the body itself."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Param:
    """A query or header parameter.

    Attributes:
        name: Its name.
        where: ``query`` or ``header``.
        schema: Its JSON schema.
        description: What it means.
        required: Whether it must be sent.
    """

    name: str
    where: Literal["query", "header"]
    schema: Mapping[str, Any]
    description: str
    required: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiRoute:
    """One route of a service, as its OpenAPI document describes it.

    Attributes:
        method: HTTP method (upper case).
        path: aiohttp path; ``{name}`` segments become string path parameters.
        summary: One line for the document.
        responses: Success status -> response model (None: any JSON body).
        errors: Error statuses this route may answer (always the envelope). Body errors
            (:data:`BODY_ERRORS`) are added for routes with a body, 401 for routes under ``/v1``
            of a service with a token, and the table's common errors for every route.
        body: The request body's model, if the route reads one.
        body_required: False when an empty body stands for ``{}``.
        params: Query and header parameters.
        tag: Section of the document.
        media_types: Content types of the success answers (default JSON).
        description: Longer text, if any.
    """

    method: str
    path: str
    summary: str
    responses: Mapping[int, type[BaseModel] | None]
    errors: Sequence[int] = ()
    body: type[BaseModel] | None = None
    body_required: bool = True
    params: Sequence[Param] = ()
    tag: str = "api"
    media_types: Sequence[str] = ("application/json",)
    description: str = ""

    @property
    def operation_id(self) -> str:
        """A stable id: method and path words, e.g. ``get_v1_fleets_ref_events``."""
        words = re.findall(r"[A-Za-z0-9]+", self.path)
        return "_".join([self.method.lower(), *words])


def route(
    method: str,
    path: str,
    summary: str,
    ok: type[BaseModel] | None,
    *,
    status: int = 200,
    **extra: Any,
) -> ApiRoute:
    """One-line declaration of a route with a single success answer (see :class:`ApiRoute`)."""
    return ApiRoute(method=method, path=path, summary=summary, responses={status: ok}, **extra)


def health_routes(*, liveness: str = "Liveness") -> tuple[ApiRoute, ...]:
    """The probe routes every service serves: liveness, this document, readiness, metrics.

    Args:
        liveness: The summary of ``GET /healthz`` (say what liveness never touches).

    Returns:
        ``GET /healthz``, ``GET`` :data:`OPENAPI_PATH`, ``GET /readyz`` and ``GET /metrics``,
        tagged ``health``.
    """
    return (
        route("GET", "/healthz", liveness, Health, tag="health"),
        route("GET", OPENAPI_PATH, "This document", None, tag="health"),
        route(
            "GET",
            "/readyz",
            "Readiness (503 not_ready with the reason otherwise)",
            Readiness,
            errors=(503,),
            tag="health",
        ),
        route(
            "GET",
            "/metrics",
            "Prometheus metrics, text format (behind the token unless HARU_METRICS_PUBLIC=1)",
            None,
            errors=(401,),
            tag="health",
            media_types=("text/plain",),
        ),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiTable:
    """Every route of one service, and what the document says about all of them.

    Attributes:
        title: The document's title.
        version: The service's version.
        description: Text at the top of the document.
        routes: The routes, in document order.
        common_errors: Statuses any route may answer (e.g. 403 of the browser guard, 500).
        bearer: The ``/v1`` routes take ``Authorization: Bearer <token>`` (when one is set).
        tags: Tag name -> description.
    """

    title: str
    version: str
    description: str
    routes: Sequence[ApiRoute]
    common_errors: Sequence[int] = (403, 500)
    bearer: bool = True
    tags: Mapping[str, str] = field(default_factory=dict)

    def errors_of(self, entry: ApiRoute) -> list[int]:
        """Every error status ``entry`` is documented to answer, sorted."""
        statuses = set(entry.errors) | set(self.common_errors)
        if entry.body is not None:
            statuses |= set(BODY_ERRORS)
        if self.bearer and is_api_path(entry.path):
            statuses.add(401)
        return sorted(statuses)


def _path_parameters(path: str) -> list[dict[str, Any]]:
    return [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _PATH_PARAM.findall(path)
    ]


def _content(ref: Mapping[str, Any], media_types: Sequence[str]) -> dict[str, Any]:
    return {media: {"schema": dict(ref)} for media in media_types}


def openapi_document(table: ApiTable) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``table`` (deterministic: same table, same document)."""
    pairs: list[tuple[type[BaseModel], JsonSchemaMode]] = [(ErrorBody, "serialization")]
    for entry in table.routes:
        if entry.body is not None:
            pairs.append((entry.body, "validation"))
        pairs.extend((model, "serialization") for model in entry.responses.values() if model)
    unique = list(dict.fromkeys(pairs))
    refs, top = models_json_schema(unique, ref_template=REF_TEMPLATE)
    error_ref = refs[(ErrorBody, "serialization")]
    paths: dict[str, dict[str, Any]] = {}
    for entry in table.routes:
        responses: dict[str, Any] = {}
        for status, model in sorted(entry.responses.items()):
            schema = refs[(model, "serialization")] if model is not None else {}
            responses[str(status)] = {
                "description": _REASONS.get(status, "Success"),
                "content": _content(schema, entry.media_types),
            }
        for status in table.errors_of(entry):
            responses[str(status)] = {
                "description": _REASONS.get(status, "Error"),
                "content": _content(error_ref, ("application/json",)),
            }
        operation: dict[str, Any] = {
            "operationId": entry.operation_id,
            "summary": entry.summary,
            "tags": [entry.tag],
        }
        if entry.description:
            operation["description"] = entry.description
        parameters = _path_parameters(entry.path) + [
            {
                "name": param.name,
                "in": param.where,
                "required": param.required,
                "description": param.description,
                "schema": dict(param.schema),
            }
            for param in entry.params
        ]
        if parameters:
            operation["parameters"] = parameters
        if entry.body is not None:
            operation["requestBody"] = {
                "required": entry.body_required,
                "content": _content(refs[(entry.body, "validation")], ("application/json",)),
            }
        operation["responses"] = responses
        if table.bearer and is_api_path(entry.path):
            operation["security"] = [{BEARER_SCHEME: []}]
        paths.setdefault(entry.path, {})[entry.method.lower()] = operation
    components: dict[str, Any] = {"schemas": dict(sorted(top.get("$defs", {}).items()))}
    if table.bearer:
        components["securitySchemes"] = {
            BEARER_SCHEME: {
                "type": "http",
                "scheme": "bearer",
                "description": "Required on /v1 routes when the service has a token.",
            }
        }
    document: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": table.title,
            "version": table.version,
            "description": table.description,
        },
        "paths": paths,
        "components": components,
    }
    if table.tags:
        document["tags"] = [{"name": n, "description": d} for n, d in table.tags.items()]
    return document


def render_openapi(table: ApiTable) -> str:
    """The document as the committed file holds it: indented JSON with a final newline."""
    return json.dumps(openapi_document(table), indent=2, ensure_ascii=False) + "\n"


def openapi_command(table: ApiTable, argv: Sequence[str] | None = None) -> int:
    """A service's regenerate command: print the document, or write it to ``argv[0]``.

    ``argv`` defaults to the process's arguments (``sys.argv[1:]``).
    """
    if argv is None:
        argv = sys.argv[1:]
    text = render_openapi(table)
    if argv:
        Path(argv[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def registered_routes(app: web.Application) -> set[tuple[str, str]]:
    """``(method, path)`` of every route ``app`` registers (the implicit HEAD of GETs aside)."""
    found: set[tuple[str, str]] = set()
    for resource_route in app.router.routes():
        if resource_route.method == "HEAD":
            continue
        resource = resource_route.resource
        if resource is None:  # pragma: no cover - every route of these apps has a resource
            continue
        found.add((resource_route.method, resource.canonical))
    return found


def undeclared_routes(
    app: web.Application, table: ApiTable
) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """What ``app`` registers but ``table`` lacks, and what ``table`` declares but ``app`` lacks."""
    declared = {(entry.method, entry.path) for entry in table.routes}
    registered = registered_routes(app)
    return registered - declared, declared - registered


def openapi_handler(table: ApiTable) -> Handler:
    """An aiohttp handler serving the document of ``table`` (rendered once, on first use).

    The document is built from the table and the models only: serving it never touches a
    database or any other dependency of the service.
    """
    rendered: list[bytes] = []

    async def handler(_request: web.BaseRequest) -> web.StreamResponse:
        if not rendered:
            rendered.append(render_openapi(table).encode())
        return web.Response(body=rendered[0], content_type="application/json")

    return handler
