"""Wire models: round trips, camelCase keys, strict vs lenient parsing, snapshot rules."""

from __future__ import annotations

import inspect
import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import haru_protocol
import pytest
from haru_protocol import (
    AcceptedResponse,
    AlreadyActiveResponse,
    ApplyRequest,
    Cloud,
    DemoteRequest,
    DomainActionRequest,
    DomainSnapshot,
    DomainState,
    ErrorBody,
    ErrorCode,
    Event,
    EventList,
    FleetLayout,
    FleetList,
    FleetRoutePointer,
    FleetSnapshot,
    GpuMemory,
    GpuMemoryResponse,
    Health,
    InferenceSlotSpec,
    InferenceSlotState,
    ModelBinding,
    ModelStatus,
    OkResponse,
    Operation,
    OperationError,
    OperationKind,
    OperationRequestResponse,
    OperationState,
    OperationStep,
    PeerModel,
    Placement,
    Policy,
    ProbeRequest,
    ProbeResponse,
    ProbeResult,
    PromoteRequest,
    Provider,
    ReadyResponse,
    ReconcileResponse,
    RouteIntent,
    RouteModel,
    RouteTarget,
    SleepRequest,
    SlotKind,
    SlotSnapshot,
    SlotStatus,
    SupervisorStatus,
    TrainingRunState,
    TrainingSlotSpec,
    TrainingSlotState,
    TrainingSlotStatus,
    TrainingStatus,
    TrainingStatusResponse,
    TrainingStopRequest,
    WakeRequest,
    WireModel,
    error_body,
    example_layout_json,
)
from pydantic import BaseModel, TypeAdapter, ValidationError

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
FLEET_ID = uuid.UUID("11111111-1111-4111-8111-111111111111")
DOMAIN_ID = uuid.UUID("22222222-2222-4222-8222-222222222222")
SLOT_ID = uuid.UUID("33333333-3333-4333-8333-333333333333")
OP_ID = uuid.UUID("44444444-4444-4444-8444-444444444444")


def inference_slot(state: str = "serving") -> dict[str, Any]:
    return {
        "id": str(SLOT_ID),
        "domainId": str(DOMAIN_ID),
        "gpuIndex": 0,
        "kind": "inference",
        "state": state,
        "spec": {
            "kind": "inference",
            "gpuIndex": 0,
            "models": [{"name": "chat", "servingUrl": "http://h.test:8000"}],
        },
    }


def training_slot(state: str = "idle") -> dict[str, Any]:
    return {
        "id": str(SLOT_ID),
        "domainId": str(DOMAIN_ID),
        "gpuIndex": 0,
        "kind": "training",
        "state": state,
        "spec": {"kind": "training", "gpuIndex": 0, "command": ["t"], "checkpointDir": "/c"},
    }


def domain_doc() -> dict[str, Any]:
    return {
        "id": str(DOMAIN_ID),
        "fleetId": str(FLEET_ID),
        "slug": "alpha",
        "state": "ready",
        "provider": "static",
        "placement": {"cloud": "aws", "region": "r", "accelerator": "EXAMPLE-GPU"},
        "supervisorUrl": "http://h.test:8701",
        "servingBaseUrl": None,
        "lastSeenAt": "2026-03-01T12:00:00+09:00",
        "stateUpdatedAt": "2026-03-01T03:00:00Z",
        "slots": [inference_slot(), {**training_slot(), "id": str(uuid.uuid4())}],
    }


def fleet_doc() -> dict[str, Any]:
    return {
        "id": str(FLEET_ID),
        "slug": "fleet",
        "displayName": None,
        "activeDomainId": str(DOMAIN_ID),
        "routeRevision": 3,
        "policy": Policy().model_dump(mode="json"),
        "domains": [domain_doc()],
    }


def operation() -> Operation:
    return Operation(
        id=OP_ID,
        fleet_id=FLEET_ID,
        kind=OperationKind.PROMOTE,
        state=OperationState.FAILED,
        target_domain_id=DOMAIN_ID,
        source_domain_id=None,
        current_step=OperationStep.PROBE,
        step_started_at=NOW,
        error=OperationError(step=OperationStep.PROBE, code="probe_failed", message="m failed"),
        created_at=NOW - timedelta(minutes=1),
        finished_at=NOW,
    )


