"""Property-based tests over random, valid fleets (hypothesis)."""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, datetime, timedelta

from haru_core import (
    PROMOTE_STEPS,
    UNREACHABLE,
    CreateOperation,
    InvalidTarget,
    Reach,
    active_proven_dead,
    build_route_intent,
    can_transition,
    check_endpoints,
    clamp_to_now,
    decide_demotion,
    decide_promotion,
    detect_dead_active,
    detect_degraded_escalation,
    detect_failover,
    domain_change_on_heartbeat,
    elapsed_since,
    has_inference_bindings,
    host_unreachable,
    inference_slots,
    is_stale,
    is_viable_standby,
    machine_for,
    proxy_connect_failed,
    proxy_kick,
    rank_standbys,
    server_partitioned,
    serving_endpoints,
    slot_bindings,
    slot_health_changes,
    step_budget_ms,
    step_remaining_ms,
    weak_evidence,
)
from haru_protocol import (
    Cloud,
    DomainSnapshot,
    DomainState,
    FleetSnapshot,
    InferenceSlotSpec,
    InferenceSlotState,
    ModelBinding,
    ModelStatus,
    OperationStep,
    Placement,
    Policy,
    Provider,
    SlotKind,
    SlotSnapshot,
    SlotStatus,
    SupervisorStatus,
    TrainingRunState,
    TrainingSlotSpec,
    TrainingSlotState,
    TrainingStatus,
)
from hypothesis import given, settings
from hypothesis import strategies as st

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
MODEL_POOL = ("m0", "m1", "m2", "m3", "m4")
# Few, short slug parts so that ties on state and heartbeat are common and the slug
# tiebreak (hyphens, digits, letters) is exercised.
SLUG_PARTS = st.text(alphabet="a0z9", min_size=1, max_size=2)
SLUGS = st.lists(SLUG_PARTS, min_size=1, max_size=2).map("-".join)
# Heartbeat ages collide on purpose (a few fixed values) and sometimes lie in the future.
AGES_MS = st.one_of(st.sampled_from([0, 500, 1_000, 30_000, 30_001]), st.integers(-5_000, 200_000))

INFERENCE_STATES = st.sampled_from(
    [InferenceSlotState.SLEEPING, InferenceSlotState.FAILED, *InferenceSlotState]
)
# Weighted towards the states failover cares about, so that interesting fleets are common.
DOMAIN_STATES = st.sampled_from(
    [*[DomainState.READY] * 4, *[DomainState.DEGRADED] * 2, *DomainState]
)

PROPERTY_SETTINGS = settings(max_examples=100, deadline=None, database=None)


def at(age_ms: int) -> datetime:
    return NOW - timedelta(milliseconds=age_ms)


@st.composite
def slots_of(draw: st.DrawFn, domain_id: uuid.UUID) -> tuple[SlotSnapshot, ...]:
    """Valid slots: (gpuIndex, kind) unique, model names unique within the domain."""
    names = list(draw(st.permutations(MODEL_POOL)))
    slots: list[SlotSnapshot] = []
    # Mostly at least one inference slot; sometimes none (a training-only domain).
    min_inference = 0 if draw(st.integers(0, 4)) == 0 else 1
    for gpu in draw(st.lists(st.integers(0, 2), unique=True, min_size=min_inference, max_size=3)):
        count = draw(st.integers(1, 2))
        if len(names) < count:
            break
        bound, names = names[:count], names[count:]
        spec = InferenceSlotSpec(
            gpu_index=gpu,
            models=tuple(ModelBinding(name=n, serving_url=f"http://h.test/{n}") for n in bound),
        )
        slots.append(
            SlotSnapshot(
                id=draw(st.uuids()),
                domain_id=domain_id,
                gpu_index=gpu,
                kind=SlotKind.INFERENCE,
                state=draw(INFERENCE_STATES),
                spec=spec,
            )
        )
    for gpu in draw(st.lists(st.integers(0, 2), unique=True, max_size=2)):
        slots.append(
            SlotSnapshot(
                id=draw(st.uuids()),
                domain_id=domain_id,
                gpu_index=gpu,
                kind=SlotKind.TRAINING,
                state=draw(st.sampled_from(TrainingSlotState)),
                spec=TrainingSlotSpec(gpu_index=gpu, command=("train",), checkpoint_dir="/ckpt"),
            )
        )
    return tuple(draw(st.permutations(slots)))


