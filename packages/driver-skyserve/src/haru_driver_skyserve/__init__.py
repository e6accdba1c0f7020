"""SkyServe boundary of Haru: service YAML renderer and ``sky serve`` runner (DESIGN 8).

A domain with provider ``skyserve`` is one SkyServe service: a
:class:`~haru_driver_skypilot.TaskSpec` plus a readiness probe, replica count and service
port (:class:`ServiceSpec`), rendered by :func:`render_service_yaml` and driven by
:class:`SkyServeDriver`. Commands run through :class:`haru_driver_skypilot.SkyRunner`, so
failures raise haru_driver_skypilot's typed errors. Services depend on the
:class:`ServiceDriver` protocol so tests can inject fakes.
"""

from haru_driver_skyserve._domain import READINESS_PATH, domain_service, endpoint_url
from haru_driver_skyserve._driver import DOWN_POLL_S, ServiceDriver, SkyServeDriver
from haru_driver_skyserve._render import render_service_yaml, service_config
from haru_driver_skyserve._spec import ServiceSpec
from haru_driver_skyserve._status import (
    ServiceInfo,
    ServiceStatus,
    find_service,
    parse_service_status,
    service_info_from_record,
)

# Grouped by topic rather than sorted, so the public surface reads like a table of contents.
__all__ = (  # noqa: RUF022
    # Spec and rendering
    "ServiceSpec",
    "render_service_yaml",
    "service_config",
    # Provisioned domains (layout to service)
    "domain_service",
    "endpoint_url",
    "READINESS_PATH",
    # Status
    "ServiceInfo",
    "ServiceStatus",
    "parse_service_status",
    "service_info_from_record",
    "find_service",
    # Driver
    "ServiceDriver",
    "SkyServeDriver",
    "DOWN_POLL_S",
)
