"""The control server's OpenAPI route table: the control API, the inference proxy and health.

One declaration per route the application registers (a test holds this table and the app's
router to each other, both ways). The document is built from the table and the wire models;
its committed copy, ``services/server/openapi.json``, is regenerated with::

    uv run python -m haru_server.openapi services/server/openapi.json
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Final

from haru_protocol import (
    AcceptedResponse,
    AlreadyActiveResponse,
    ApplyRequest,
    ApplyResponse,
    ClientKeyCreate,
    ClientKeyCreated,
    ClientKeyList,
    ClientKeyView,
    DemoteRequest,
    DomainActionRequest,
    DomainActionResponse,
    DomainStatusResponse,
    EventList,
    FleetList,
    FleetPolicyResponse,
    FleetSnapshot,
    Operation,
    PolicyPatch,
    PromoteRequest,
    ReconcileResponse,
    RouteIntent,
)
from haru_web import ApiRoute, ApiTable, Param, health_routes, openapi_command, route
from pydantic import BaseModel, ConfigDict, Field

from haru_server._proxy import FLEET_HEADER
from haru_server._proxy_routes import CHAT_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH, MODELS_PATH
from haru_server._routes import EVENTS_DEFAULT_LIMIT, EVENTS_MAX_LIMIT, ReconcileRequest


class InferenceRequest(BaseModel):
    """An OpenAI-compatible request: ``model`` picks the binding, the rest goes upstream as is."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    """The served model name (one of ``GET /v1/models``)."""


class ModelCard(BaseModel):
    """One model the active domain serves."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "haru"


class ModelList(BaseModel):
    """``GET /v1/models``: the active domain's routable models (OpenAI's list shape)."""

    object: str = "list"
    data: list[ModelCard]


_FLEET: Final = Param(
    name=FLEET_HEADER,
    where="header",
    schema={"type": "string", "maxLength": 63},
    description="Fleet slug or id (else HARU_DEFAULT_FLEET).",
)
_STORE: Final = 503  # state_store_unavailable
_PROXY_ERRORS: Final = (403, 404, 429, 502, 503, 504)
_STREAMED: Final = ("application/json", "text/event-stream")
_EVENT_QUERY: Final = (
    Param(
        name="after",
        where="query",
        schema={"type": "integer", "minimum": 0, "maximum": 2**63 - 1, "default": 0},
        description="Only events with a larger id.",
    ),
    Param(
        name="limit",
        where="query",
        schema={
            "type": "integer",
            "minimum": 1,
            "maximum": EVENTS_MAX_LIMIT,
            "default": EVENTS_DEFAULT_LIMIT,
        },
        description="Page size.",
    ),
)
_FLEETS: Final = "/v1/fleets/{ref}"
_OPERATION_ERRORS: Final = (404, 409, 422, _STORE)


def _inference(path: str, summary: str) -> ApiRoute:
    return route(
        "POST",
        path,
        summary,
        None,
        body=InferenceRequest,
        errors=_PROXY_ERRORS,
        params=(_FLEET,),
        tag="inference",
        media_types=_STREAMED,
        description="Forwarded byte-identical to the active domain's binding of `model`; the "
        "answer (and an upstream's own error) streams back with its status.",
    )


def _posture(action: str, summary: str, body: type[BaseModel]) -> ApiRoute:
    """``POST .../promote`` or ``.../demote``: 200 when already so, 202 with the operation."""
    return ApiRoute(
        method="POST",
        path=f"{_FLEETS}/{action}",
        summary=summary,
        responses={200: AlreadyActiveResponse, 202: AcceptedResponse},
        body=body,
        errors=_OPERATION_ERRORS,
        tag="control",
    )


def _domain_action(action: str, summary: str, statuses: tuple[int, ...]) -> ApiRoute:
    """``POST .../domains/{domain}/up`` or ``.../down`` (an optional body)."""
    return ApiRoute(
        method="POST",
        path=f"{_FLEETS}/domains/{{domain}}/{action}",
        summary=summary,
        responses=dict.fromkeys(statuses, DomainActionResponse),
        body=DomainActionRequest,
        body_required=False,
        errors=_OPERATION_ERRORS,
        tag="control",
    )


def _control(
    method: str, path: str, summary: str, ok: type[BaseModel], *errors: int, **extra: Any
) -> ApiRoute:
    """A control API route (tagged ``control``); each may also answer 503 (the store is down)."""
    return route(method, path, summary, ok, errors=(*errors, _STORE), tag="control", **extra)