@st.composite
def domains_of(draw: st.DrawFn, fleet_id: uuid.UUID, slug: str) -> DomainSnapshot:
    domain_id = draw(st.uuids())
    last_seen = None if draw(st.integers(0, 4)) == 0 else at(draw(AGES_MS))
    return DomainSnapshot(
        id=domain_id,
        fleet_id=fleet_id,
        slug=slug,
        state=draw(DOMAIN_STATES),
        provider=Provider.STATIC,
        placement=Placement(cloud=Cloud.GCP, region="r", accelerator="EXAMPLE-GPU"),
        supervisor_url=draw(st.sampled_from([None, *[f"http://{slug}.test:8701"] * 3])),
        serving_base_url=draw(st.sampled_from([None, f"http://{slug}.test:8800"])),
        last_seen_at=last_seen,
        state_updated_at=at(draw(st.integers(0, 200_000))),
        slots=draw(slots_of(domain_id)),
    )


@st.composite
def fleets(draw: st.DrawFn, *, failover_due: bool = False) -> FleetSnapshot:
    """A valid fleet: unique slugs and ids, random states, heartbeats, slots and pointer.

    ``failover_due`` forces autoFailover on and a failed active, so that the standby choice
    is exercised on every example.
    """
    fleet_id = draw(st.uuids())
    slugs = draw(st.lists(SLUGS, min_size=2 if failover_due else 1, max_size=6, unique=True))
    domains = tuple(draw(domains_of(fleet_id, s)) for s in slugs)
    # A collision of random UUIDs would be a malformed fleet; hypothesis's uuids are unique
    # enough, but make it explicit.
    ids = [d.id for d in domains]
    if len(set(ids)) != len(ids):
        domains = tuple(d.model_copy(update={"id": uuid.uuid4()}) for d in domains)
    if failover_due:
        domains = (domains[0].model_copy(update={"state": DomainState.FAILED}), *domains[1:])
        active: uuid.UUID | None = domains[0].id
    else:
        active = draw(st.one_of(st.none(), st.sampled_from([d.id for d in domains])))
    policy = Policy(
        auto_failover=failover_due or draw(st.booleans()),
        heartbeat_stale_ms=draw(st.sampled_from([1, 30_000, 100_000, 100_000])),
        degraded_grace_ms=draw(st.sampled_from([1, 60_000, 150_000])),
    )
    return FleetSnapshot(
        id=fleet_id,
        slug="fleet",
        display_name=None,
        active_domain_id=active,
        route_revision=draw(st.integers(1, 10)),
        policy=policy,
        domains=domains,
    )


@st.composite
def statuses_for(draw: st.DrawFn, domain: DomainSnapshot) -> SupervisorStatus | None:
    """A supervisor answer (or no answer) loosely matching the domain's layout."""
    if draw(st.integers(0, 5)) == 0:
        return None
    names = draw(st.lists(st.sampled_from((*MODEL_POOL, "extra")), unique=True))
    sleeping = st.sampled_from([True, False, None])
    slots = [
        SlotStatus(
            gpu_index=0,
            kind=SlotKind.INFERENCE,
            models=tuple(
                ModelStatus(name=n, port=9000 + i, sleeping=draw(sleeping))
                for i, n in enumerate(names)
            ),
        )
    ]
    for gpu in draw(st.lists(st.integers(0, 2), unique=True)):
        slots.append(
            SlotStatus(
                gpu_index=gpu,
                kind=SlotKind.TRAINING,
                training=TrainingStatus(
                    state=draw(st.sampled_from(TrainingRunState)),
                    pids=tuple(draw(st.lists(st.integers(1, 99), max_size=2))),
                ),
            )
        )
    return SupervisorStatus(slots=tuple(slots), ready=draw(st.booleans()))


