"""The emulator's own control routes under ``/_sim/``, never part of vLLM.

State, faults and recorded requests, so tests in other processes can drive a running server.
"""

from __future__ import annotations

import base64
import json
from typing import Final

from aiohttp import web

from haru_sim._errors import SimConfigError, SimUnsupportedError
from haru_sim._vllm_http import ENGINE_KEY, control_error


async def control_state(request: web.Request) -> web.StreamResponse:
    return web.json_response(request.app[ENGINE_KEY].state_json())


async def control_get_faults(request: web.Request) -> web.StreamResponse:
    return web.json_response({"faults": request.app[ENGINE_KEY].faults.to_json()})


async def control_set_faults(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    try:
        changes = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        return control_error(400, "invalid_request", "the body must be a JSON object of faults")
    if not isinstance(changes, dict):
        return control_error(400, "invalid_request", "the body must be a JSON object of faults")
    try:
        faults = await engine.set_faults(engine.faults.updated(changes))
    except SimConfigError as exc:
        return control_error(400, "invalid_request", str(exc))
    except SimUnsupportedError as exc:
        return control_error(409, "unsupported", str(exc))
    return web.json_response({"faults": faults.to_json()})


async def control_clear_faults(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    try:
        faults = await engine.set_faults(type(engine.faults)())
    except SimUnsupportedError as exc:  # refuse is only ever on with a listener; kept for safety
        return control_error(409, "unsupported", str(exc))
    return web.json_response({"faults": faults.to_json()})


async def control_requests(request: web.Request) -> web.StreamResponse:
    recorded = request.app[ENGINE_KEY].recorded_requests
    return web.json_response(
        {
            "requests": [
                {
                    "method": r.method,
                    "path": r.path,
                    "headers": [list(h) for h in r.headers],
                    "body_base64": base64.b64encode(r.body).decode(),
                    "received_at": r.received_at,
                }
                for r in recorded
            ]
        }
    )


async def control_clear_requests(request: web.Request) -> web.StreamResponse:
    request.app[ENGINE_KEY].clear_recorded()
    return web.json_response({"requests": []})


CONTROL_ROUTES: Final = (
    web.route("GET", "/_sim/state", control_state),
    web.route("GET", "/_sim/faults", control_get_faults),
    web.route("POST", "/_sim/faults", control_set_faults),
    web.route("DELETE", "/_sim/faults", control_clear_faults),
    web.route("GET", "/_sim/requests", control_requests),
    web.route("DELETE", "/_sim/requests", control_clear_requests),
)
