"""Audit event payloads of server processes: clock skew and partitions."""

from __future__ import annotations

from pydantic import (
    StrictInt,
)

from haru_protocol._enums import (
    EventType,
)
from haru_protocol._event_base import EventPayload


class _ServerClock(EventPayload):
    skew_ms: StrictInt
    """This process's wall clock minus the database's, in milliseconds."""
    max_skew_ms: StrictInt
    """Its ``HARU_MAX_CLOCK_SKEW_MS``."""
    host: str
    """The host name of the process."""
    pid: StrictInt


class ServerClockSkewed(_ServerClock):
    """``server.clock.skewed``: a server process's clock left the bound; it stops reconciling."""

    event_type = EventType.SERVER_CLOCK_SKEWED


class ServerClockRecovered(_ServerClock):
    """``server.clock.recovered``: a server process's clock is within the bound again."""

    event_type = EventType.SERVER_CLOCK_RECOVERED


class ServerPartitioned(EventPayload):
    """``server.partitioned``: a server process reached no supervisor of the fleet.

    It judges no domain and fails nothing over until one answers again (its own network, or
    every domain at once, cannot be told apart from there).
    """

    event_type = EventType.SERVER_PARTITIONED

    domains: StrictInt
    """How many supervisors it polled."""
    host: str
    pid: StrictInt


class ServerPartitionHealed(EventPayload):
    """``server.partition.healed``: a partitioned server process reaches a supervisor again."""

    event_type = EventType.SERVER_PARTITION_HEALED

    host: str
    pid: StrictInt