_TIER = {DomainState.READY: 0, DomainState.DEGRADED: 1}


def strictly_better(a: DomainSnapshot, b: DomainSnapshot) -> bool:
    """DESIGN 7.4's ranking as a comparison: is ``a`` a strictly better standby than ``b``?"""
    tier_a, tier_b = _TIER.get(a.state, 2), _TIER.get(b.state, 2)
    if tier_a != tier_b:
        return tier_a < tier_b
    if (a.last_seen_at is None) != (b.last_seen_at is None):
        return b.last_seen_at is None
    if (
        a.last_seen_at is not None
        and b.last_seen_at is not None
        and a.last_seen_at != b.last_seen_at
    ):
        return a.last_seen_at > b.last_seen_at
    return a.slug < b.slug


# ---- ranking ----


@PROPERTY_SETTINGS
@given(fleet=fleets(), data=st.data())
def test_ranking_is_a_deterministic_total_order(fleet: FleetSnapshot, data: st.DataObject) -> None:
    ranked = rank_standbys(fleet)
    standbys = [d for d in fleet.domains if d.id != fleet.active_domain_id]
    assert sorted(d.id for d in ranked) == sorted(d.id for d in standbys)
    for earlier, later in itertools.pairwise(ranked):
        assert strictly_better(earlier, later)
        assert not strictly_better(later, earlier)
    shuffled = fleet.model_copy(
        update={"domains": tuple(data.draw(st.permutations(fleet.domains)))}
    )
    assert rank_standbys(shuffled) == ranked


# ---- failover ----


@PROPERTY_SETTINGS
@given(fleet=st.one_of(fleets(), fleets(failover_due=True)))
def test_failover_picks_a_sound_target(fleet: FleetSnapshot) -> None:
    decision = detect_failover(fleet, now=NOW)
    active = fleet.active_domain
    due = (
        fleet.policy.auto_failover
        and active is not None
        and (
            active.state is DomainState.FAILED
            or is_stale(active, now=NOW, heartbeat_stale_ms=fleet.policy.heartbeat_stale_ms)
        )
    )
    ranked = rank_standbys(fleet)
    viable = [d for d in ranked if is_viable_standby(fleet, d, now=NOW)]
    fallback = [
        d
        for d in ranked
        if d.state in {DomainState.READY, DomainState.DEGRADED}
        and d.supervisor_url is not None
        and has_inference_bindings(d)
    ]
    if not due or not fallback:
        assert decision is None
        return
    assert decision is not None
    assert active is not None
    assert decision.active_domain_id == active.id
    assert decision.target_domain_id != active.id
    assert decision.reason == (
        "active_failed" if active.state is DomainState.FAILED else "active_stale"
    )
    target = fleet.domain(decision.target_domain_id)
    assert target is not None
    assert target.supervisor_url is not None
    assert has_inference_bindings(target)
    assert target.state in {DomainState.READY, DomainState.DEGRADED}
    if viable:
        assert target.id == viable[0].id
    else:
        assert target.id == fallback[0].id


@PROPERTY_SETTINGS
@given(fleet=fleets())
def test_viable_standbys_are_sound(fleet: FleetSnapshot) -> None:
    for domain in fleet.domains:
        if not is_viable_standby(fleet, domain, now=NOW):
            continue
        assert domain.id != fleet.active_domain_id
        assert domain.state is DomainState.READY
        assert domain.supervisor_url is not None
        assert domain.last_seen_at is not None
        assert NOW - domain.last_seen_at <= timedelta(milliseconds=fleet.policy.heartbeat_stale_ms)
        slots = inference_slots(domain)
        assert slots
        assert all(s.state is not InferenceSlotState.FAILED for s in slots)


