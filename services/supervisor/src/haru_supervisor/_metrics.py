"""The supervisor's Prometheus metrics and the hook that counts and logs each admin call.

Every metric lives in the app's own registry. GPU memory and training-run gauges are refreshed
just before each scrape (local reads, bounded); the counters and durations move as admin calls
finish. Names follow Prometheus' conventions (``haru_supervisor_`` prefix, ``_total``,
``_seconds``, bytes); the supervisor README lists them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web
from haru_protocol import ProbeResult, TrainingRunState
from haru_web import observe_answer, service_registry
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from haru_supervisor._errors import GpuMemorySourceError, GpuMemoryUnavailable
from haru_supervisor._gpu import GpuMemoryReader
from haru_supervisor._training import TrainingRuns
from haru_supervisor._vllm import VllmAdminClient

logger = logging.getLogger("haru_supervisor.admin")

MIB: Final = 1024 * 1024
GPU_SCRAPE_TIMEOUT_S: Final = 2.0
"""Bound of the GPU memory read made for a scrape (the last values stay when it fails)."""

_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SupervisorMetrics:
    """The supervisor's metrics (one instance per app).

    Args:
        registry: Where the metrics live; a new private registry when None (which also gets
            the process, platform and garbage-collector metrics of prometheus_client).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else service_registry()
        r = self.registry
        self.admin_calls = Counter(
            "haru_supervisor_admin_calls",
            "Admin calls answered, by action and result (ok, rejected: 4xx, failed: 5xx).",
            ["action", "result"],
            registry=r,
        )
        self.action_seconds = Histogram(
            "haru_supervisor_action_duration_seconds",
            "Duration of sleep, wake, drain, training start/stop and probe actions.",
            ["action"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.training_runs = Gauge(
            "haru_supervisor_training_runs", "Training runs by state.", ["state"], registry=r
        )
        self.gpu_used = Gauge(
            "haru_supervisor_gpu_memory_used_bytes", "GPU memory in use.", ["gpu"], registry=r
        )
        self.gpu_total = Gauge(
            "haru_supervisor_gpu_memory_total_bytes", "GPU memory in all.", ["gpu"], registry=r
        )
        self.vllm_sleeping = Gauge(
            "haru_supervisor_vllm_sleeping",
            "1 when the model's vLLM server slept at its last status (heartbeat), 0 when awake; "
            "absent while unknown (an action in flight, no answer).",
            ["model"],
            registry=r,
        )
        self.probes = Counter(
            "haru_supervisor_probe_results",
            "Probe completions by model and result.",
            ["model", "result"],
            registry=r,
        )

    def drained(self, seconds: float) -> None:
        """A drain before a sleep ended after ``seconds`` (drained or out of budget)."""
        self.action_seconds.labels("drain").observe(seconds)

    def probed(self, results: tuple[ProbeResult, ...]) -> None:
        for result in results:
            self.probes.labels(result.model, "ok" if result.ok else "failed").inc()

    def before_scrape(
        self,
        runs: TrainingRuns,
        gpu: Callable[[], GpuMemoryReader | None],
        vllm: Callable[[], VllmAdminClient | None] = lambda: None,
    ) -> Callable[[], Awaitable[None]]:
        """The refresh run before each scrape.

        Training states, sleeping servers (as their last status said: no call to vLLM), then
        GPU memory (bounded).
        """

        async def refresh() -> None:
            counts = dict.fromkeys(TrainingRunState, 0)
            for status in await runs.statuses():
                counts[status.state] += 1
            for state, count in counts.items():
                self.training_runs.labels(state.value).set(count)
            client = vllm()
            if client is not None:
                self.vllm_sleeping.clear()
                for model, sleeping in client.last_sleeping().items():
                    if sleeping is not None:
                        self.vllm_sleeping.labels(model).set(1 if sleeping else 0)
            reader = gpu()
            if reader is None:
                return
            try:
                async with asyncio.timeout(GPU_SCRAPE_TIMEOUT_S):
                    gpus = await reader.read()
            except (GpuMemoryUnavailable, GpuMemorySourceError, TimeoutError) as exc:
                logger.debug("GPU memory not refreshed for the scrape: %s", exc)
                return
            for entry in gpus:
                self.gpu_used.labels(str(entry.index)).set(entry.used_mib * MIB)
                self.gpu_total.labels(str(entry.index)).set(entry.total_mib * MIB)

        return refresh


metrics_key: Final = web.AppKey("haru_supervisor_metrics", SupervisorMetrics)


def _result(status: int) -> str:
    if status < 400:
        return "ok"
    return "rejected" if status < 500 else "failed"


def admin_call(action: str) -> Callable[[Handler], Handler]:
    """Count, time and log one admin route (``action`` names it in metrics and logs)."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def observed(request: web.Request) -> web.StreamResponse:
            def record(status: int, seconds: float) -> None:
                metrics = request.app[metrics_key]
                result = _result(status)
                metrics.admin_calls.labels(action, result).inc()
                metrics.action_seconds.labels(action).observe(seconds)
                logger.info(
                    "admin %s %s (%d) in %.3fs",
                    action,
                    result,
                    status,
                    seconds,
                    extra={
                        "action": action,
                        "result": result,
                        "status": status,
                        "duration_s": round(seconds, 6),
                    },
                )

            return await observe_answer(request, handler, record)

        return observed

    return decorate
