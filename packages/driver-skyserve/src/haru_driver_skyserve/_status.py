"""Service status: SkyServe's vocabulary, the typed record, and parsing of ``sky serve status``."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from haru_driver_skypilot import SkyOutputError, UnknownStatusError, strip_ansi


class ServiceStatus(StrEnum):
    """``sky.serve.ServiceStatus`` (SkyPilot 0.14, ``sky/serve/serve_state.py``)."""

    CONTROLLER_INIT = "CONTROLLER_INIT"
    """The controller is initialising."""
    REPLICA_INIT = "REPLICA_INIT"
    """Replicas are initialising, none failed."""
    CONTROLLER_FAILED = "CONTROLLER_FAILED"
    """The controller or load balancer failed."""
    READY = "READY"
    """At least one replica is ready."""
    SHUTTING_DOWN = "SHUTTING_DOWN"
    """The service is shutting down."""
    FAILED = "FAILED"
    """At least one replica failed and none is ready."""
    FAILED_CLEANUP = "FAILED_CLEANUP"
    """Clean-up failed: resources may have leaked."""
    NO_REPLICA = "NO_REPLICA"
    """No replica (e.g. scaled to zero). The CLI's help spells it NO_REPLICAS; this is the value."""


# `ReplicaStatus.failed_statuses()`: replicas SkyServe does not count in REPLICAS' total.
_FAILED_REPLICA_STATUSES = frozenset(
    {
        "FAILED",
        "FAILED_CLEANUP",
        "FAILED_INITIAL_DELAY",
        "FAILED_PROBING",
        "FAILED_PROVISION",
        "UNKNOWN",
    }
)

_COLUMNS = ("NAME", "VERSION", "UPTIME", "STATUS", "REPLICAS", "ENDPOINT")
_HEADER_RE = re.compile(r"NAME\s+VERSION\s+UPTIME\s+STATUS\s+REPLICAS\s+ENDPOINT(\s|$)")
_REPLICAS_RE = re.compile(r"(\d+)/(\d+)")
_NO_SERVICES = ("No live services.", "No existing services.")


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    """What Haru keeps of one SkyServe service's status.

    Attributes:
        name: Service name.
        status: Service status.
        versions: Active versions (more than one during a rolling update).
        ready_replicas: Replicas that passed the readiness probe.
        total_replicas: Replicas not in a failed state.
        endpoint: The load balancer's endpoint (``host:port`` or URL); ``None`` before it has
            one.
    """

    name: str
    status: ServiceStatus
    versions: tuple[int, ...] = ()
    ready_replicas: int | None = None
    total_replicas: int | None = None
    endpoint: str | None = None


def _service_status(
    value: object, *, name: str, argv: Sequence[str] | None, output: str
) -> ServiceStatus:
    enum_value = getattr(value, "value", None)
    raw = enum_value if isinstance(enum_value, str) else value
    if not isinstance(raw, str):
        raise SkyOutputError(f"service {name!r} has no string status", argv=argv, output=output)
    try:
        return ServiceStatus(raw)
    except ValueError:
        raise UnknownStatusError(
            f"service {name!r} has unknown status {raw!r}", status=raw, argv=argv, output=output
        ) from None


