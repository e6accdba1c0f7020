"""The emulated vLLM OpenAI server as an aiohttp app: middlewares, route tables, lifecycle.

Shapes follow vLLM 0.33 (``vllm serve --enable-sleep-mode`` with ``VLLM_SERVER_DEV_MODE=1``).
The routes live in :mod:`haru_sim._vllm_inference` (OpenAI API), :mod:`haru_sim._vllm_admin`
(health, metrics, version, dev-mode sleep) and :mod:`haru_sim._vllm_control` (the sim's own
``/_sim/*``). See the package README for every route and knob.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Final

from aiohttp import web

from haru_sim._config import VllmSimConfig
from haru_sim._engine import Engine
from haru_sim._vllm_admin import DEV_MODE_ROUTES, SERVER_ROUTES
from haru_sim._vllm_control import CONTROL_ROUTES
from haru_sim._vllm_http import ENGINE_KEY, auth_middleware, error_middleware, fault_middleware
from haru_sim._vllm_inference import INFERENCE_ROUTES

# vLLM puts no cap of its own on bodies; Haru's proxy default is 32 MiB, so leave room above it.
_MAX_BODY_BYTES: Final = 64 * 1024 * 1024


async def _close_engine(app: web.Application) -> None:
    # on_shutdown runs before aiohttp waits for handlers: release parked and hung requests.
    app[ENGINE_KEY].close()


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    app[ENGINE_KEY].start_stepping()
    yield
    engine = app[ENGINE_KEY]
    engine.close()
    await engine.wait_detached()


def build_app(engine: Engine, *, control_only: bool = False) -> web.Application:
    """Assemble the aiohttp app around ``engine`` (``control_only``: just ``/_sim/*``)."""
    app = web.Application(
        middlewares=[error_middleware, fault_middleware, auth_middleware],
        client_max_size=_MAX_BODY_BYTES,
    )
    app[ENGINE_KEY] = engine
    app.on_shutdown.append(_close_engine)
    app.cleanup_ctx.append(_engine_ctx)
    app.router.add_routes(CONTROL_ROUTES)
    if control_only:
        return app
    app.router.add_routes(INFERENCE_ROUTES)
    app.router.add_routes(SERVER_ROUTES)
    if engine.config.dev_mode:
        app.router.add_routes(DEV_MODE_ROUTES)
    return app


def create_vllm_app(config: VllmSimConfig | None = None) -> web.Application:
    """Build an emulated vLLM server as an aiohttp app (for ``aiohttp_client``/``aiohttp_server``).

    Faults are set through ``POST /_sim/faults``. The ``refuse`` fault is unavailable here
    (answered 409): closing the listener needs a server started by :class:`VllmSim`.

    Args:
        config: The server's configuration; defaults to ``VllmSimConfig()``.

    Returns:
        A fresh, unstarted application.
    """
    return build_app(Engine(config if config is not None else VllmSimConfig()))
