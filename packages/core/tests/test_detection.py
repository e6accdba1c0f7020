"""Evidence-based failure detection: proof of a dead active, its confirmation, partitions."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import pytest
from haru_core import (
    Reach,
    active_proven_dead,
    awaiting_confirmation,
    check_endpoints,
    dead_since,
    detect_dead_active,
    detect_failover,
    host_unreachable,
    server_partitioned,
    serving_endpoints,
    weak_evidence,
)
from haru_protocol import (
    DomainState,
    FleetSnapshot,
    InferenceSlotState,
    ModelStatus,
    Policy,
    SlotKind,
    SlotStatus,
    SupervisorStatus,
)

if TYPE_CHECKING:
    from conftest import FleetFactory

AUTO = Policy(auto_failover=True)


def status(**models: tuple[bool | None, bool]) -> SupervisorStatus:
    """``name=(sleeping, down)`` for every model, on one inference slot."""
    return SupervisorStatus(
        slots=(
            SlotStatus(
                gpu_index=0,
                kind=SlotKind.INFERENCE,
                models=tuple(
                    ModelStatus(name=name, port=9000 + i, sleeping=sleeping, down=down)
                    for i, (name, (sleeping, down)) in enumerate(models.items())
                ),
            ),
        ),
        ready=False,
    )


def two_model_fleet(
    make: FleetFactory,
    *,
    active_state: DomainState = DomainState.DEGRADED,
    policy: Policy = AUTO,
    standby_state: DomainState = DomainState.READY,
) -> FleetSnapshot:
    return make.fleet(
        make.domain(
            "alpha",
            state=active_state,
            slots=[make.inference(0, "a"), make.inference(1, "b")],
        ),
        make.domain(
            "beta",
            state=standby_state,
            slots=[
                make.inference(0, "a", state=InferenceSlotState.SLEEPING),
                make.inference(1, "b", state=InferenceSlotState.SLEEPING),
            ],
        ),
        active="alpha",
        policy=policy,
    )


# ---- proof ----


def test_every_bound_model_refusing_proves_the_active_dead(make: FleetFactory) -> None:
    fleet = two_model_fleet(make)
    alpha = fleet.domains[0]
    assert active_proven_dead(fleet, alpha, status(a=(None, True), b=(None, True))) == ("a", "b")


@pytest.mark.parametrize(
    "answer",
    [
        status(a=(None, True), b=(False, False)),  # one of two down, the other serves
        status(a=(None, True), b=(None, False)),  # the other slow: unproven, not dead
        status(a=(None, True)),  # the other not reported at all
        status(a=(None, False), b=(None, False)),  # both slow (timeouts)
        status(),
    ],
)
def test_a_partial_or_slow_loss_is_no_proof(make: FleetFactory, answer: SupervisorStatus) -> None:
    fleet = two_model_fleet(make)
    assert active_proven_dead(fleet, fleet.domains[0], answer) == ()


def test_a_server_in_a_sleep_or_wake_is_busy_not_dead(make: FleetFactory) -> None:
    fleet = two_model_fleet(make)
    busy = status(a=(None, True), b=(None, True))
    slot = busy.slots[0]
    assert slot.models is not None
    models = (slot.models[0].model_copy(update={"action": "wake"}), slot.models[1])
    busy = busy.model_copy(update={"slots": (slot.model_copy(update={"models": models}),)})
    assert active_proven_dead(fleet, fleet.domains[0], busy) == ()


def test_a_name_reported_twice_must_be_down_both_times(make: FleetFactory) -> None:
    fleet = two_model_fleet(make)
    doubled = SupervisorStatus(
        slots=(
            *status(a=(None, True), b=(None, True)).slots,
            SlotStatus(
                gpu_index=1,
                kind=SlotKind.INFERENCE,
                models=(ModelStatus(name="b", port=9100, sleeping=False),),
            ),
        ),
        ready=False,
    )
    assert active_proven_dead(fleet, fleet.domains[0], doubled) == ()


def test_a_standby_is_never_proven_dead(make: FleetFactory) -> None:
    fleet = two_model_fleet(make)
    assert active_proven_dead(fleet, fleet.domains[1], status(a=(None, True), b=(None, True))) == ()


# ---- the run of proofs ----


def test_the_run_starts_at_the_first_proof_and_any_other_answer_ends_it(
    make: FleetFactory,
) -> None:
    first = make.now
    later = first + timedelta(seconds=1)
    assert dead_since(None, proven=True, now=first) == first
    assert dead_since(first, proven=True, now=later) == first
    assert dead_since(first, proven=False, now=later) is None
    assert dead_since(None, proven=False, now=later) is None


# ---- confirmation ----


def test_the_default_confirmation_is_one_second() -> None:
    assert Policy().dead_confirm_ms == 1_000


def test_a_dead_active_fails_once_the_proof_is_dead_confirm_ms_old(make: FleetFactory) -> None:
    fleet = two_model_fleet(make)
    alpha = fleet.domains[0].id
    confirm = timedelta(milliseconds=fleet.policy.dead_confirm_ms)
    assert detect_dead_active(fleet, now=make.now, since=make.now) is None
    assert (
        detect_dead_active(
            fleet, now=make.now, since=make.now - confirm + timedelta(microseconds=1)
        )
        is None
    )
    assert detect_dead_active(fleet, now=make.now, since=make.now - confirm) == alpha
    # Far inside the degraded grace: the grace is not what decides.
    assert fleet.policy.degraded_grace_ms > fleet.policy.dead_confirm_ms
    assert detect_dead_active(fleet, now=make.now, since=None) is None


def test_the_confirmation_is_the_policy_value(make: FleetFactory) -> None:
    fleet = two_model_fleet(make, policy=Policy(auto_failover=True, dead_confirm_ms=1))
    since = make.now - timedelta(milliseconds=1)
    assert detect_dead_active(fleet, now=make.now, since=since) == fleet.domains[0].id
    assert detect_dead_active(fleet, now=make.now, since=make.now) is None


@pytest.mark.parametrize(
    ("fleet_kw", "why"),
    [
        ({"policy": Policy()}, "autoFailover off"),
        ({"active_state": DomainState.READY}, "not degraded by the first proof (yet)"),
        ({"active_state": DomainState.FAILED}, "already failed"),
        ({"standby_state": DomainState.DEGRADED}, "no viable standby"),
    ],
)
def test_no_dead_verdict_without_its_conditions(
    make: FleetFactory, fleet_kw: dict[str, object], why: str
) -> None:
    fleet = two_model_fleet(make, **fleet_kw)  # type: ignore[arg-type]
    long_ago = make.now - timedelta(hours=1)
    assert detect_dead_active(fleet, now=make.now, since=long_ago) is None, why


def test_no_dead_verdict_while_the_token_is_refused_or_the_standby_backs_off(
    make: FleetFactory,
) -> None:
    fleet = two_model_fleet(make)
    long_ago = make.now - timedelta(hours=1)
    refused = fleet.model_copy(
        update={
            "domains": (
                fleet.domains[0].model_copy(update={"auth_failing": True}),
                fleet.domains[1],
            )
        }
    )
    assert detect_dead_active(refused, now=make.now, since=long_ago) is None
    backing_off = fleet.model_copy(
        update={
            "domains": (
                fleet.domains[0],
                fleet.domains[1].model_copy(
                    update={"promotion_backoff_until": make.now + timedelta(seconds=5)}
                ),
            )
        }
    )
    assert detect_dead_active(backing_off, now=make.now, since=long_ago) is None


def test_a_confirmed_dead_active_is_failed_over_by_the_ordinary_path(make: FleetFactory) -> None:
    fleet = two_model_fleet(make, active_state=DomainState.FAILED)
    decision = detect_failover(fleet, now=make.now)
    assert decision is not None
    assert decision.reason == "active_failed"
    assert decision.target_domain_id == fleet.domains[1].id


def test_quick_fresh_heartbeats_only_while_a_confirmation_is_due(make: FleetFactory) -> None:
    fleet = two_model_fleet(make)
    confirm = timedelta(milliseconds=fleet.policy.dead_confirm_ms)
    assert awaiting_confirmation(fleet, now=make.now, since=make.now)
    assert awaiting_confirmation(fleet, now=make.now, since=make.now - confirm / 2)
    # Past the interval (the active could not be failed: no standby, say): regular ticks.
    assert not awaiting_confirmation(fleet, now=make.now, since=make.now - confirm)
    assert not awaiting_confirmation(fleet, now=make.now, since=None)
    manual = two_model_fleet(make, policy=Policy())
    assert not awaiting_confirmation(manual, now=make.now, since=make.now)


# ---- partitions ----


def test_reaching_no_supervisor_of_several_is_a_partition(make: FleetFactory) -> None:
    a, b, c = (make.domain_id(s) for s in ("a", "b", "c"))
    assert server_partitioned([a, b], [])
    assert server_partitioned([a, b, c], [])
    assert not server_partitioned([a, b], [b])
    assert not server_partitioned([a, b, c], [a])
    # One domain alone: its loss and a partition look the same, and nothing could take over.
    assert not server_partitioned([a], [])
    assert not server_partitioned([], [])


# ---- a lost host ----


def test_a_lost_host_is_supervisor_and_every_endpoint_refused_while_the_standby_answers(
    make: FleetFactory,
) -> None:
    fleet = two_model_fleet(make)
    alpha, beta = fleet.domains
    links = serving_endpoints(alpha)
    assert links == (("alpha.test", 8000), ("alpha.test", 8800))
    refused = dict.fromkeys(links, Reach.REFUSED)
    mixed = {links[0]: Reach.NO_ROUTE, links[1]: Reach.REFUSED}
    for endpoints in (refused, mixed):
        assert host_unreachable(
            fleet, alpha, supervisor=Reach.REFUSED, endpoints=endpoints, reached=[beta.id]
        )
    # The server reached no other domain: its own network may be the one gone.
    assert not check_endpoints(fleet, alpha, supervisor=Reach.REFUSED, reached=[])
    assert not host_unreachable(
        fleet, alpha, supervisor=Reach.REFUSED, endpoints=refused, reached=[]
    )
    # A silent drop, a slow supervisor, a TLS failure: weak.
    for supervisor in (Reach.CONNECT_TIMEOUT, Reach.SLOW, Reach.BROKEN, None):
        assert not host_unreachable(
            fleet, alpha, supervisor=supervisor, endpoints=refused, reached=[beta.id]
        )
    # One endpoint still listening, or timing out: weak.
    for alive in (Reach.ANSWERED, Reach.CONNECT_TIMEOUT):
        assert not host_unreachable(
            fleet,
            alpha,
            supervisor=Reach.REFUSED,
            endpoints={**refused, links[1]: alive},
            reached=[beta.id],
        )
    # The standby is never proven dead this way.
    assert not host_unreachable(
        fleet,
        beta,
        supervisor=Reach.REFUSED,
        endpoints=dict.fromkeys(serving_endpoints(beta), Reach.REFUSED),
        reached=[alpha.id],
    )


def test_weak_evidence_names_what_keeps_the_grace(make: FleetFactory) -> None:
    fleet = two_model_fleet(make)
    alpha, beta = fleet.domains

    def weak(**kw: object) -> str | None:
        args: dict[str, object] = {
            "status": None,
            "supervisor": None,
            "proxy_failed": False,
            "proven": False,
        }
        args.update(kw)
        return weak_evidence(fleet, alpha, **args)  # type: ignore[arg-type]

    assert weak(supervisor=Reach.SLOW) == "heartbeat_timeout"
    assert weak(supervisor=Reach.CONNECT_TIMEOUT) == "heartbeat_timeout"
    assert weak(supervisor=Reach.REFUSED) == "heartbeat_unreachable"
    assert weak(supervisor=Reach.BROKEN) == "heartbeat_error"
    # A partial loss (one model of two refuses) is weak: the other still serves.
    partial = status(a=(False, True), b=(False, False))
    assert weak(status=partial) == "partial_models_down"
    assert weak(status=status(a=(False, False), b=(False, False)), proxy_failed=True) == (
        "proxy_connect_failed"
    )
    assert weak(status=status(a=(False, False), b=(False, False))) is None
    assert weak(supervisor=Reach.REFUSED, proven=True) is None
    assert (
        weak_evidence(
            fleet, beta, status=None, supervisor=Reach.REFUSED, proxy_failed=True, proven=False
        )
        is None
    )