def route_intent() -> RouteIntent:
    target = RouteTarget(
        domain_id=DOMAIN_ID,
        domain_slug="alpha",
        endpoint_url="http://alpha.test:8800",
        eligible=True,
        weight=1,
        models=(RouteModel(name="chat", serving_url="http://h.test:8000", eligible=True),),
    )
    return RouteIntent(
        fleet_id=FLEET_ID,
        fleet_slug="fleet",
        revision=2,
        generated_at=NOW,
        active=target,
        standbys=(),
    )


REPRESENTATIVE: list[BaseModel] = [
    FleetSnapshot.model_validate(fleet_doc()),
    DomainSnapshot.model_validate(domain_doc()),
    SlotSnapshot.model_validate(training_slot("failed")),
    SlotSnapshot.model_validate(inference_slot("failed")),
    operation(),
    route_intent(),
    FleetList(
        fleets=(FleetRoutePointer(id=FLEET_ID, slug="f", active_domain_id=None, route_revision=1),)
    ),
    AcceptedResponse(operation=operation()),
    AlreadyActiveResponse(route_revision=5),
    ReconcileResponse(fleet_id=FLEET_ID, operation=None),
    Event(
        id=1, fleet_id=FLEET_ID, type="operation.failed", payload={"a": [1, "b"]}, created_at=NOW
    ),
    EventList(events=(), next_after=None),
    PromoteRequest(target_domain_id=DOMAIN_ID),
    DemoteRequest(target_domain_id=DOMAIN_ID),
    Health(),
    error_body(ErrorCode.INVALID_TARGET, "nope"),
    SupervisorStatus(
        ready=True,
        slots=(
            SlotStatus(
                gpu_index=0,
                kind=SlotKind.INFERENCE,
                models=(ModelStatus(name="chat", port=8000, sleeping=None),),
            ),
            SlotStatus(
                gpu_index=0,
                kind=SlotKind.TRAINING,
                training=TrainingStatus(state=TrainingRunState.RUNNING, pids=(1, 2)),
            ),
        ),
    ),
    ReadyResponse(ready=False),
    SleepRequest(gpu_index=1, drain_timeout_ms=5_000),
    WakeRequest(),
    OkResponse(),
    TrainingStopRequest(grace_ms=1_000),
    TrainingStatusResponse(
        slots=(TrainingSlotStatus(gpu_index=0, state=TrainingRunState.IDLE, pids=()),)
    ),
    GpuMemoryResponse(gpus=(GpuMemory(index=0, used_mib=1.5, total_mib=80.0),)),
    ProbeRequest(prompt="hi", max_tokens=2, timeout_ms=1_000),
    ProbeResponse(
        ok=False,
        results=(ProbeResult(model="chat", ok=False, latency_ms=1.25, error="boom"),),
    ),
    Policy(auto_failover=True, wake_timeout_ms=1),
]


@pytest.mark.parametrize("model", REPRESENTATIVE, ids=lambda m: type(m).__name__)
def test_round_trip(model: BaseModel) -> None:
    assert type(model).model_validate_json(model.model_dump_json()) == model


def test_operation_request_response_union() -> None:
    adapter: TypeAdapter[AlreadyActiveResponse | AcceptedResponse] = TypeAdapter(
        OperationRequestResponse
    )
    accepted = AcceptedResponse(operation=operation())
    assert adapter.validate_json(accepted.model_dump_json()) == accepted
    already = adapter.validate_json('{"status": "already_active", "routeRevision": 9}')
    assert already == AlreadyActiveResponse(route_revision=9)
    with pytest.raises(ValidationError):
        adapter.validate_json('{"status": "other", "routeRevision": 9}')


# ---- camelCase key snapshots ----


def keys(model: BaseModel) -> list[str]:
    return list(json.loads(model.model_dump_json()))


def test_fleet_snapshot_keys() -> None:
    fleet = FleetSnapshot.model_validate(fleet_doc())
    assert keys(fleet) == [
        "id",
        "slug",
        "displayName",
        "activeDomainId",
        "routeRevision",
        "routeLeaseMs",
        "policy",
        "domains",
        "reconciled",
        "warnings",
    ]
    assert keys(fleet.domains[0]) == [
        "id",
        "fleetId",
        "slug",
        "state",
        "provider",
        "placement",
        "supervisorUrl",
        "servingBaseUrl",
        "lastSeenAt",
        "stateUpdatedAt",
        "slots",
        "authFailing",
        "lastSupervisorError",
        "promotionBackoffUntil",
        "provisioning",
        "launchAttempt",
        "launchStartedAt",
        "launchedAt",
        "connectFailedAt",
    ]
    assert keys(fleet.domains[0].slots[0]) == [
        "id",
        "domainId",
        "gpuIndex",
        "kind",
        "state",
        "spec",
    ]
    assert keys(fleet.domains[0].placement) == [
        "cloud",
        "region",
        "accelerator",
        "acceleratorCount",
        "useSpot",
    ]


