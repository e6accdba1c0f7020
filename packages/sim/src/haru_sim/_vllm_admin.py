"""The emulated vLLM's server routes: health, version, metrics and the dev-mode sleep routes.

``/health``, ``/version`` and ``/metrics`` are always served; ``/sleep``, ``/wake_up`` and
``/is_sleeping`` only with ``VLLM_SERVER_DEV_MODE=1``.
"""

from __future__ import annotations

import re
from typing import Final

from aiohttp import web

from haru_sim._config import SLEEP_MODES, SleepMode
from haru_sim._engine import SimulatedFaultError
from haru_sim._vllm_http import ENGINE_KEY, bad_request, internal_error

_INT_RE: Final = re.compile(r"[+-]?[0-9]+")
_PROMETHEUS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


async def health(_request: web.Request) -> web.StreamResponse:
    # 200 with an empty body, also while asleep: /health proves liveness, not wakefulness.
    return web.Response(status=200)


async def version(request: web.Request) -> web.StreamResponse:
    # Always served (vllm/entrypoints/serve/instrumentator/basic.py).
    return web.json_response({"version": request.app[ENGINE_KEY].config.vllm_version})


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


async def metrics(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    if not engine.config.log_stats:
        # --disable-log-stats: no PrometheusStatLogger, so no vllm:* metric at all; the
        # route still serves the process collectors.
        text = (
            "# HELP python_info Python platform information\n"
            "# TYPE python_info gauge\n"
            'python_info{implementation="CPython"} 1.0\n'
        )
        return web.Response(body=text.encode(), headers={"Content-Type": _PROMETHEUS_CONTENT_TYPE})
    model = _label(engine.config.primary_model_name)
    labels = f'engine="0",model_name="{model}"'
    level = engine.sleep_level
    sleep_state = {None: "awake", 0: "awake", 1: "weights_offloaded", 2: "discard_all"}[level]
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(engine.gauge_running)}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {float(engine.gauge_waiting)}",
        "# HELP vllm:engine_sleep_state Engine sleep state (1 for the current state).",
        "# TYPE vllm:engine_sleep_state gauge",
    ]
    for state in ("awake", "weights_offloaded", "discard_all"):
        value = 1.0 if state == sleep_state else 0.0
        lines.append(f'vllm:engine_sleep_state{{{labels},sleep_state="{state}"}} {value}')
    lines += [
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
    ]
    for reason in ("stop", "length", "abort"):
        count = float(engine.finished[reason])
        lines.append(
            f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
            f'model_name="{model}"}} {count}'
        )
    return web.Response(
        body=("\n".join(lines) + "\n").encode(),
        headers={"Content-Type": _PROMETHEUS_CONTENT_TYPE},
    )


def _query_level(request: web.Request) -> int:
    raw = request.query.get("level", "1")
    if not _INT_RE.fullmatch(raw.strip()):
        raise bad_request(f"level: Input should be a valid integer, got {raw!r}.", "level")
    level = int(raw)
    if not 0 <= level <= 2:
        raise bad_request(f"level: Input should be between 0 and 2, got {level}.", "level")
    return level


def _query_mode(request: web.Request) -> SleepMode:
    raw = request.query.get("mode", "abort")
    for mode in SLEEP_MODES:
        if raw == mode:
            return mode
    raise bad_request(f"mode: Input should be 'abort', 'wait' or 'keep', got {raw!r}.", "mode")


async def sleep(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    level = _query_level(request)
    # Before 0.17 there is no mode parameter: it is neither validated nor used.
    mode: SleepMode = _query_mode(request) if engine.config.sleep_pauses else "abort"
    try:
        await engine.run_detached(engine.sleep(level, mode))
    except SimulatedFaultError as exc:
        raise internal_error(str(exc)) from exc
    if not engine.config.admin_json_bodies:
        return web.Response(status=200)
    return web.json_response({"status": "sleeping", "level": level})


async def wake_up(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    tags = request.query.getall("tags", []) or None
    try:
        fully_awake = await engine.run_detached(engine.wake_up(tags))
    except SimulatedFaultError as exc:
        raise internal_error(str(exc)) from exc
    if not engine.config.admin_json_bodies:
        return web.Response(status=200)
    return web.json_response({"status": "awake" if fully_awake else "sleeping", "tags": tags})


async def is_sleeping(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    if engine.faults.is_sleeping_garbage:
        return web.json_response({"is_sleeping": "unknown"})
    # Answered by the engine loop: no answer while a sleep or wake runs in it.
    return web.json_response({"is_sleeping": await engine.is_sleeping_answer()})


SERVER_ROUTES: Final = (
    web.route("GET", "/health", health),
    web.route("GET", "/metrics", metrics),
    web.route("GET", "/version", version),
)
DEV_MODE_ROUTES: Final = (
    web.route("POST", "/sleep", sleep),
    web.route("POST", "/wake_up", wake_up),
    web.route("GET", "/is_sleeping", is_sleeping),
)
