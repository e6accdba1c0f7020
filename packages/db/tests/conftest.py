"""Shared fixtures of haru-db's tests (the database fixtures come from haru_db.testing)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
import pytest_asyncio
from haru_db import StateStore
from haru_db._engine import create_engine
from haru_protocol import DomainState, FleetLayout, FleetSnapshot
from sqlalchemy.ext.asyncio import AsyncEngine

LayoutFactory = Callable[..., FleetLayout]


def _inference(gpu: int, *models: str) -> dict[str, Any]:
    return {
        "kind": "inference",
        "gpuIndex": gpu,
        "models": [{"name": m, "servingUrl": f"http://127.0.0.1:9000/{m}"} for m in models],
    }


def _training(gpu: int) -> dict[str, Any]:
    return {
        "kind": "training",
        "gpuIndex": gpu,
        "command": ["python", "-m", "trainer"],
        "checkpointDir": f"/var/lib/haru/ckpt-{gpu}",
    }


def _domain(
    slug: str, *, provider: str = "static", slots: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    document: dict[str, Any] = {
        "slug": slug,
        "provider": provider,
        "placement": {"cloud": "aws", "region": "us-east-1", "accelerator": "EXAMPLE-GPU"},
        "supervisorUrl": f"http://{slug}.internal:8701",
        "servingBaseUrl": f"http://{slug}.internal:8000",
        "slots": slots
        if slots is not None
        else [
            _inference(0, f"{slug}-small", f"{slug}-medium"),
            _training(0),
            _inference(1, f"{slug}-large"),
            _training(1),
        ],
    }
    if provider != "static":
        # Haru records a provisioned domain's URLs once its machine is up.
        del document["supervisorUrl"], document["servingBaseUrl"]
        for slot in document["slots"]:
            for model in slot.get("models", ()):
                model.pop("servingUrl", None)
    return document


@pytest.fixture
def now() -> datetime:
    """The app clock of a test (fixed: the database clock is never used)."""
    return datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


@pytest.fixture
def make_layout() -> LayoutFactory:
    """``make_layout(slug="f", active="alpha", domains=[...], policy=None)`` -> FleetLayout.

    ``domains`` items are slugs (a default static domain with four slots) or raw dicts.
    """

    def factory(
        slug: str = "fleet",
        *,
        active: str | None = "alpha",
        domains: list[str | dict[str, Any]] | None = None,
        policy: dict[str, Any] | None = None,
        display_name: str | None = "Test fleet",
    ) -> FleetLayout:
        items = domains if domains is not None else ["alpha", "beta"]
        document: dict[str, Any] = {
            "slug": slug,
            "domains": [_domain(d) if isinstance(d, str) else d for d in items],
        }
        if active is not None:
            document["activeDomainSlug"] = active
        if policy is not None:
            document["policy"] = policy
        if display_name is not None:
            document["displayName"] = display_name
        return FleetLayout.model_validate(document)

    return factory


@pytest.fixture
def domain_document() -> Callable[..., dict[str, Any]]:
    """``domain_document(slug, provider=..., slots=[...])`` -> a raw layout domain."""
    return _domain


@pytest.fixture
def slot_document() -> Callable[..., dict[str, Any]]:
    """``slot_document("inference", gpu, *models)`` or ``slot_document("training", gpu)``."""

    def factory(kind: str, gpu: int, *models: str) -> dict[str, Any]:
        return _inference(gpu, *models) if kind == "inference" else _training(gpu)

    return factory


@pytest.fixture
def fleet_layout(make_layout: LayoutFactory) -> FleetLayout:
    """The default two-domain layout (slug ``fleet``, alpha declared active)."""
    return make_layout()


@pytest_asyncio.fixture
async def fleet(store: StateStore, make_layout: LayoutFactory, now: datetime) -> FleetSnapshot:
    """A two-domain fleet (alpha active and serving, beta standby asleep), applied and then
    confirmed ready (what the first good heartbeat of each domain does)."""
    await store.apply_fleet_layout(make_layout(), at=now)
    applied = await store.get_fleet_snapshot("fleet")
    assert applied is not None
    for domain in applied.domains:
        assert await store.transition_domain(
            domain.id, from_states=[DomainState.PROVISIONING], to=DomainState.READY, at=now
        )
    snapshot = await store.get_fleet_snapshot("fleet")
    assert snapshot is not None
    return snapshot


@pytest_asyncio.fixture
async def raw_engine(store: StateStore) -> AsyncIterator[AsyncEngine]:
    """A second engine on the store's database, to force rows the API would never write."""
    engine = create_engine(store.url)
    try:
        yield engine
    finally:
        await engine.dispose()