def _versions(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        return ()
    return tuple(int(p) for p in parts)


def _columns(header: str) -> list[tuple[str, int]]:
    return [(m.group(), m.start()) for m in re.finditer(r"\S+", header)]


def _cells(line: str, columns: list[tuple[str, int]]) -> dict[str, str]:
    cells: dict[str, str] = {}
    for index, (title, start) in enumerate(columns):
        end = columns[index + 1][1] if index + 1 < len(columns) else len(line)
        cells[title] = line[start:end].strip()
    return cells


def parse_service_status(
    stdout: str, name: str, *, argv: Sequence[str] | None = None
) -> ServiceInfo | None:
    """Find ``name`` in the output of ``sky serve status NAME``.

    ``sky serve status`` has no JSON flag, so this reads its table (``NAME VERSION UPTIME
    STATUS REPLICAS ENDPOINT``) after removing ANSI codes. Cells are cut at the header's
    column offsets (the table is left-aligned and padded), so values with spaces, such as
    an uptime of ``1h 2m 3s``, stay whole.

    Returns:
        The service's status, or ``None`` when SkyServe reports it absent (``No live
        services.``, ``No existing services.``, ``Service 'NAME' not found.``).

    Raises:
        UnknownStatusError: the service's STATUS is not a :class:`ServiceStatus`.
        SkyOutputError: the output is neither a table holding ``name`` nor an absence
            message (e.g. the controller is still starting and printed a notice).
    """
    text = strip_ansi(stdout)
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if _HEADER_RE.match(line) is None:
            continue
        columns = _columns(line)
        for row in lines[index + 1 :]:
            if not row.strip():
                break
            cells = _cells(row, columns)
            if cells.get("NAME") != name:
                continue
            replicas = _REPLICAS_RE.fullmatch(cells.get("REPLICAS", ""))
            endpoint = cells.get("ENDPOINT", "")
            return ServiceInfo(
                name=name,
                status=_service_status(cells.get("STATUS"), name=name, argv=argv, output=stdout),
                versions=_versions(cells.get("VERSION", "")),
                ready_replicas=None if replicas is None else int(replicas.group(1)),
                total_replicas=None if replicas is None else int(replicas.group(2)),
                endpoint=None if endpoint in {"", "-"} else endpoint,
            )
        break
    stripped = [line.strip() for line in lines]
    if any(line in _NO_SERVICES for line in stripped) or f"Service {name!r} not found." in stripped:
        return None
    raise SkyOutputError(
        f"`sky serve status` output neither lists {name!r} nor says it is absent",
        argv=argv,
        output=stdout,
    )


def _status_name(value: object) -> str | None:
    enum_value = getattr(value, "value", None)
    raw = enum_value if isinstance(enum_value, str) else value
    return raw if isinstance(raw, str) else None


def service_info_from_record(record: Mapping[str, object]) -> ServiceInfo:
    """Map one SkyServe SDK record (``sky.get(sky.serve.status(...))``) to :class:`ServiceInfo`.

    Replica counts follow the CLI's REPLICAS column: ready = replicas whose status is
    ``READY``; total = replicas not in a failed status.

    Raises:
        SkyOutputError: ``name`` or ``status`` is missing, or ``replica_info`` is malformed.
        UnknownStatusError: the status is not a :class:`ServiceStatus`.
    """
    name = record.get("name")
    if not isinstance(name, str):
        raise SkyOutputError("service record lacks a string `name`", argv=None, output=repr(record))
    status = _service_status(record.get("status"), name=name, argv=None, output=repr(record))
    raw_versions = record.get("active_versions")
    versions: tuple[int, ...] = ()
    if isinstance(raw_versions, list | tuple):
        versions = tuple(v for v in raw_versions if isinstance(v, int) and not isinstance(v, bool))
    ready: int | None = None
    total: int | None = None
    replica_info = record.get("replica_info")
    if replica_info is not None:
        if not isinstance(replica_info, list | tuple) or not all(
            isinstance(r, Mapping) for r in replica_info
        ):
            raise SkyOutputError(
                f"service {name!r} has malformed replica_info", argv=None, output=repr(record)
            )
        statuses = [_status_name(r.get("status")) for r in replica_info]
        ready = sum(1 for s in statuses if s == "READY")
        total = sum(1 for s in statuses if s not in _FAILED_REPLICA_STATUSES)
    endpoint = record.get("endpoint")
    return ServiceInfo(
        name=name,
        status=status,
        versions=versions,
        ready_replicas=ready,
        total_replicas=total,
        endpoint=endpoint if isinstance(endpoint, str) and endpoint else None,
    )


def find_service(records: Sequence[Mapping[str, object]], name: str) -> ServiceInfo | None:
    """The :class:`ServiceInfo` of ``name`` among SDK ``records``, or ``None`` when absent."""
    for record in records:
        if record.get("name") == name:
            return service_info_from_record(record)
    return None
