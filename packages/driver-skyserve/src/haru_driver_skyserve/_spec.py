"""What a SkyServe service runs: a task plus its ``service:`` settings."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeGuard

from haru_driver_skypilot import InvalidSpecError, TaskSpec

# A URL path: starts with a slash, no whitespace or control characters.
_PATH_RE = re.compile(r"/[^\s\x00-\x1f\x7f]*")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """Everything :func:`~haru_driver_skyserve.render_service_yaml` needs.

    Attributes:
        task: The replica's task; ``task.name`` is also the service name (``-n``).
        readiness_path: Path SkyServe's readiness probe GETs on each replica.
        initial_delay_seconds: Grace before failed probes count (SkyServe's default, 1200 s,
            applies when ``None``).
        replicas: Fixed number of replicas.
        service_port: The replica port the load balancer sends traffic to
            (``service.ports``). Required when the task opens several ports; it must be one
            of them. With a single task port, ``None`` lets SkyServe use that port.
    """

    task: TaskSpec
    readiness_path: str = "/"
    initial_delay_seconds: int | None = None
    replicas: int = 1
    service_port: int | None = None

    def __post_init__(self) -> None:
        if _PATH_RE.fullmatch(self.readiness_path) is None:
            raise InvalidSpecError(
                f"readiness path {self.readiness_path!r} must start with '/' and hold no spaces"
            )
        delay: object = self.initial_delay_seconds
        if delay is not None and not (_is_int(delay) and delay >= 0):
            raise InvalidSpecError(f"initial_delay_seconds {delay!r} must be an int >= 0")
        replicas: object = self.replicas
        if not (_is_int(replicas) and replicas >= 1):
            raise InvalidSpecError(f"replicas {replicas!r} must be an int >= 1")
        port: object = self.service_port
        if port is None:
            if len(self.task.ports) != 1:
                raise InvalidSpecError(
                    "a service whose task opens "
                    f"{len(self.task.ports)} ports needs service_port (one of them)"
                )
        elif not _is_int(port) or port not in self.task.ports:
            raise InvalidSpecError(
                f"service_port {port!r} must be one of the task's ports {list(self.task.ports)!r}"
            )

    @property
    def name(self) -> str:
        """The service name (``sky serve up -n``): the task's name."""
        return self.task.name
