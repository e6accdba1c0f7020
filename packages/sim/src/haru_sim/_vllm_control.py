"""The emulator's own control routes under ``/_sim/``, never part of vLLM.

State, faults and recorded requests, so tests in other processes can drive a running server
(:func:`engine_state` is also what :meth:`VllmSim.state` answers in process).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Mapping
from typing import Final

from aiohttp import web

from haru_sim._engine import Engine
from haru_sim._errors import SimConfigError, SimUnsupportedError
from haru_sim._vllm_http import ENGINE_KEY, control_error


def engine_state(engine: Engine) -> dict[str, object]:
    """``GET /_sim/state``: the engine's sleep state, queues, gauges, faults and counters."""
    counters: Mapping[str, object] = {
        "requests": dict(sorted(engine.requests_served.items())),
        "finished": dict(sorted(engine.finished.items())),
        "sleeps": engine.sleeps,
        "wakes": engine.wakes,
        "arrived_while_sleeping": engine.arrived_while_sleeping,
        "parked": engine.parked_total,
    }
    config = engine.config
    return {
        "served_model_names": list(config.served_model_names),
        "vllm_version": config.vllm_version,
        "dev_mode": config.dev_mode,
        "sleeping": engine.is_sleeping,
        "sleep_level": engine.sleep_level,
        "sleeping_tags": sorted(engine.sleeping_tags),
        "pause_state": engine.pause_state,
        "sleep_in_progress": engine.sleep_in_progress,
        "engine_busy": engine.loop_busy,
        "max_num_seqs": config.max_num_seqs,
        "num_requests_tokenizing": engine.num_tokenizing,
        "num_requests_running": engine.num_running,
        "num_requests_waiting": engine.num_waiting,
        "num_requests_parked": engine.num_parked,
        "gauges": (
            {
                "num_requests_running": engine.gauge_running,
                "num_requests_waiting": engine.gauge_waiting,
            }
            if config.log_stats
            else None
        ),
        "faults": engine.faults.to_json(),
        "counters": counters,
        "recorded_requests": len(engine.recorded_requests),
        "time": time.time(),
    }


async def control_state(request: web.Request) -> web.StreamResponse:
    return web.json_response(engine_state(request.app[ENGINE_KEY]))


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