@PROPERTY_SETTINGS
@given(fleet=fleets())
def test_escalation_is_sound(fleet: FleetSnapshot) -> None:
    escalated = detect_degraded_escalation(fleet, now=NOW)
    if escalated is None:
        return
    active = fleet.active_domain
    assert active is not None
    assert escalated == active.id
    assert fleet.policy.auto_failover
    assert active.state is DomainState.DEGRADED
    assert NOW - active.state_updated_at > timedelta(milliseconds=fleet.policy.degraded_grace_ms)
    assert any(is_viable_standby(fleet, d, now=NOW) for d in fleet.domains)


# ---- decisions ----


@PROPERTY_SETTINGS
@given(fleet=fleets(), data=st.data())
def test_decisions_only_create_valid_operations(fleet: FleetSnapshot, data: st.DataObject) -> None:
    target = data.draw(st.sampled_from(fleet.domains))
    for decision in (decide_promotion(fleet, target.id), decide_demotion(fleet, target.id)):
        if isinstance(decision, CreateOperation):
            assert decision.target_domain_id == target.id
            assert target.id != fleet.active_domain_id
            assert target.state in {DomainState.READY, DomainState.DEGRADED}
            assert target.supervisor_url is not None
            assert has_inference_bindings(target)
        elif isinstance(decision, InvalidTarget):
            assert target.slug in decision.message
    assert not isinstance(decide_promotion(fleet, uuid.uuid4()), CreateOperation)


# ---- route intent ----


@PROPERTY_SETTINGS
@given(fleet=fleets())
def test_route_intent_rules(fleet: FleetSnapshot) -> None:
    intent = build_route_intent(fleet, now=NOW)
    assert intent.revision == fleet.route_revision
    assert [t.domain_id for t in intent.standbys] == [d.id for d in rank_standbys(fleet)]
    for standby in intent.standbys:
        assert standby.eligible is False
        assert standby.weight == 0
        assert not any(m.eligible for m in standby.models)
    active = fleet.active_domain
    if active is None:
        assert intent.active is None
        return
    assert intent.active is not None
    assert intent.active.weight == 1
    routable = active.state in {DomainState.READY, DomainState.DEGRADED}
    expected_models = [
        (b.name, routable and s.state is InferenceSlotState.SERVING)
        for s in inference_slots(active)
        for b in slot_bindings(s)
    ]
    assert [(m.name, m.eligible) for m in intent.active.models] == expected_models
    assert intent.active.eligible is (
        active.serving_base_url is not None and any(e for _, e in expected_models)
    )


# ---- heartbeat verdicts ----


@PROPERTY_SETTINGS
@given(data=st.data(), fleet=fleets())
def test_heartbeat_changes_are_allowed_by_the_tables(
    fleet: FleetSnapshot, data: st.DataObject
) -> None:
    for domain in fleet.domains:
        status = data.draw(statuses_for(domain))
        if status is not None:
            changes = slot_health_changes(fleet, domain, status)
            slots = {s.id: s for s in domain.slots}
            assert len({c.slot_id for c in changes}) == len(changes)
            for change in changes:
                slot = slots[change.slot_id]
                assert change.kind is slot.kind
                assert change.from_state == slot.state
                assert can_transition(machine_for(change.kind), change.from_state, change.to_state)
        domain_change = domain_change_on_heartbeat(fleet, domain, status)
        if domain_change is not None:
            assert domain_change.from_state is domain.state
            assert can_transition("domain", domain_change.from_state, domain_change.to_state)


# ---- stored times from the future ----