def test_layout_keys(layout_doc: dict[str, Any]) -> None:
    layout = FleetLayout.model_validate(layout_doc)
    assert keys(layout) == [
        "$schema",
        "slug",
        "displayName",
        "activeDomainSlug",
        "policy",
        "domains",
    ]
    assert keys(layout.domains[0]) == [
        "slug",
        "provider",
        "placement",
        "supervisorUrl",
        "servingBaseUrl",
        "slots",
    ]
    assert keys(layout.domains[0].slots[0]) == ["kind", "gpuIndex", "models", "sleepLevel"]
    assert keys(layout.domains[0].inference_slots[0].models[0]) == ["name", "servingUrl"]
    assert keys(layout.domains[0].slots[1]) == ["kind", "gpuIndex", "command", "checkpointDir"]


def test_operation_keys() -> None:
    assert keys(operation()) == [
        "id",
        "fleetId",
        "kind",
        "state",
        "targetDomainId",
        "sourceDomainId",
        "currentStep",
        "stepStartedAt",
        "error",
        "routingCommitted",
        "createdAt",
        "finishedAt",
    ]
    wire = json.loads(operation().model_dump_json())
    assert wire["kind"] == "promote"
    assert wire["currentStep"] == "probe"
    assert wire["error"] == {"step": "probe", "code": "probe_failed", "message": "m failed"}
    assert wire["createdAt"] == "2026-03-01T11:59:00Z"


def test_gpu_memory_keys() -> None:
    memory = GpuMemory(index=3, used_mib=10.0, total_mib=80.0)
    assert json.loads(memory.model_dump_json()) == {"index": 3, "usedMiB": 10.0, "totalMiB": 80.0}
    parsed = GpuMemory.model_validate_json('{"index": 3, "usedMiB": 1, "totalMiB": 2}')
    assert (parsed.used_mib, parsed.total_mib) == (1.0, 2.0)


def test_route_intent_keys() -> None:
    wire = json.loads(route_intent().model_dump_json())
    assert list(wire) == ["fleetId", "fleetSlug", "revision", "generatedAt", "active", "standbys"]
    assert list(wire["active"]) == [
        "domainId",
        "domainSlug",
        "endpointUrl",
        "eligible",
        "weight",
        "models",
    ]
    assert wire["active"]["models"] == [
        {"name": "chat", "servingUrl": "http://h.test:8000", "eligible": True}
    ]


def test_supervisor_bodies_keys() -> None:
    assert keys(SleepRequest(gpu_index=0, drain_timeout_ms=1)) == ["gpuIndex", "drainTimeoutMs"]
    assert keys(ProbeRequest(timeout_ms=5)) == ["prompt", "maxTokens", "timeoutMs"]
    assert keys(TrainingStopRequest(grace_ms=5)) == ["graceMs"]
    assert keys(ProbeResult(model="m", ok=True, latency_ms=1.0)) == [
        "model",
        "ok",
        "latencyMs",
        "error",
    ]


def test_error_envelope() -> None:
    body = error_body(ErrorCode.FLEET_NOT_FOUND, "x" * 10_000)
    wire = json.loads(body.model_dump_json())
    assert list(wire) == ["error"]
    assert wire["error"]["code"] == "fleet_not_found"
    assert len(wire["error"]["message"]) == 4096


# ---- strict documents vs lenient peer responses ----

STRICT_BODIES: list[tuple[type[WireModel], dict[str, Any]]] = [
    (PromoteRequest, {"targetDomainId": str(DOMAIN_ID)}),
    (DemoteRequest, {"targetDomainId": str(DOMAIN_ID)}),
    (SleepRequest, {}),
    (WakeRequest, {"gpuIndex": 1}),
    (TrainingStopRequest, {"graceMs": 10}),
    (ProbeRequest, {"prompt": "x"}),
    (DomainActionRequest, {}),
    (ApplyRequest, {"layout": json.loads(example_layout_json()), "dryRun": True}),
]


@pytest.mark.parametrize(("model", "body"), STRICT_BODIES, ids=lambda v: getattr(v, "__name__", ""))
def test_request_bodies_reject_unknown_keys(model: type[WireModel], body: dict[str, Any]) -> None:
    model.model_validate(body)
    with pytest.raises(ValidationError, match="extra"):
        model.model_validate({**body, "surprise": True})


