"""The scenario's verdict and report, and the ``haru demo`` command's argument handling."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from uuid import uuid4

import pytest
from haru_demo._options import TopologyOptions, UnboundModel
from haru_demo._report import ApplyResult, ScenarioReport, SwitchoverResult, parse_duty_cycles
from haru_demo._run import snippets
from haru_demo._scenario import (
    APPLY_MODEL,
    apply_target,
    operation_budget_s,
    promote_budget_s,
)
from haru_demo._topology import DemoTopology
from haru_demo._traffic import RequestRecord, TrafficSummary
from haru_protocol import (
    Operation,
    OperationKind,
    OperationState,
    Policy,
    load_example_layout,
)
from haru_server.cli import app
from typer.testing import CliRunner


def operation(state: OperationState) -> Operation:
    now = datetime.now(UTC)
    return Operation(
        id=uuid4(),
        fleet_id=uuid4(),
        kind=OperationKind.PROMOTE,
        state=state,
        target_domain_id=uuid4(),
        current_step=None,
        step_started_at=None,
        error=None,
        created_at=now,
        finished_at=now,
    )


def failure(error: str, *, cut: bool = False) -> RequestRecord:
    return RequestRecord(
        client=0,
        model="m",
        stream=True,
        started_at=1.0,
        ended_at=2.0,
        ok=False,
        error=error,
        cut=cut,
    )


def planned(**changes: object) -> SwitchoverResult:
    result = SwitchoverResult(
        kind="planned",
        source="alpha",
        target="beta",
        operation=operation(OperationState.SUCCEEDED),
        steps=[("stop_training", 0.3), ("wake_vllm", 0.25)],
        routing_s=0.8,
        requests=TrafficSummary(total=80, ok=80, failed=0, stale=0),
        budget_s=30.0,
        old_active_standby=True,
    )
    for key, value in changes.items():
        setattr(result, key, value)
    return result


def unplanned(**changes: object) -> SwitchoverResult:
    result = SwitchoverResult(
        kind="unplanned",
        source="beta",
        target="alpha",
        operation=operation(OperationState.SUCCEEDED),
        detection_s=1.1,
        routing_s=2.3,
        first_good_s=2.4,
        requests=TrafficSummary.of(
            [failure("connection failed: incomplete chunked read", cut=True)] * 2
        ),
        failures=[failure("connection failed: incomplete chunked read", cut=True)] * 2,
        budget_s=34.0,
    )
    for key, value in changes.items():
        setattr(result, key, value)
    return result


def test_a_clean_run_is_a_success_and_reports_every_measure() -> None:
    report = ScenarioReport(planned=planned(), unplanned=unplanned(), recovered=True)
    assert report.ok
    text = "\n".join(report.lines())
    assert "planned switchover: alpha -> beta (promote succeeded)" in text
    assert "stop_training 300 ms, wake_vllm 250 ms" in text
    assert "request to routing flip:  800 ms (budget 30 s)" in text
    assert "requests during it:       80 sent, 80 ok, 0 failed" in text
    assert "time to detection:        1100 ms" in text
    assert "first good answer:        2400 ms after the kill" in text
    # Streams the kill cut after their response had started are reported apart from failures.
    assert "2 sent, 0 ok, 0 failed, 2 stream(s) cut after their response had started" in text
    assert "2 x connection failed: incomplete chunked read" in text
    assert text.endswith("RESULT: success")


@pytest.mark.parametrize(
    "report",
    [
        # One failed request in the planned switchover is a failure of the demo.
        ScenarioReport(
            planned=planned(failures=[failure("HTTP 502 upstream_unreachable")]),
            unplanned=unplanned(),
            recovered=True,
        ),
        ScenarioReport(planned=planned(operation=operation(OperationState.FAILED))),
        ScenarioReport(planned=planned(routing_s=None), unplanned=unplanned(), recovered=True),
        ScenarioReport(
            planned=planned(old_active_standby=False), unplanned=unplanned(), recovered=True
        ),
        # A request that failed before any answer in the unplanned failure fails the demo.
        ScenarioReport(
            planned=planned(),
            unplanned=unplanned(
                requests=TrafficSummary.of([failure("HTTP 502 upstream_unreachable")]),
                failures=[failure("HTTP 502 upstream_unreachable")],
            ),
            recovered=True,
        ),
        # The failover must move routing within its budget.
        ScenarioReport(planned=planned(), unplanned=unplanned(routing_s=40.0), recovered=True),
        ScenarioReport(planned=planned(), unplanned=unplanned(routing_s=None), recovered=True),
        ScenarioReport(
            planned=planned(),
            unplanned=unplanned(operation=operation(OperationState.FAILED)),
            recovered=True,
        ),
        ScenarioReport(planned=planned(), unplanned=unplanned(), recovered=False),
        ScenarioReport(planned=planned()),
    ],
)
def test_any_missed_target_fails_the_run(report: ScenarioReport) -> None:
    assert not report.ok
    assert report.lines()[-1] == "RESULT: FAILED"


PLAN = """\
fleet example: 1 change(s)
  + domain beta / inference gpu 0 / model example-chat-mini: servingUrl http://127.0.0.1:9"""


def applied(**changes: object) -> ApplyResult:
    result = ApplyResult(
        model="example-chat-mini",
        domain="beta",
        plan=PLAN,
        applied=True,
        requests=TrafficSummary(total=8, ok=8, failed=0, stale=0),
    )
    for key, value in changes.items():
        setattr(result, key, value)
    return result