# hypothesis takes naive bounds and attaches the zone itself.
INSTANTS = st.datetimes(
    min_value=datetime(2000, 1, 1),  # noqa: DTZ001
    max_value=datetime(2100, 1, 1),  # noqa: DTZ001
    timezones=st.just(UTC),
)


@PROPERTY_SETTINGS
@given(stored=INSTANTS, now=INSTANTS)
def test_a_stored_time_never_lies_ahead_of_now(stored: datetime, now: datetime) -> None:
    clamped = clamp_to_now(stored, now=now)
    assert clamped == (stored if stored <= now else now)
    assert elapsed_since(stored, now=now) == now - clamped >= timedelta(0)


@PROPERTY_SETTINGS
@given(stored=INSTANTS, now=INSTANTS, later_ms=st.integers(0, 10**9))
def test_elapsed_time_never_shrinks_as_now_advances(
    stored: datetime, now: datetime, later_ms: int
) -> None:
    later = now + timedelta(milliseconds=later_ms)
    assert elapsed_since(stored, now=later) >= elapsed_since(stored, now=now)


def _seen_now_at_most(fleet: FleetSnapshot) -> FleetSnapshot:
    domains = tuple(
        d.model_copy(
            update={
                "last_seen_at": None if d.last_seen_at is None else min(d.last_seen_at, NOW),
                "state_updated_at": min(d.state_updated_at, NOW),
            }
        )
        for d in fleet.domains
    )
    return fleet.model_copy(update={"domains": domains})


@PROPERTY_SETTINGS
@given(fleet=st.one_of(fleets(), fleets(failover_due=True)), ahead_ms=st.integers(1, 10**10))
def test_a_time_from_the_future_decides_like_a_time_written_now(
    fleet: FleetSnapshot, ahead_ms: int
) -> None:
    # Push some of the fleet's stored times far ahead (a fast clock wrote them): every decision
    # must be the one taken had they been written now.
    ahead = timedelta(milliseconds=ahead_ms)
    pushed = fleet.model_copy(
        update={
            "domains": tuple(
                d.model_copy(
                    update={
                        "last_seen_at": None if d.last_seen_at is None else NOW + ahead,
                        "state_updated_at": NOW + ahead,
                    }
                )
                if i % 2 == 0
                else d
                for i, d in enumerate(fleet.domains)
            )
        }
    )
    flat = _seen_now_at_most(pushed)
    stale_ms = fleet.policy.heartbeat_stale_ms
    for d, f in zip(pushed.domains, flat.domains, strict=True):
        assert is_stale(d, now=NOW, heartbeat_stale_ms=stale_ms) == is_stale(
            f, now=NOW, heartbeat_stale_ms=stale_ms
        )
        assert is_viable_standby(pushed, d, now=NOW) == is_viable_standby(flat, f, now=NOW)
    assert detect_degraded_escalation(pushed, now=NOW) == detect_degraded_escalation(flat, now=NOW)
    decided, expected = detect_failover(pushed, now=NOW), detect_failover(flat, now=NOW)
    assert (decided is None) == (expected is None)
    if decided is not None and expected is not None:
        assert decided.reason == expected.reason


@PROPERTY_SETTINGS
@given(ahead_ms=st.integers(1, 10**10), step=st.sampled_from(PROMOTE_STEPS))
def test_a_step_started_in_the_future_keeps_its_whole_budget(
    ahead_ms: int, step: OperationStep
) -> None:
    policy = Policy()
    started = NOW + timedelta(milliseconds=ahead_ms)
    remaining = step_remaining_ms(policy, step, started_at=started, now=NOW)
    assert remaining == step_budget_ms(policy, step)


# ---- evidence-based detection ----


