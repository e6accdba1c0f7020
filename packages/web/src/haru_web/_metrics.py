"""``GET /metrics`` in Prometheus' text format, from a registry that belongs to one app.

Each application owns its :class:`prometheus_client.CollectorRegistry` (never the process-wide
default): two apps in one process (a test, the local fleet) keep separate counters. The route
sits behind the bearer token like ``/v1/*`` unless the operator opts out
(``HARU_METRICS_PUBLIC=1``, for a Prometheus that cannot present a token).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    generate_latest,
)

from haru_web._middleware import is_api_path

METRICS_PATH: Final = "/metrics"

BeforeScrape = Callable[[], Awaitable[None]]


def service_registry() -> CollectorRegistry:
    """A new registry for one app, with prometheus_client's process and runtime metrics.

    ``process_*`` (RSS, CPU, open files) and ``python_*`` (platform, garbage collector) sit
    beside the app's own metrics.
    """
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


def metrics_guarded(*, public: bool) -> Callable[[str], bool]:
    """The paths the bearer token guards: ``/v1`` and below, and ``/metrics`` unless public."""
    if public:
        return is_api_path

    def guarded(path: str) -> bool:
        return is_api_path(path) or path == METRICS_PATH

    return guarded


def add_metrics_route(
    app: web.Application,
    registry: CollectorRegistry,
    *,
    before_scrape: BeforeScrape | None = None,
) -> None:
    """Serve ``registry`` at ``GET /metrics``.

    Args:
        app: The application, not yet started.
        registry: The app's own registry.
        before_scrape: Refreshes gauges read from memory or a local source (never a database)
            just before rendering; it must be bounded and must not raise.
    """

    async def metrics(_request: web.Request) -> web.Response:
        if before_scrape is not None:
            await before_scrape()
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app.router.add_get(METRICS_PATH, metrics, allow_head=False)
