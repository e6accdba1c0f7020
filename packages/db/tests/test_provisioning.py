"""Provisioned domains: the launch claim, its completion, and the recorded address."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from haru_db import DomainCert, StateStore
from haru_protocol import (
    DomainSnapshot,
    DomainState,
    FleetLayout,
    InferenceSlotSpec,
    Provider,
    Provisioning,
)

LayoutFactory = Callable[..., FleetLayout]


async def _gamma(
    store: StateStore, make_layout: LayoutFactory, doc: Callable[..., Any], now: datetime
) -> DomainSnapshot:
    await store.apply_fleet_layout(
        make_layout("fleet", domains=["alpha", doc("gamma", provider="skypilot")]), at=now
    )
    snapshot = await store.get_fleet_snapshot("fleet")
    assert snapshot is not None
    return snapshot.domains[1]


async def test_launch_claim_is_won_once(
    store: StateStore,
    make_layout: LayoutFactory,
    domain_document: Callable[..., Any],
    now: datetime,
) -> None:
    gamma = await _gamma(store, make_layout, domain_document, now)
    assert gamma.provider is Provider.SKYPILOT
    assert gamma.provisioning == Provisioning()
    assert (gamma.launch_attempt, gamma.launch_started_at, gamma.launched_at) == (0, None, None)
    assert await store.claim_launch(gamma.id, expected_attempt=0, at=now)
    # A second claimant (another process, or this one after a restart) loses.
    assert not await store.claim_launch(gamma.id, expected_attempt=0, at=now)
    later = now + timedelta(seconds=5)
    assert await store.mark_launched(gamma.id, attempt=1, at=later)
    assert not await store.mark_launched(gamma.id, attempt=1, at=later)
    snapshot = await store.get_fleet_snapshot("fleet")
    assert snapshot is not None
    gamma = snapshot.domains[1]
    assert (gamma.launch_attempt, gamma.launch_started_at, gamma.launched_at) == (1, now, later)


async def test_recorded_address_fills_the_serving_urls(
    store: StateStore,
    make_layout: LayoutFactory,
    domain_document: Callable[..., Any],
    now: datetime,
) -> None:
    gamma = await _gamma(store, make_layout, domain_document, now)
    slot = gamma.slots[0].spec
    assert isinstance(slot, InferenceSlotSpec)
    assert [m.serving_url for m in slot.models] == [None, None]
    urls = {"gamma-small": "http://10.0.0.9:8000/m/gamma-small"}
    # Only the current launch attempt may record its machine's address.
    assert not await store.record_domain_address(
        gamma.id,
        attempt=1,
        supervisor_url="http://10.0.0.9:8701",
        serving_base_url="http://10.0.0.9:8000",
        model_urls=urls,
        at=now,
    )
    assert await store.claim_launch(gamma.id, expected_attempt=0, at=now)
    assert await store.record_domain_address(
        gamma.id,
        attempt=1,
        supervisor_url="http://10.0.0.9:8701",
        serving_base_url="http://10.0.0.9:8000",
        model_urls=urls,
        at=now,
    )
    snapshot = await store.get_fleet_snapshot("fleet")
    assert snapshot is not None
    gamma = snapshot.domains[1]
    assert gamma.state is DomainState.PROVISIONING
    assert gamma.supervisor_url == "http://10.0.0.9:8701"
    assert gamma.serving_base_url == "http://10.0.0.9:8000"
    slot = gamma.slots[0].spec
    assert isinstance(slot, InferenceSlotSpec)
    assert [m.serving_url for m in slot.models] == [urls["gamma-small"], None]
    # The next launch claim forgets the old machine's addresses.
    assert await store.claim_launch(gamma.id, expected_attempt=1, at=now)
    snapshot = await store.get_fleet_snapshot("fleet")
    assert snapshot is not None
    assert snapshot.domains[1].supervisor_url is None
    slot = snapshot.domains[1].slots[0].spec
    assert isinstance(slot, InferenceSlotSpec)
    assert slot.models[0].serving_url is None


async def test_the_first_fleet_ca_wins_and_domain_certs_are_replaced_per_launch(
    store: StateStore,
    make_layout: LayoutFactory,
    domain_document: Callable[..., Any],
    now: datetime,
) -> None:
    gamma = await _gamma(store, make_layout, domain_document, now)
    assert await store.get_fleet_ca(gamma.fleet_id) is None
    first = await store.create_fleet_ca(gamma.fleet_id, cert_pem="CA-1", sealed_key="k1", at=now)
    # A racing process that made its own CA gets the stored one back: all agree on the first.
    second = await store.create_fleet_ca(gamma.fleet_id, cert_pem="CA-2", sealed_key="k2", at=now)
    assert (first.cert_pem, second.cert_pem, second.sealed_key) == ("CA-1", "CA-1", "k1")
    assert await store.get_fleet_ca(gamma.fleet_id) == first
    for attempt, digest in ((1, "a" * 64), (2, "b" * 64)):
        await store.record_domain_cert(
            DomainCert(
                domain_id=gamma.id,
                fleet_id=gamma.fleet_id,
                attempt=attempt,
                server_name="gamma.fleet.haru.internal",
                fingerprint=digest,
                not_after=now + timedelta(days=30),
                issued_at=now,
            )
        )
    [cert] = await store.list_domain_certs(gamma.fleet_id)
    assert (cert.attempt, cert.fingerprint, cert.not_after) == (
        2,
        "b" * 64,
        now + timedelta(days=30),
    )
