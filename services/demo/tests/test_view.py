"""The live view rendered from snapshots, operations and events recorded from a real demo."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

from haru_demo._posture import active_slug, heartbeats_judged, is_standby_posture
from haru_demo._traffic import TrafficSummary
from haru_demo._view import ViewState, event_detail, render_view, step_durations
from haru_protocol import DomainState, Event, EventList, FleetSnapshot, Operation
from rich.console import Console

DATA = Path(__file__).parent / "data"


def load(name: str) -> Any:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def fleet(name: str) -> FleetSnapshot:
    return FleetSnapshot.model_validate(load(name))


def operation(name: str) -> Operation:
    return Operation.model_validate(load(name))


def events() -> list[Event]:
    return list(EventList.model_validate(load("events-promotion.json")).events)


def text_of(state: ViewState, *, now: datetime) -> str:
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(render_view(state, now=now))
    return out.getvalue()


def test_mid_promotion_view_shows_roles_slot_states_and_the_running_step() -> None:
    snapshot = fleet("fleet-mid-promotion.json")
    mid = operation("operation-mid-promotion.json")
    assert mid.step_started_at is not None
    now = mid.step_started_at + timedelta(seconds=1.5)
    state = ViewState(
        server_url="http://127.0.0.1:8700",
        fleet=snapshot,
        operation=mid,
        served={"alpha": 120, "beta": 0},
        traffic=TrafficSummary(total=120, ok=119, failed=1, stale=0),
        rate=31.0,
        traffic_running=True,
        phase="planned switchover: promoting beta",
    )
    text = text_of(state, now=now)
    lines = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    assert "ACTIVE" in lines["alpha"]
    assert "standby" in lines["beta"]
    assert "vllm serving" in lines["alpha"]
    assert "train idle" in lines["alpha"]
    assert "vllm waking" in lines["beta"]
    assert "120" in lines["alpha"]
    assert "promote -> beta  running  step wake_vllm (1.5s)" in text
    assert "119 ok, 1 failed, 0 served stale, 31 req/s" in text
    assert "phase: planned switchover: promoting beta" in text
    assert "route revision 2" in text


def test_finished_promotion_view_lists_each_step_with_its_time() -> None:
    done = operation("operation-promotion.json")
    state = ViewState(
        server_url="http://127.0.0.1:8700",
        fleet=fleet("fleet-after-promotion.json"),
        operation=done,
        traffic=TrafficSummary(total=10, ok=10, failed=0, stale=3),
        traffic_running=False,
    )
    for event in events()[-6:]:
        state.events.append(event)
    text = text_of(state, now=datetime.now(UTC))
    assert "promote -> beta  succeeded" in text
    assert "step " not in text.split("promote -> beta")[1].splitlines()[0]
    assert "10 ok, 0 failed, 3 served stale (stopped)" in text
    assert "operation.succeeded" in text


def test_view_without_a_snapshot_says_why() -> None:
    state = ViewState(server_url="http://127.0.0.1:8700", error="cannot reach the server")
    text = text_of(state, now=datetime.now(UTC))
    assert "server unreachable: cannot reach the server" in text
    assert "no operation yet" in text


def test_step_durations_follow_the_promote_plan_from_its_events() -> None:
    done = operation("operation-promotion.json")
    durations = step_durations(events(), done.id)
    assert [step for step, _ in durations] == [
        "stop_training",
        "verify_gpu",
        "wake_vllm",
        "probe",
        "switch_active",
        "demote_old_sleep",
        "demote_old_train",
    ]
    assert all(seconds >= 0 for _, seconds in durations)
    started = next(
        e for e in events() if e.type == "operation.started" and e.operation_id == done.id
    )
    assert done.finished_at is not None
    total = (done.finished_at - started.created_at).total_seconds()
    assert abs(sum(seconds for _, seconds in durations) - total) < 0.01


def test_step_durations_ignore_other_operations_and_need_a_start() -> None:
    assert step_durations(events(), UUID(int=0)) == []
    done = operation("operation-promotion.json")
    without_start = [e for e in events() if e.type != "operation.started"]
    assert step_durations(without_start, done.id) == []


def test_event_detail_names_the_interesting_payload_keys() -> None:
    by_type = {e.type: e for e in events()}
    assert event_detail(by_type["operation.step.done"]).startswith("step=")
    assert "kind=promote" in event_detail(by_type["operation.succeeded"])
    assert event_detail(by_type["fleet.layout.applied"]) == ""


def test_posture_and_role_helpers_read_the_snapshot() -> None:
    mid = fleet("fleet-mid-promotion.json")
    after = fleet("fleet-after-promotion.json")
    assert active_slug(mid) == "alpha"
    assert active_slug(after) == "beta"
    assert not is_standby_posture(mid, "beta")  # waking, training idle
    assert not is_standby_posture(after, "beta")  # the active is never a standby
    assert is_standby_posture(after, "alpha")
    assert not is_standby_posture(after, "gamma")


def test_a_domain_seen_but_still_provisioning_is_not_judged_yet() -> None:
    after = fleet("fleet-after-promotion.json")
    assert heartbeats_judged(after)
    beta = next(d for d in after.domains if d.slug == "beta")
    assert beta.last_seen_at is not None
    # Seen (the heartbeat statement landed) but not yet judged (the next statement).
    seen_only = after.model_copy(
        update={
            "domains": tuple(
                d.model_copy(update={"state": DomainState.PROVISIONING}) if d is beta else d
                for d in after.domains
            )
        }
    )
    assert not heartbeats_judged(seen_only)
    never_seen = after.model_copy(
        update={
            "domains": tuple(
                d.model_copy(update={"last_seen_at": None}) if d is beta else d
                for d in after.domains
            )
        }
    )
    assert not heartbeats_judged(never_seen)