def test_the_report_shows_the_apply_its_plan_and_its_models_traffic_first() -> None:
    report = ScenarioReport(
        planned=planned(), apply=applied(), unplanned=unplanned(), recovered=True
    )
    assert report.ok
    lines = report.lines()
    assert lines[:5] == [
        "apply: bind example-chat-mini on beta (standby), dry run first",
        "  fleet example: 1 change(s)",
        "    + domain beta / inference gpu 0 / model example-chat-mini: "
        "servingUrl http://127.0.0.1:9",
        "  applied: yes",
        "  requests for it:          8 sent, 8 ok, 0 failed (client key, once beta was active)",
    ]
    assert lines[5] == "planned switchover: alpha -> beta (promote succeeded)"


@pytest.mark.parametrize(
    "result",
    [
        applied(applied=False, error="HTTP 409 plan_stale"),
        # Applied, but no request for the model was sent (the switchover never happened).
        applied(requests=TrafficSummary(total=0, ok=0, failed=0, stale=0)),
        applied(
            requests=TrafficSummary.of([failure("HTTP 404 model_not_found")]),
            failures=[failure("HTTP 404 model_not_found")],
        ),
    ],
)
def test_an_apply_that_did_not_take_or_whose_model_failed_fails_the_run(
    result: ApplyResult,
) -> None:
    report = ScenarioReport(planned=planned(), apply=result, unplanned=unplanned(), recovered=True)
    assert not report.ok
    text = "\n".join(report.lines())
    assert text.endswith("RESULT: FAILED")
    if result.error:
        assert "applied: NO" in text
        assert "problem: HTTP 409 plan_stale" in text
    if result.failures:
        assert "1 x HTTP 404 model_not_found" in text


def test_the_applied_model_is_served_by_the_standby_but_bound_only_by_the_apply(
    tmp_path: Path,
) -> None:
    shape = load_example_layout()
    target = apply_target(shape)
    assert target == UnboundModel(domain="beta", gpu_index=0, name=APPLY_MODEL)
    topology = DemoTopology(TopologyOptions(workdir=tmp_path, unbound_models=(target,)))
    beta = topology.domains["beta"]
    # Its vLLM serves the model on GPU 0 (the supervisor lists it too) ...
    assert beta.served_on(0) == ("example-chat-small", "example-chat-medium", APPLY_MODEL)
    assert beta.served_on(1) == ("example-chat-large",)
    assert topology.domains["alpha"].served_on(0) == ("example-chat-small", "example-chat-medium")
    # ... but the seeded layout (and so the steady traffic) does not bind it.
    assert APPLY_MODEL not in beta.models


def test_an_unbound_model_needs_an_inference_slot_of_its_domain(tmp_path: Path) -> None:
    for unbound in (
        UnboundModel(domain="gamma", gpu_index=0, name="m"),
        UnboundModel(domain="beta", gpu_index=7, name="m"),
    ):
        with pytest.raises(ValueError, match="no inference slot"):
            DemoTopology(TopologyOptions(workdir=tmp_path, unbound_models=(unbound,)))


def test_budgets_come_from_the_policy() -> None:
    policy = Policy()
    assert promote_budget_s(policy) == (90_000 + 30_000 + 120_000 + 60_000 + 10_000) / 1000
    assert operation_budget_s(policy) == promote_budget_s(policy) + 60 + 30


def test_snippets_use_the_real_url_and_fleet() -> None:
    text = snippets(
        "http://127.0.0.1:8765",
        "example",
        "example-chat-small",
        key_file=Path("/w/secrets/client.key"),
        token_file=Path("/w/secrets/api.token"),
    )
    assert "curl -s http://127.0.0.1:8765/v1/chat/completions" in text
    assert 'OPENAI_API_KEY="$(cat /w/secrets/client.key)"' in text
    assert "HARU_API_TOKEN_FILE=/w/secrets/api.token" in text
    assert '-H "Authorization: Bearer $OPENAI_API_KEY"' in text
    assert 'base_url="http://127.0.0.1:8765/v1"' in text
    assert '"model": "example-chat-small"' in text
    assert "haru fleet show example --url http://127.0.0.1:8765" in text


def test_haru_demo_is_registered_with_its_options() -> None:
    result = CliRunner().invoke(app, ["demo", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in ("--scenario-only", "--duration", "--workdir", "--keep", "--port"):
        assert option in result.output


def test_contradictory_flags_are_refused() -> None:
    result = CliRunner().invoke(app, ["demo", "--scenario-only", "--no-scenario"])
    assert result.exit_code == 2
    assert "exclude each other" in result.output


METRICS_TEXT = """\
# HELP haru_standby_duty_cycle_ratio standby_training_seconds / standby_seconds per domain.
# TYPE haru_standby_duty_cycle_ratio gauge
haru_standby_duty_cycle_ratio{domain="alpha",fleet="demo"} 0.96
haru_standby_duty_cycle_ratio{domain="beta",fleet="demo"} 0.5
haru_standby_duty_cycle_ratio{domain="gamma",fleet="other"} 0.1
"""


def test_the_report_shows_the_standby_duty_cycle_from_the_servers_metrics() -> None:
    cycles = parse_duty_cycles(METRICS_TEXT, fleet="demo")
    assert cycles == {"alpha": 0.96, "beta": 0.5}
    report = ScenarioReport(
        planned=planned(), unplanned=unplanned(), recovered=True, duty_cycles=cycles
    )
    lines = report.lines()
    assert lines[-2] == (
        "standby duty cycle (standby time with every training slot running): alpha 96%, beta 50%"
    )
    assert lines[-1] == "RESULT: success"
