"""Cluster status: the vocabulary, the typed record, parsing of ``sky status -o json``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from haru_driver_skypilot._errors import SkyOutputError, UnknownStatusError
from haru_driver_skypilot._runner import strip_ansi


class ClusterStatus(StrEnum):
    """``sky.utils.status_lib.ClusterStatus`` (SkyPilot 0.14)."""

    INIT = "INIT"
    """Launching, or flipped back to INIT because a node is unhealthy (see ``init_kind``)."""
    UP = "UP"
    """Provisioned and healthy."""
    STOPPED = "STOPPED"
    """Stopped: disks kept, no compute billed."""
    AUTOSTOPPING = "AUTOSTOPPING"
    """Autostop in progress."""
    PENDING = "PENDING"
    """Waiting for capacity (display status of queued launches)."""


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """What Haru keeps of one ``sky status`` record.

    Attributes:
        name: Cluster name.
        status: Cluster status.
        launched_at: When the cluster was (last) launched, UTC; ``None`` if not reported.
        cloud: Cloud as SkyPilot displays it (e.g. ``"AWS"``); ``None`` if not reported.
        region: Region; ``None`` if not reported.
        resources: SkyPilot's one-line resources summary (``resources_str``).
        nodes: Number of nodes.
        autostop_minutes: Idle minutes before autostop; ``None`` when autostop is off.
        to_down: Whether autostop tears the cluster down instead of stopping it.
        init_kind: For ``INIT``: ``"launching"`` or ``"unhealthy"``; else ``None``.
        status_reason: SkyPilot's explanation of an ``INIT`` status, if any.
    """

    name: str
    status: ClusterStatus
    launched_at: datetime | None = None
    cloud: str | None = None
    region: str | None = None
    resources: str | None = None
    nodes: int | None = None
    autostop_minutes: int | None = None
    to_down: bool = False
    init_kind: str | None = None
    status_reason: str | None = None


def _opt_str(record: Mapping[str, object], key: str) -> str | None:
    value = record.get(key)
    return value if isinstance(value, str) and value else None


def _opt_int(record: Mapping[str, object], key: str) -> int | None:
    value = record.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _status_value(value: object) -> object:
    # SDK records carry enum members (`ClusterStatus.UP`), JSON records their values ("UP").
    enum_value = getattr(value, "value", None)
    return enum_value if isinstance(enum_value, str) else value


def cluster_info_from_record(
    record: Mapping[str, object], *, argv: Sequence[str] | None = None
) -> ClusterInfo:
    """Map one SkyPilot status record to a :class:`ClusterInfo`.

    Works for the objects of ``sky status -o json`` (``StatusResponse.model_dump(mode="json")``)
    and for SDK records whose ``status`` is still an enum member.

    Args:
        record: The record.
        argv: The command that printed it, for error messages; ``None`` for SDK records.

    Raises:
        SkyOutputError: ``name`` or ``status`` is missing or not a string.
        UnknownStatusError: the status is not a :class:`ClusterStatus`.
    """
    name = record.get("name")
    status = _status_value(record.get("status"))
    if not isinstance(name, str) or not isinstance(status, str):
        raise SkyOutputError(
            "status record lacks a string `name` and `status`", argv=argv, output=repr(record)
        )
    try:
        cluster_status = ClusterStatus(status)
    except ValueError:
        raise UnknownStatusError(
            f"cluster {name!r} has unknown status {status!r}",
            status=status,
            argv=argv,
            output=repr(record),
        ) from None
    launched = _opt_int(record, "launched_at")
    autostop = _opt_int(record, "autostop")
    to_down = record.get("to_down")
    return ClusterInfo(
        name=name,
        status=cluster_status,
        launched_at=None if not launched else datetime.fromtimestamp(launched, tz=UTC),
        cloud=_opt_str(record, "cloud"),
        region=_opt_str(record, "region"),
        resources=_opt_str(record, "resources_str"),
        nodes=_opt_int(record, "nodes"),
        # SkyPilot uses -1 for "no autostop".
        autostop_minutes=autostop if autostop is not None and autostop >= 0 else None,
        to_down=to_down is True,
        init_kind=_opt_str(record, "init_kind"),
        status_reason=_opt_str(record, "init_status_reason"),
    )


def parse_status_json(stdout: str, *, argv: Sequence[str] | None = None) -> list[dict[str, object]]:
    """Extract the JSON list that ``sky status -o json`` prints.

    SkyPilot 0.14 can print human lines before the JSON on stdout (``Cluster(s) not found:
    <bold>x</bold>.`` for an unknown cluster, API-server start-up messages), so the list is
    parsed from the last line that starts with ``[`` (after removing ANSI codes) and from
    which a JSON list decodes.

    Raises:
        SkyOutputError: no JSON list of objects is in the output.
    """
    lines = strip_ansi(stdout).splitlines()
    decoder = json.JSONDecoder()
    for index in range(len(lines) - 1, -1, -1):
        if not lines[index].startswith("["):
            continue
        try:
            value, _end = decoder.raw_decode("\n".join(lines[index:]))
        except json.JSONDecodeError:
            continue
        if isinstance(value, list) and all(isinstance(item, dict) for item in value):
            return value
    raise SkyOutputError("`sky status -o json` printed no JSON list", argv=argv, output=stdout)


def find_cluster(
    records: Sequence[Mapping[str, object]], name: str, *, argv: Sequence[str] | None = None
) -> ClusterInfo | None:
    """The :class:`ClusterInfo` of ``name`` among ``records``, or ``None`` when absent."""
    for record in records:
        if record.get("name") == name:
            return cluster_info_from_record(record, argv=argv)
    return None
