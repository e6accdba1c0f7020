"""The standby duty cycle: how much of a standby domain's time its GPUs spent training.

When this process's heartbeat write for a domain that is not its fleet's active one and has
training slots replaced the stored heartbeat it had read (a compare-and-swap, so one process
per interval however many replicas reconcile), the time between the two is added to
``haru_standby_seconds_total``, and also to ``haru_standby_training_seconds_total`` when every
training slot was running (with a pid) at the earlier heartbeat. Their ratio is the share of
standby time whose GPUs trained: 1.0 means no idle standby GPU. Gaps longer than
:data:`MAX_STANDBY_GAP_S` (heartbeats stopped) are not counted either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Final
from uuid import UUID

from haru_protocol import (
    DomainSnapshot,
    FleetSnapshot,
    SlotKind,
    SupervisorStatus,
    TrainingRunState,
)
from prometheus_client import Counter, Gauge

MAX_STANDBY_GAP_S: Final = 60.0
"""A heartbeat gap longer than this is not attributed to the standby duty cycle."""


@dataclass(slots=True)
class _StandbyMark:
    at: datetime
    standby: bool
    training: bool


class StandbyDutyCycle:
    """What each answered heartbeat adds to the duty-cycle metrics (one instance per app).

    Args:
        seconds: ``haru_standby_seconds`` (by fleet and domain slug).
        training_seconds: ``haru_standby_training_seconds`` (likewise).
        ratio: ``haru_standby_duty_cycle_ratio``, set from this process's totals; None with
            several workers (``HARU_WORKERS``), whose scrape divides the merged counters.
    """

    def __init__(self, seconds: Counter, training_seconds: Counter, ratio: Gauge | None) -> None:
        self._seconds = seconds
        self._training_seconds = training_seconds
        self._ratio = ratio
        self._marks: dict[UUID, _StandbyMark] = {}
        self._totals: dict[tuple[str, str], list[float]] = {}

    def answered(
        self,
        fleet: FleetSnapshot,
        domain: DomainSnapshot,
        status: SupervisorStatus,
        at: datetime,
        replaced: datetime | None,
    ) -> None:
        """Count the standby interval the heartbeat ``status`` answered at ``at`` closes.

        ``replaced`` is the stored heartbeat time this process's write at ``at`` replaced (its
        compare-and-swap landed on it); None when it did not (another process's write came
        between, or nothing was stored). Only an interval this process replaced is counted,
        so replicas never count one twice. It is attributed to what the heartbeat at its start
        showed when this process made that one, else to what this one shows.
        """
        domain_id = domain.id
        training = [s.training for s in status.slots if s.kind is SlotKind.TRAINING]
        if not training:
            self._marks.pop(domain_id, None)
            return
        running = all(
            t is not None and t.state is TrainingRunState.RUNNING and t.pids for t in training
        )
        mark = _StandbyMark(at=at, standby=fleet.active_domain_id != domain_id, training=running)
        previous = self._marks.get(domain_id)
        self._marks[domain_id] = mark
        if replaced is None:
            return
        if previous is None or previous.at != replaced:
            previous = mark  # the replaced heartbeat was another process's
        if not previous.standby:
            return
        gap = (at - replaced).total_seconds()
        if not 0 < gap <= MAX_STANDBY_GAP_S:
            return
        labels = (fleet.slug, domain.slug)
        self._seconds.labels(*labels).inc(gap)
        if previous.training:
            self._training_seconds.labels(*labels).inc(gap)
        if self._ratio is None:
            return  # the scrape divides the merged counters (SharedCollector)
        totals = self._totals.setdefault(labels, [0.0, 0.0])
        totals[0] += gap
        totals[1] += gap if previous.training else 0.0
        self._ratio.labels(*labels).set(totals[1] / totals[0])
