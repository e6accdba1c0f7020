"""``GET /readyz``: whether this supervisor can do its job (liveness is ``/healthz``).

Ready when its config is loaded (it is, once the application exists), its GPU memory source
answers, and every local vLLM server of its config answers ``/is_sleeping`` (asleep counts:
a standby is ready). Otherwise 503 ``not_ready`` in the error envelope, saying why.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from haru_protocol import ErrorCode, Readiness
from haru_web import ApiError

from haru_supervisor._errors import GpuMemoryError
from haru_supervisor._keys import gpu_key, settings_key, vllm_key

ready_routes = web.RouteTableDef()

GPU_READ_TIMEOUT_S = 10.0
"""Bound on the GPU memory read of one readiness check (``nvidia-smi`` can hang)."""


def _not_ready(reason: str) -> ApiError:
    return ApiError(ErrorCode.NOT_READY, f"not ready: {reason}")


@ready_routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    config = request.app[settings_key].config
    checks = ["config"]
    checks.append("GPU memory source")
    try:
        async with asyncio.timeout(GPU_READ_TIMEOUT_S):
            await request.app[gpu_key].read()
    except GpuMemoryError as exc:
        raise _not_ready(f"GPU memory source: {exc}") from None
    except TimeoutError:
        raise _not_ready(
            f"GPU memory source: no answer within {GPU_READ_TIMEOUT_S:.0f} s"
        ) from None
    models = [model for slot in config.inference_slots for model in slot.models]
    if models:
        checks.append("vLLM servers")
        client = request.app[vllm_key]
        answers = await asyncio.gather(*(client.is_sleeping(model) for model in models))
        silent = [
            f"{m.name} (port {m.port})" for m, a in zip(models, answers, strict=True) if a is None
        ]
        if silent:
            raise _not_ready(
                f"{len(silent)} of {len(models)} vLLM server(s) do not answer: " + ", ".join(silent)
            )
    return web.json_response(text=Readiness(checks=tuple(checks)).model_dump_json())
