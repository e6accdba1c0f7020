"""Routable models, binding lookup and the route intent of DESIGN 7.4."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import pytest
from haru_core import build_route_intent, find_routable_binding, rank_standbys, routable_models
from haru_protocol import DomainState, FleetSnapshot, InferenceSlotState, RouteIntent

if TYPE_CHECKING:
    from conftest import FleetFactory

I = InferenceSlotState  # noqa: E741 -- short alias for the tables below
D = DomainState


def two_slot_fleet(
    make: FleetFactory,
    *,
    state: DomainState = D.READY,
    gpu0: InferenceSlotState = I.SERVING,
    gpu1: InferenceSlotState = I.SERVING,
    serving: bool = True,
) -> FleetSnapshot:
    return make.fleet(
        make.domain(
            "alpha",
            state=state,
            serving=serving,
            slots=[
                make.inference(0, "small", "medium", state=gpu0),
                make.inference(1, "large", state=gpu1),
                make.training(0),
            ],
        ),
        make.domain("beta", slots=[make.inference(0, "small", state=I.SLEEPING)]),
        active="alpha",
    )


# ---- routable models / binding lookup ----


@pytest.mark.parametrize("state", [D.READY, D.DEGRADED])
def test_routable_models_of_a_routable_active(make: FleetFactory, state: DomainState) -> None:
    fleet = two_slot_fleet(make, state=state, gpu1=I.FAILED)
    models = routable_models(fleet)
    assert [(m.name, m.eligible) for m in models] == [("small", True), ("medium", True)]
    assert models[0].serving_url == "http://alpha.test:8000/small"


@pytest.mark.parametrize("state", [D.PROVISIONING, D.FAILED, D.STOPPING, D.STOPPED])
def test_nothing_routable_when_active_not_routable(make: FleetFactory, state: DomainState) -> None:
    fleet = two_slot_fleet(make, state=state)
    assert routable_models(fleet) == ()
    assert find_routable_binding(fleet, "small") is None


def test_nothing_routable_without_active(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha"), make.domain("beta"))
    assert routable_models(fleet) == ()
    assert find_routable_binding(fleet, "m-0") is None


@pytest.mark.parametrize(
    ("slot_state", "found"),
    [(I.SERVING, True), *[(s, False) for s in I if s is not I.SERVING]],
)
def test_find_routable_binding_across_slot_states(
    make: FleetFactory, slot_state: InferenceSlotState, found: bool
) -> None:
    fleet = two_slot_fleet(make, gpu1=slot_state)
    binding = find_routable_binding(fleet, "large")
    if found:
        assert binding is not None
        assert binding.name == "large"
        assert binding.serving_url == "http://alpha.test:8000/large"
    else:
        assert binding is None
    # The sibling slot keeps serving whatever happens to GPU 1.
    assert find_routable_binding(fleet, "medium") is not None


def test_find_routable_binding_unknown_or_standby_model(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha", slots=[make.inference(0, "a")]),
        make.domain("beta", slots=[make.inference(0, "b")]),  # serving, but a standby
        active="alpha",
    )
    assert find_routable_binding(fleet, "a") is not None
    assert find_routable_binding(fleet, "b") is None
    assert find_routable_binding(fleet, "A") is None
    assert find_routable_binding(fleet, "") is None


# ---- route intent ----


def test_route_intent_shape(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha", slots=[make.inference(0, "small", "medium")]),
        make.domain("beta", slots=[make.inference(0, "small", "medium", state=I.SLEEPING)]),
        active="alpha",
        route_revision=4,
    )
    intent = build_route_intent(fleet, now=make.now)
    assert intent.fleet_id == fleet.id
    assert intent.fleet_slug == "test-fleet"
    assert intent.revision == 4
    assert intent.generated_at == make.now
    assert intent.active is not None
    assert intent.active.domain_id == make.domain_id("alpha")
    assert intent.active.domain_slug == "alpha"
    assert intent.active.endpoint_url == "http://alpha.test:8800"
    assert intent.active.eligible is True
    assert intent.active.weight == 1
    assert [(m.name, m.eligible) for m in intent.active.models] == [
        ("small", True),
        ("medium", True),
    ]
    (beta,) = intent.standbys
    assert (beta.domain_slug, beta.eligible, beta.weight) == ("beta", False, 0)
    assert beta.endpoint_url == "http://beta.test:8800"
    assert [(m.name, m.eligible) for m in beta.models] == [("small", False), ("medium", False)]
    # The wire form is the documented camelCase document and round-trips.
    wire = intent.model_dump(mode="json")
    assert set(wire) == {"fleetId", "fleetSlug", "revision", "generatedAt", "active", "standbys"}
    assert set(wire["active"]) == {
        "domainId",
        "domainSlug",
        "endpointUrl",
        "eligible",
        "weight",
        "models",
    }
    assert RouteIntent.model_validate_json(intent.model_dump_json()) == intent


def test_active_without_endpoint_is_not_eligible(make: FleetFactory) -> None:
    fleet = two_slot_fleet(make, serving=False)
    intent = build_route_intent(fleet, now=make.now)
    assert intent.active is not None
    assert intent.active.endpoint_url is None
    assert intent.active.eligible is False
    assert intent.active.weight == 1
    # Models are judged on their own: they still serve behind the missing endpoint.
    assert all(m.eligible for m in intent.active.models)


def test_active_without_eligible_model_is_not_eligible(make: FleetFactory) -> None:
    fleet = two_slot_fleet(make, gpu0=I.FAILED, gpu1=I.WAKING)
    intent = build_route_intent(fleet, now=make.now)
    assert intent.active is not None
    assert intent.active.eligible is False
    assert [m.eligible for m in intent.active.models] == [False, False, False]


def test_one_eligible_model_is_enough(make: FleetFactory) -> None:
    fleet = two_slot_fleet(make, gpu0=I.FAILED)
    intent = build_route_intent(fleet, now=make.now)
    assert intent.active is not None
    assert intent.active.eligible is True
    assert [(m.name, m.eligible) for m in intent.active.models] == [
        ("small", False),
        ("medium", False),
        ("large", True),
    ]


@pytest.mark.parametrize(
    ("state", "eligible"),
    [(D.READY, True), (D.DEGRADED, True)]
    + [(s, False) for s in (D.PROVISIONING, D.FAILED, D.STOPPING, D.STOPPED)],
)
def test_model_eligibility_follows_domain_state(
    make: FleetFactory, state: DomainState, eligible: bool
) -> None:
    fleet = two_slot_fleet(make, state=state)
    intent = build_route_intent(fleet, now=make.now)
    assert intent.active is not None
    assert intent.active.eligible is eligible
    assert all(m.eligible is eligible for m in intent.active.models)


def test_no_active(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha"), make.domain("beta"))
    intent = build_route_intent(fleet, now=make.now)
    assert intent.active is None
    assert [t.domain_slug for t in intent.standbys] == ["alpha", "beta"]
    assert all(not t.eligible and t.weight == 0 for t in intent.standbys)


def test_serving_standby_is_never_eligible(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("alpha", state=D.FAILED),
        make.domain("beta"),  # ready, serving, with an endpoint: still a standby
        active="alpha",
    )
    intent = build_route_intent(fleet, now=make.now)
    (beta,) = intent.standbys
    assert beta.eligible is False
    assert beta.weight == 0
    assert all(not m.eligible for m in beta.models)


def test_standbys_ranked_like_rank_standbys(make: FleetFactory) -> None:
    fleet = make.fleet(
        make.domain("zeta", last_seen_at=make.now),
        make.domain("alpha", state=D.DEGRADED, last_seen_at=make.now),
        make.domain("active"),
        make.domain("b2", last_seen_at=None),
        make.domain("b-1", last_seen_at=None),
        make.domain("mid", last_seen_at=make.now - timedelta(seconds=1)),
        active="active",
    )
    intent = build_route_intent(fleet, now=make.now)
    assert [t.domain_slug for t in intent.standbys] == ["zeta", "mid", "b-1", "b2", "alpha"]
    assert [t.domain_id for t in intent.standbys] == [d.id for d in rank_standbys(fleet)]


def test_naive_now_rejected(make: FleetFactory) -> None:
    fleet = make.fleet(make.domain("alpha"), active="alpha")
    with pytest.raises(ValueError, match="timezone"):
        build_route_intent(fleet, now=datetime(2026, 3, 1))  # noqa: DTZ001 -- the point