ROUTES: Final[tuple[ApiRoute, ...]] = (
    *health_routes(liveness="Liveness (never touches the state store)"),
    _control("GET", "/v1/fleets", "List fleets", FleetList),
    _control("GET", _FLEETS, "A fleet's snapshot", FleetSnapshot, 404),
    _control(
        "GET", f"{_FLEETS}/route-intent", "Where the proxy routes each model", RouteIntent, 404
    ),
    _control(
        "PATCH",
        f"{_FLEETS}/policy",
        "Change the operator's policy values (JSON Merge Patch: null follows the default)",
        FleetPolicyResponse,
        400,
        404,
        409,
        body=PolicyPatch,
        description="Keys set replace the operator's values, keys set to null remove them (the "
        "key follows the current default again), other keys stay. Stored with one "
        "compare-and-swap and a `fleet.policy.changed` event; the next reconcile tick uses "
        "it. Answers the resolved policy.",
    ),
    _control(
        "POST",
        f"{_FLEETS}/apply",
        "Plan a fleet layout against the stored fleet, and apply it (dryRun: only the plan)",
        ApplyResponse,
        400,
        404,
        409,
        body=ApplyRequest,
        description="The plan lists each difference (`+` added, `~` changed, `-` removed) "
        "with the reason a change is refused, and the configuration revisions it was made on. "
        "An apply with refused items changes nothing (409 `change_refused`); one whose "
        "`revisions` no longer match, or whose compare-and-swap on a row loses, is 409 "
        "`plan_stale`. Each change appends a `fleet.config.changed` event. A fleet not yet "
        "stored is created (the `{ref}` is then the layout's slug).",
    ),
    _control(
        "POST",
        f"{_FLEETS}/reconcile",
        "Run one reconcile tick now",
        ReconcileResponse,
        404,
        body=ReconcileRequest,
        body_required=False,
    ),
    _posture("promote", "Make a standby domain active", PromoteRequest),
    _posture("demote", "Put a standby domain to sleep and start its training", DemoteRequest),
    _control("GET", f"{_FLEETS}/operations/{{operation_id}}", "One operation", Operation, 404),
    _control(
        "GET",
        f"{_FLEETS}/events",
        "The fleet's audit trail, oldest first",
        EventList,
        400,
        404,
        params=_EVENT_QUERY,
    ),
    _control(
        "GET",
        f"{_FLEETS}/domains/{{domain}}",
        "A domain's row, its SkyPilot cluster status and its last provisioning events",
        DomainStatusResponse,
        404,
    ),
    _domain_action("up", "Launch a stopped or failed skypilot domain again", (202,)),
    _domain_action(
        "down", "Tear a standby skypilot domain down (`sky down`); 409 for the active", (200, 202)
    ),
    _control(
        "POST",
        "/v1/keys",
        "Create an inference client key (the key is in this answer only)",
        ClientKeyCreated,
        400,
        404,
        status=201,
        body=ClientKeyCreate,
        description="The key (`secret`) is shown once; only its SHA-256 is stored. `fleets` "
        "(slugs or ids, each must exist), `models` and `rpm` (per server process) limit it; "
        "omitted: no limit.",
    ),
    _control("GET", "/v1/keys", "List client keys (never the keys)", ClientKeyList),
    _control(
        "DELETE",
        "/v1/keys/{id}",
        "Revoke a client key (every server refuses it within one route lease)",
        ClientKeyView,
        404,
    ),
    _inference(CHAT_PATH, "Chat completion (OpenAI-compatible)"),
    _inference(COMPLETIONS_PATH, "Completion (OpenAI-compatible)"),
    _inference(EMBEDDINGS_PATH, "Embeddings (OpenAI-compatible)"),
    route(
        "GET",
        MODELS_PATH,
        "Models of the active domain",
        ModelList,
        errors=(403, 404, 429, 503),
        params=(_FLEET,),
        tag="inference",
    ),
)
"""Every route of the control server, in document order."""


def api_table() -> ApiTable:
    """The server's route table with this installation's version."""
    return ApiTable(
        title="Haru control server",
        version=metadata.version("haru-server"),
        description="Control API (fleets, operations, events, route intent), the "
        "OpenAI-compatible inference proxy and health. Errors are always "
        '`{"error": {"code", "message"}}`.',
        routes=ROUTES,
        tags={
            "control": "Fleets, operations and the audit trail (DESIGN 7.2).",
            "inference": "The OpenAI-compatible proxy to the active domain (DESIGN 7.5).",
            "health": "Probes and this document.",
        },
    )


def main(argv: list[str] | None = None) -> int:
    """Print the document, or write it to the path given as the only argument."""
    return openapi_command(api_table(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
