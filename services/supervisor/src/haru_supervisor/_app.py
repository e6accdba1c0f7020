"""The aiohttp application: state behind typed keys, lifecycles in ``cleanup_ctx``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web
from haru_exec import Exec, run_exec
from haru_web import add_metrics_route, service_app

from haru_supervisor._actions import AdminActions
from haru_supervisor._fence import FenceBook
from haru_supervisor._gpu import NvmlLoader, load_pynvml, open_gpu_reader
from haru_supervisor._keys import (
    actions_key,
    fences_key,
    gpu_key,
    runs_key,
    settings_key,
    vllm_key,
)
from haru_supervisor._metrics import SupervisorMetrics, metrics_key
from haru_supervisor._ready import ready_routes
from haru_supervisor._routes import MAX_BODY_BYTES, routes
from haru_supervisor._settings import Settings
from haru_supervisor._training import DEFAULT_POLL_S, TrainingRuns
from haru_supervisor._vllm import VllmAdminClient, VllmTimeouts
from haru_supervisor.openapi import api_table

VLLM_KEEPALIVE_S = 2.0
"""How long an idle connection to a local vLLM server is kept (uvicorn closes at 5 s)."""

Clock = Callable[[], float]


def create_app(
    settings: Settings,
    *,
    exec_: Exec = run_exec,
    nvml_loader: NvmlLoader = load_pynvml,
    vllm_timeouts: VllmTimeouts | None = None,
    clock: Clock = time.monotonic,
    training_poll_s: float = DEFAULT_POLL_S,
) -> web.Application:
    """Build the supervisor's application.

    Args:
        settings: Parsed start-up settings.
        exec_: Runs ``nvidia-smi`` (tests inject a fake).
        nvml_loader: Imports the NVML bindings (tests inject a fake).
        vllm_timeouts: Bounds on calls to the local vLLM servers.
        clock: Monotonic seconds, for drain budgets, kill deadlines and probe latency.
        training_poll_s: How often a stopping run checks for surviving processes.

    Returns:
        The application. Its cleanup stops every training run (SIGTERM, then SIGKILL after
        ``settings.shutdown_grace_s``) before anything else is released.
    """
    # Asked per request: a rotated HARU_SUPERVISOR_TOKEN_FILE needs no restart.
    app = service_app(
        settings, settings.token_source(), api_table(), client_max_size=MAX_BODY_BYTES
    )
    metrics = SupervisorMetrics()
    app[metrics_key] = metrics
    app[settings_key] = settings
    app[actions_key] = AdminActions()
    app[fences_key] = FenceBook()
    runs = TrainingRuns(
        settings.config.training_slots,
        base_env=settings.trainer_env,
        clock=clock,
        poll_s=training_poll_s,
    )
    app[runs_key] = runs
    add_metrics_route(
        app,
        metrics.registry,
        before_scrape=metrics.before_scrape(
            runs, lambda: app.get(gpu_key), lambda: app.get(vllm_key)
        ),
    )

    async def http_ctx(app: web.Application) -> AsyncIterator[None]:
        # One session for every local call. Idle connections are dropped after 2 s, well
        # before uvicorn closes its side (5 s): a sleep sent on a connection the server is
        # closing would fail for nothing, while the rapid polls of a promotion reuse theirs.
        # No proxy from the environment either: the targets are on the loopback interface.
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(keepalive_timeout=VLLM_KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=None),
            trust_env=False,
        )
        client = VllmAdminClient(
            session,
            timeouts=vllm_timeouts,
            clock=clock,
            api_keys=settings.vllm_api_keys,
            on_drain=metrics.drained,
        )
        app[vllm_key] = client
        # Each server's version (and gauges) read once at start-up, concurrently; a server
        # not up yet is read when it first answers.
        models = [m for slot in settings.config.inference_slots for m in slot.models]
        await asyncio.gather(*(client.connect(model) for model in models))
        try:
            yield
        finally:
            await session.close()

    async def gpu_ctx(app: web.Application) -> AsyncIterator[None]:
        reader = await open_gpu_reader(
            settings.gpu_source,
            exec_=exec_,
            nvml_loader=nvml_loader,
            search_path=settings.search_path,
        )
        app[gpu_key] = reader
        try:
            yield
        finally:
            reader.close()

    async def training_ctx(app: web.Application) -> AsyncIterator[None]:
        yield
        await app[actions_key].close()
        # Last line of defence (the entry point already did this before it stopped
        # listening): no trainer outlives the application.
        await app[runs_key].shutdown(settings.shutdown_grace_s)

    app.cleanup_ctx.extend([http_ctx, gpu_ctx, training_ctx])
    app.add_routes(routes)
    app.add_routes(ready_routes)
    return app