def test_request_bodies_are_every_request_model() -> None:
    requests = {
        obj
        for name in haru_protocol.__all__
        if name.endswith("Request")
        and inspect.isclass(obj := getattr(haru_protocol, name))
        and issubclass(obj, BaseModel)
    }
    assert requests == {m for m, _ in STRICT_BODIES}


def test_promote_request_needs_a_uuid() -> None:
    with pytest.raises(ValidationError):
        PromoteRequest.model_validate({"targetDomainId": "not-a-uuid"})
    with pytest.raises(ValidationError):
        PromoteRequest.model_validate({})


LENIENT: list[tuple[type[PeerModel], dict[str, Any]]] = [
    (FleetSnapshot, fleet_doc()),
    (SupervisorStatus, {"slots": [], "ready": True}),
    (ProbeResponse, {"ok": True, "results": []}),
    (GpuMemoryResponse, {"gpus": [{"index": 0, "usedMiB": 1, "totalMiB": 2}]}),
    (TrainingStatusResponse, {"slots": []}),
    (OkResponse, {"status": "ok"}),
    (ReadyResponse, {"ready": True}),
    (ErrorBody, {"error": {"code": "x", "message": "y"}}),
    (RouteIntent, json.loads(route_intent().model_dump_json())),
    (Operation, json.loads(operation().model_dump_json())),
]


@pytest.mark.parametrize(("model", "body"), LENIENT, ids=lambda v: getattr(v, "__name__", ""))
def test_peer_responses_ignore_unknown_keys(model: type[PeerModel], body: dict[str, Any]) -> None:
    plain = model.model_validate(body)
    assert model.model_validate({**body, "addedInANewerVersion": {"x": 1}}) == plain


def test_nested_peer_unknown_keys_ignored() -> None:
    doc = fleet_doc()
    doc["domains"][0]["future"] = 1
    doc["domains"][0]["slots"][0]["future"] = 2
    status = {
        "ready": False,
        "slots": [
            {
                "gpuIndex": 0,
                "kind": "inference",
                "models": [{"name": "m", "port": 1, "sleeping": True, "x": 1}],
                "y": 2,
            }
        ],
    }
    assert FleetSnapshot.model_validate(doc).domains[0].slug == "alpha"
    assert SupervisorStatus.model_validate(status).slots[0].models is not None


# ---- snapshot rules ----


@pytest.mark.parametrize("state", [s.value for s in InferenceSlotState])
def test_inference_slot_states(state: str) -> None:
    slot = SlotSnapshot.model_validate(inference_slot(state))
    assert slot.state is InferenceSlotState(state)
    assert isinstance(slot.inference_spec, InferenceSlotSpec)
    assert slot.training_spec is None


@pytest.mark.parametrize("state", [s.value for s in TrainingSlotState])
def test_training_slot_states(state: str) -> None:
    slot = SlotSnapshot.model_validate(training_slot(state))
    assert slot.state is TrainingSlotState(state)
    assert isinstance(slot.training_spec, TrainingSlotSpec)
    assert slot.inference_spec is None


@pytest.mark.parametrize("state", ["idle", "training", "stopping", "bogus"])
def test_inference_slot_rejects_wrong_kind_state(state: str) -> None:
    with pytest.raises(ValidationError, match="not a inference slot state"):
        SlotSnapshot.model_validate(inference_slot(state))


@pytest.mark.parametrize("state", ["serving", "sleeping", "waking", "probing", "starting", "x"])
def test_training_slot_rejects_wrong_kind_state(state: str) -> None:
    with pytest.raises(ValidationError, match="not a training slot state"):
        SlotSnapshot.model_validate(training_slot(state))


def test_wrong_kind_state_rejected_from_python_objects() -> None:
    with pytest.raises(ValidationError):
        SlotSnapshot(
            id=SLOT_ID,
            domain_id=DOMAIN_ID,
            gpu_index=0,
            kind=SlotKind.TRAINING,
            state=InferenceSlotState.SERVING,
            spec=TrainingSlotSpec(gpu_index=0, command=("t",), checkpoint_dir="/c"),
        )


def test_slot_kind_must_equal_spec_kind() -> None:
    doc = inference_slot("failed")
    doc["spec"] = training_slot()["spec"]
    with pytest.raises(ValidationError, match="differs from spec kind"):
        SlotSnapshot.model_validate(doc)


def test_slot_gpu_must_equal_spec_gpu() -> None:
    doc = inference_slot()
    doc["gpuIndex"] = 1
    with pytest.raises(ValidationError, match="gpuIndex"):
        SlotSnapshot.model_validate(doc)


