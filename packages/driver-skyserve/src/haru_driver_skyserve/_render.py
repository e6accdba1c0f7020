"""Pure rendering of a :class:`ServiceSpec` into SkyServe service YAML (DESIGN 8)."""

from __future__ import annotations

from typing import Any

from haru_driver_skypilot import dump_yaml, task_config

from haru_driver_skyserve._spec import ServiceSpec


def service_config(spec: ServiceSpec) -> dict[str, Any]:
    """The service YAML of ``spec`` as a dict (what :func:`render_service_yaml` serialises)."""
    probe: str | dict[str, Any]
    if spec.initial_delay_seconds is None:
        probe = spec.readiness_path
    else:
        probe = {"path": spec.readiness_path, "initial_delay_seconds": spec.initial_delay_seconds}
    service: dict[str, Any] = {"readiness_probe": probe, "replicas": spec.replicas}
    if spec.service_port is not None:
        service["ports"] = spec.service_port
    config = task_config(spec.task)
    config["service"] = service
    return config


def render_service_yaml(spec: ServiceSpec) -> str:
    """Render ``spec`` as SkyServe service YAML: the task YAML plus a ``service:`` block.

    ``service`` holds ``readiness_probe`` (the bare path, or ``{path,
    initial_delay_seconds}`` when a delay is set), ``replicas`` and, when set, ``ports`` (an
    integer: SkyServe's replica ingress port).
    """
    return dump_yaml(service_config(spec))
