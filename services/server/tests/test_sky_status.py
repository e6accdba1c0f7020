"""The batched ``sky status`` read: domains out of step still share one read.

A controlled backend stands in for ``sky`` (each read waits until the test lets it end), so
the order of asks, takes and reads is exact; ``test_provisioning.py`` runs the same path
against the fake ``sky`` executable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import cast
from uuid import uuid4

from haru_driver_skypilot import DomainDriver
from haru_protocol import DomainSnapshot, DomainState, Placement, Provider
from haru_server._backends import ClusterBackend, Observed
from haru_server._provisioning_memory import DomainMemory, ProvisionerOptions
from haru_server._sky_status import StatusReads

INIT = Observed(shown="INIT", launched=True, addressable=False, lost=False)


class HeldReads(ClusterBackend):
    """Each batched read records its names and ends only when the test says so."""

    def __init__(self) -> None:
        super().__init__(cast(DomainDriver, None))
        self.names: list[list[str]] = []
        self._ends: list[asyncio.Event] = []

    async def read_statuses(self, names: Sequence[str], *, refresh: bool) -> dict[str, Observed]:
        end = asyncio.Event()
        self.names.append(list(names))
        self._ends.append(end)
        await end.wait()
        return dict.fromkeys(names, INIT)

    async def end_read(self, reads: StatusReads) -> None:
        self._ends[-1].set()
        for task in reads.tasks():
            await task


def domain(slug: str) -> DomainSnapshot:
    return DomainSnapshot(
        id=uuid4(),
        fleet_id=uuid4(),
        slug=slug,
        state=DomainState.PROVISIONING,
        provider=Provider.SKYPILOT,
        placement=Placement.model_validate(
            {"cloud": "gcp", "region": "us-central1", "accelerator": "L4"}
        ),
        supervisor_url=None,
        serving_base_url=None,
        last_seen_at=None,
        state_updated_at=datetime(2030, 1, 1, tzinfo=UTC),
        slots=(),
    )


async def test_a_domain_that_asks_during_a_read_shares_the_next_one() -> None:
    backend = HeldReads()
    reads = StatusReads(
        cast(DomainDriver, None),
        backend,
        {},
        ProvisionerOptions(status_interval_s=0, preflight=False),
    )
    domains = {"alpha": domain("alpha"), "beta": domain("beta")}
    memory = {"alpha": DomainMemory(), "beta": DomainMemory()}

    async def round_(*slugs: str) -> dict[str, Observed | None]:
        """One provisioning round: each domain asks (or takes), then the read starts."""
        got = {s: await reads.status(domains[s], s, memory[s]) for s in slugs}
        reads.start_read()
        await asyncio.sleep(0)  # a read started runs up to its wait
        return got

    assert await round_("alpha") == {"alpha": None}
    assert backend.names == [["alpha"]]
    # A slow tick: the read ends before the next round. beta's launch has ended: alpha takes
    # its result and beta asks in the same round, so the next read names both (alpha asks
    # again next round). Started at beta's ask, it would have named beta alone, and from
    # then on the two would take turns, never in one read.
    await backend.end_read(reads)
    assert await round_("alpha", "beta") == {"alpha": INIT, "beta": None}
    assert backend.names == [["alpha"], ["alpha", "beta"]]
    for _ in range(4):
        await backend.end_read(reads)
        await round_("alpha", "beta")
    assert all(names == ["alpha", "beta"] for names in backend.names[1:])
    assert len(backend.names) == 6


async def test_no_read_starts_while_nobody_waits() -> None:
    backend = HeldReads()
    reads = StatusReads(
        cast(DomainDriver, None),
        backend,
        {},
        ProvisionerOptions(status_interval_s=0, preflight=False),
    )
    alpha = domain("alpha")
    memory = DomainMemory()
    assert await reads.status(alpha, "alpha", memory) is None
    reads.start_read()
    await asyncio.sleep(0)
    await backend.end_read(reads)
    assert await reads.status(alpha, "alpha", memory) == INIT
    reads.start_read()  # alpha took its result and asked nothing yet
    await asyncio.sleep(0)
    assert backend.names == [["alpha"]]
    assert await reads.status(alpha, "alpha", memory) is None
    reads.start_read()
    await asyncio.sleep(0)
    assert backend.names == [["alpha"], ["alpha"]]
    await backend.end_read(reads)