@st.composite
def death_reports(draw: st.DrawFn, domain: DomainSnapshot) -> SupervisorStatus:
    """An answer about ``domain``'s models, mostly all down, with random holes and noise."""
    bound = [b.name for s in inference_slots(domain) for b in slot_bindings(s)]
    names = draw(st.lists(st.sampled_from((*bound, *MODEL_POOL, "extra")), max_size=7))
    names = [*bound, *names] if draw(st.booleans()) else names
    models = tuple(
        ModelStatus(
            name=n,
            port=9000 + i,
            sleeping=draw(st.sampled_from([None, None, True, False])),
            down=draw(st.sampled_from([True, True, True, False])),
            action=draw(st.sampled_from([None, None, None, "sleep", "wake"])),
        )
        for i, n in enumerate(names)
    )
    return SupervisorStatus(
        slots=(SlotStatus(gpu_index=0, kind=SlotKind.INFERENCE, models=models),), ready=False
    )


@PROPERTY_SETTINGS
@given(fleet=fleets(), data=st.data())
def test_only_every_bound_model_down_proves_the_active_dead(
    fleet: FleetSnapshot, data: st.DataObject
) -> None:
    domain = data.draw(st.sampled_from(fleet.domains))
    report = data.draw(death_reports(domain))
    dead = active_proven_dead(fleet, domain, report)
    bound = {b.name for s in inference_slots(domain) for b in slot_bindings(s)}
    reports = [m for slot in report.slots for m in slot.models or ()]
    every_bound_down = all(
        any(m.name == name for m in reports)
        and all(m.down and m.action is None for m in reports if m.name == name)
        for name in bound
    )
    assert bool(dead) == (fleet.active_domain_id == domain.id and bool(bound) and every_bound_down)
    if dead:
        assert set(dead) == bound
        # Weak evidence keeps the grace: one bound model that answers (or is only slow)
        # undoes the proof.
        alive = next(m for m in reports if m.name == dead[0]).model_copy(update={"down": False})
        slot = report.slots[0].model_copy(
            update={"models": (*(report.slots[0].models or ()), alive)}
        )
        assert active_proven_dead(fleet, domain, report.model_copy(update={"slots": (slot,)})) == ()


@PROPERTY_SETTINGS
@given(
    fleet=fleets(),
    since_ms=st.one_of(st.none(), st.integers(-2_000, 5_000)),
    confirm_ms=st.sampled_from([1, 1_000, 3_000]),
)
def test_a_dead_verdict_is_sound_and_its_failover_targets_a_viable_standby(
    fleet: FleetSnapshot, since_ms: int | None, confirm_ms: int
) -> None:
    fleet = fleet.model_copy(
        update={"policy": fleet.policy.model_copy(update={"dead_confirm_ms": confirm_ms})}
    )
    since = None if since_ms is None else at(since_ms)
    dead = detect_dead_active(fleet, now=NOW, since=since)
    if dead is None:
        return
    active = fleet.active_domain
    assert active is not None
    assert since is not None
    assert dead == active.id
    assert fleet.policy.auto_failover
    assert active.state is DomainState.DEGRADED
    assert not active.auth_failing
    assert NOW - since >= timedelta(milliseconds=confirm_ms)
    # What follows (the CAS fails the active) must fail over to a ready, fresh standby.
    failed = active.model_copy(update={"state": DomainState.FAILED})
    after = fleet.model_copy(
        update={"domains": tuple(failed if d.id == dead else d for d in fleet.domains)}
    )
    decision = detect_failover(after, now=NOW)
    assert decision is not None
    target = after.domain(decision.target_domain_id)
    assert target is not None
    assert is_viable_standby(after, target, now=NOW)


@PROPERTY_SETTINGS
@given(
    polled=st.lists(st.uuids(), unique=True, max_size=5),
    data=st.data(),
)
def test_a_partition_means_no_supervisor_reached(
    polled: list[uuid.UUID], data: st.DataObject
) -> None:
    reached = data.draw(st.lists(st.sampled_from(polled), unique=True) if polled else st.just([]))
    partitioned = server_partitioned(polled, reached)
    assert partitioned == (len(polled) >= 2 and not reached)