def test_shared_state_names_resolve_by_kind() -> None:
    # "failed" and "stopped" exist in both vocabularies; the kind decides which enum.
    assert SlotSnapshot.model_validate(inference_slot("failed")).state is InferenceSlotState.FAILED
    assert SlotSnapshot.model_validate(training_slot("failed")).state is TrainingSlotState.FAILED


def test_snapshot_times_must_be_aware() -> None:
    doc = domain_doc()
    doc["lastSeenAt"] = "2026-03-01T12:00:00"
    with pytest.raises(ValidationError, match="timezone"):
        DomainSnapshot.model_validate(doc)


def test_snapshot_times_keep_the_instant() -> None:
    domain = DomainSnapshot.model_validate(domain_doc())
    assert domain.last_seen_at == datetime(2026, 3, 1, 3, 0, tzinfo=UTC)
    assert domain.last_seen_at.utcoffset() == timedelta(hours=9)
    assert domain.last_seen_at.tzinfo == timezone(timedelta(hours=9))


def test_snapshot_slug_checked_on_read_back() -> None:
    doc = domain_doc()
    doc["slug"] = "Alpha"
    with pytest.raises(ValidationError, match="invalid slug"):
        DomainSnapshot.model_validate(doc)


def test_route_revision_at_least_one() -> None:
    doc = fleet_doc()
    doc["routeRevision"] = 0
    with pytest.raises(ValidationError):
        FleetSnapshot.model_validate(doc)


def test_fleet_snapshot_helpers() -> None:
    fleet = FleetSnapshot.model_validate(fleet_doc())
    assert fleet.domain(DOMAIN_ID) is fleet.domains[0]
    assert fleet.domain(uuid.uuid4()) is None
    assert fleet.active_domain is fleet.domains[0]
    assert fleet.model_copy(update={"active_domain_id": None}).active_domain is None


# ---- UUIDs ----


def test_uppercase_uuids_accepted_and_serialised_lowercase() -> None:
    upper = str(DOMAIN_ID).upper()
    body = PromoteRequest.model_validate_json(json.dumps({"targetDomainId": upper}))
    assert body.target_domain_id == DOMAIN_ID
    assert json.loads(body.model_dump_json()) == {"targetDomainId": str(DOMAIN_ID)}
    doc = fleet_doc()
    doc["id"] = str(FLEET_ID).upper()
    doc["activeDomainId"] = str(DOMAIN_ID).upper()
    fleet = FleetSnapshot.model_validate(doc)
    assert fleet.active_domain is not None
    assert json.loads(fleet.model_dump_json())["id"] == str(FLEET_ID)


# ---- models are immutable and hashable where they hold no dicts ----


def test_models_are_frozen() -> None:
    body = PromoteRequest(target_domain_id=DOMAIN_ID)
    with pytest.raises(ValidationError, match="frozen"):
        body.target_domain_id = FLEET_ID  # type: ignore[misc]
    assert hash(body) == hash(PromoteRequest(target_domain_id=DOMAIN_ID))
    assert hash(Placement(cloud=Cloud.AWS, region="r", accelerator="g")) is not None
    assert hash(ModelBinding(name="m", serving_url="http://h.test")) is not None


def test_domain_snapshot_defaults_and_enums() -> None:
    domain = DomainSnapshot.model_validate(domain_doc())
    assert domain.state is DomainState.READY
    assert domain.provider is Provider.STATIC


# ---- meta ----


def exported_models() -> list[type[BaseModel]]:
    return [
        obj
        for name in haru_protocol.__all__
        if inspect.isclass(obj := getattr(haru_protocol, name)) and issubclass(obj, BaseModel)
    ]


def test_every_exported_model_is_wire_or_peer() -> None:
    models = exported_models()
    assert len(models) > 40
    for model in models:
        if model in (WireModel, PeerModel):
            continue
        bases = [issubclass(model, WireModel), issubclass(model, PeerModel)]
        assert bases.count(True) == 1, model.__name__


def test_wire_and_peer_bases_differ_only_in_extra() -> None:
    wire = dict(WireModel.model_config)
    peer = dict(PeerModel.model_config)
    assert wire.pop("extra") == "forbid"
    assert peer.pop("extra") == "ignore"
    assert wire == peer
    assert wire["frozen"] is True


def test_every_export_resolves() -> None:
    assert len(set(haru_protocol.__all__)) == len(haru_protocol.__all__)
    for name in haru_protocol.__all__:
        assert getattr(haru_protocol, name) is not None
