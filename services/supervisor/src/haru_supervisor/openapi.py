"""The supervisor's OpenAPI route table (DESIGN 6.4).

Every route the application registers is declared here, one line each (a test compares this
table with the app's router, both ways). The document is generated from it and the wire
models; the committed copy is ``services/supervisor/openapi.json``. Regenerate it with::

    uv run python -m haru_supervisor.openapi services/supervisor/openapi.json
"""

from __future__ import annotations

from importlib import metadata
from typing import Final

from haru_protocol import (
    FENCE_HEADER,
    GpuMemoryResponse,
    OkResponse,
    ProbeRequest,
    ProbeResponse,
    ReadyResponse,
    SleepRequest,
    SupervisorStatus,
    TrainingStatusResponse,
    TrainingStopRequest,
    WakeRequest,
)
from haru_web import ApiRoute, ApiTable, Param, health_routes, openapi_command, route
from pydantic import BaseModel

from haru_supervisor._routes import NoParameters

_GPU_ERRORS: Final = (501, 502)
"""No GPU memory source on this host (501); the source failed (502)."""

_FENCE: Final = (
    Param(
        name=FENCE_HEADER,
        where="header",
        schema={"type": "string", "pattern": "^[0-9a-fA-F-]{32,36}:[0-9]{1,19}$"},
        description="`<fleet-id>:<token>`: the fencing token of the operation step the call is "
        "made for. A token lower than the highest this supervisor has seen for the fleet is "
        "refused (409 `stale_fence`); without the header the call is accepted and logged.",
    ),
)
"""The fencing header of every state-changing route."""


_FENCED_ERRORS: Final = {"vllm": (404, 409, 502, 503), "training": (409, 503)}
"""What the fenced routes of each tag may answer besides the common errors."""


def _fenced(action: str, summary: str, body: type[BaseModel], *, status: int = 200) -> ApiRoute:
    """A state-changing ``POST /v1/<tag>/<verb>``: fenced, its body optional."""
    tag = action.partition("/")[0]
    return route(
        "POST",
        f"/v1/{action}",
        summary,
        OkResponse,
        status=status,
        body=body,
        body_required=False,
        params=_FENCE,
        errors=_FENCED_ERRORS[tag],
        tag=tag,
    )


ROUTES: Final[tuple[ApiRoute, ...]] = (
    *health_routes(),
    route("GET", "/v1/status", "Every slot: models' sleep state, training", SupervisorStatus),
    route("GET", "/v1/ready", "Every model awake", ReadyResponse),
    _fenced("vllm/sleep", "Drain and put the local vLLM servers to sleep", SleepRequest),
    _fenced(
        "vllm/wake", "Wake the local vLLM servers (refused while training is not idle)", WakeRequest
    ),
    _fenced("training/start", "Start every training slot's command", NoParameters),
    _fenced(
        "training/stop",
        "Stop every training run (SIGTERM, then SIGKILL after the grace)",
        TrainingStopRequest,
        status=202,
    ),
    route("GET", "/v1/training/status", "Training runs", TrainingStatusResponse, tag="training"),
    route("GET", "/v1/gpu/memory", "GPU memory", GpuMemoryResponse, errors=_GPU_ERRORS, tag="gpu"),
    route(
        "GET",
        "/v1/gpu/processes",
        "GPU memory with the processes holding it",
        GpuMemoryResponse,
        errors=_GPU_ERRORS,
        tag="gpu",
    ),
    route(
        "POST",
        "/v1/probe",
        "One short completion per model",
        ProbeResponse,
        body=ProbeRequest,
        body_required=False,
        tag="vllm",
    ),
)
"""Every route of the supervisor, in document order."""


def api_table() -> ApiTable:
    """The supervisor's route table with this installation's version."""
    return ApiTable(
        title="Haru supervisor",
        version=metadata.version("haru-supervisor"),
        description="The agent on each GPU host: vLLM sleep and wake, training runs, GPU "
        'memory and probes. Errors are always `{"error": {"code", "message"}}`.',
        routes=ROUTES,
        tags={
            "api": "Status and readiness.",
            "vllm": "The local vLLM servers.",
            "training": "The training slots' runs.",
            "gpu": "GPU memory.",
            "health": "Probes and this document.",
        },
    )


def main(argv: list[str] | None = None) -> int:
    """Print the document, or write it to the path given as the only argument."""
    return openapi_command(api_table(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