# ---- a lost host ----

REACHES = st.sampled_from(list(Reach))


@PROPERTY_SETTINGS
@given(fleet=fleets(), data=st.data())
def test_a_lost_host_needs_every_link_refused_and_another_domain_reached(
    fleet: FleetSnapshot, data: st.DataObject
) -> None:
    domain = data.draw(st.sampled_from(fleet.domains))
    supervisor = data.draw(st.one_of(st.none(), REACHES))
    links = serving_endpoints(domain)
    endpoints = {e: data.draw(REACHES) for e in links}
    skip_one: bool = data.draw(st.booleans())
    if links and skip_one:
        del endpoints[links[-1]]  # one endpoint not checked
    reached = data.draw(st.lists(st.sampled_from([d.id for d in fleet.domains]), unique=True))
    proven = host_unreachable(
        fleet, domain, supervisor=supervisor, endpoints=endpoints, reached=reached
    )
    expected = (
        domain.id == fleet.active_domain_id
        and supervisor in UNREACHABLE
        and bool(links)
        and all(endpoints.get(e) in UNREACHABLE for e in links)
        and any(d != domain.id for d in reached)
    )
    assert proven == expected
    # Proof implies the check was due, and a server that reached no other domain (its own
    # network) never proves anything.
    if proven:
        assert check_endpoints(fleet, domain, supervisor=supervisor, reached=reached)
    assert not host_unreachable(
        fleet, domain, supervisor=supervisor, endpoints=endpoints, reached=[domain.id]
    )
    # Strong and weak evidence never describe the same observation.
    assert (
        weak_evidence(
            fleet, domain, status=None, supervisor=supervisor, proxy_failed=True, proven=proven
        )
        is None
        or not proven
    )


@PROPERTY_SETTINGS
@given(fleet=fleets(), data=st.data())
def test_one_link_that_is_not_refused_is_no_proof(
    fleet: FleetSnapshot, data: st.DataObject
) -> None:
    actives = [d for d in fleet.domains if d.id == fleet.active_domain_id]
    endpoints_of = [d for d in actives if serving_endpoints(d)]
    if not endpoints_of:
        return
    domain = endpoints_of[0]
    links = serving_endpoints(domain)
    spared = data.draw(st.sampled_from(links))
    alive = data.draw(
        st.sampled_from([Reach.ANSWERED, Reach.SLOW, Reach.CONNECT_TIMEOUT, Reach.BROKEN])
    )
    endpoints = {e: (alive if e == spared else Reach.REFUSED) for e in links}
    others = [d.id for d in fleet.domains if d.id != domain.id]
    assert not host_unreachable(
        fleet, domain, supervisor=Reach.NO_ROUTE, endpoints=endpoints, reached=others
    )


@PROPERTY_SETTINGS
@given(
    fleet=fleets(),
    age_ms=st.integers(-5_000, 20_000),
    window_ms=st.integers(0, 10_000),
    data=st.data(),
)
def test_a_proxy_record_is_recent_or_not_and_kicks_once(
    fleet: FleetSnapshot, age_ms: int, window_ms: int, data: st.DataObject
) -> None:
    domain = data.draw(st.sampled_from(fleet.domains))
    stamped = domain.model_copy(update={"connect_failed_at": NOW - timedelta(milliseconds=age_ms)})
    recent = proxy_connect_failed(stamped, now=NOW, window_ms=window_ms)
    assert recent == (max(age_ms, 0) <= window_ms)
    assert proxy_kick(stamped, seen=None, now=NOW, window_ms=window_ms) == recent
    # Once acted on, the same record never kicks again.
    assert not proxy_kick(stamped, seen=stamped.connect_failed_at, now=NOW, window_ms=window_ms)
    assert not proxy_connect_failed(
        domain.model_copy(update={"connect_failed_at": None}), now=NOW, window_ms=window_ms
    )
