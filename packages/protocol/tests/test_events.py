from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import pytest
from haru_protocol import (
    EVENT_PAYLOADS,
    DomainNotReady,
    Event,
    EventType,
    OperationErrorCode,
    OperationFailed,
    OperationPromotionBackoff,
    OperationRestoreDemote,
    OperationStep,
    OperationStepDone,
    UntypedEventPayload,
    event_json_schema,
    event_payload_document,
    parse_event_payload,
)

A = "0b0c4a2e-1d2f-4b5a-9c8d-7e6f5a4b3c2d"
B = "11111111-2222-4333-8444-555555555555"

# Payloads exactly as earlier versions stored them (one per type): they must read typed and
# serialise back to the same JSON.
STORED: dict[str, dict[str, Any]] = {
    "operation.requested.promote": {"kind": "promote", "targetDomainId": A, "sourceDomainId": B},
    "operation.requested.demote": {"kind": "demote", "targetDomainId": A, "sourceDomainId": None},
    "operation.auto_failover": {"reason": "active_stale", "activeDomainId": B, "targetDomainId": A},
    "operation.restore_demote": {"causeOperationId": B, "targetDomainId": A, "reason": "cas_lost"},
    "operation.started": {"kind": "promote", "targetDomainId": A},
    "operation.step.done": {
        "step": "verify_gpu",
        "gpus": [{"index": 0, "usedMiB": 512.0, "totalMiB": 81920.0}],
    },
    "operation.step.timeout_best_effort": {
        "step": "demote_old_sleep",
        "sourceDomainId": B,
        "sourceDegraded": True,
    },
    "operation.succeeded": {"kind": "demote", "targetDomainId": A},
    "operation.failed": {
        "step": "probe",
        "code": "probe_failed",
        "message": "probe failed: m (timeout)",
        "failedModels": [{"model": "m", "error": "timeout"}],
    },
    "operation.promotion_backoff": {
        "targetDomainId": A,
        "consecutiveFailures": 2,
        "delayMs": 60000,
        "until": "2025-01-02T03:04:05.123456+00:00",
    },
    "routing.switched": {"fromDomainId": None, "toDomainId": A, "routeRevision": 7},
    "domain.state.changed": {
        "from": "degraded",
        "to": "ready",
        "role": "standby",
        "reachable": True,
        "supervisorReady": False,
    },
    "domain.not_ready": {
        "from": "ready",
        "to": "degraded",
        "role": "active",
        "reachable": True,
        "supervisorReady": True,
        "activeReady": False,
        "modelsNotAwake": ["b"],
    },
    "domain.heartbeat.failed": {
        "from": "ready",
        "to": "degraded",
        "role": "active",
        "reachable": False,
    },
    "domain.degraded.escalated": {"from": "degraded", "to": "failed", "degradedGraceMs": 30000},
    "domain.supervisor.unauthorized": {"message": "401 from supervisor", "role": "standby"},
    "domain.supervisor.authorized": {},
    "domain.dead_suspected": {
        "evidence": "host_unreachable",
        "models": ["m"],
        "endpoints": 1,
        "proxyConnectFailedAt": "2026-12-03T10:00:00+00:00",
        "deadConfirmMs": 1000,
    },
    "domain.dead_cleared": {
        "evidence": "models_refused",
        "suspectedAt": "2026-12-03T10:00:00+00:00",
    },
    "slot.state.changed": {
        "kind": "inference",
        "from": "serving",
        "to": "failed",
        "cause": "heartbeat",
    },
    "fleet.layout.applied": {
        "fleetCreated": True,
        "domainsCreated": 2,
        "slotsCreated": 8,
        "pointerSet": True,
    },
    "fleet.policy.changed": {
        "old": {"autoFailover": True, "wakeTimeoutMs": 5000},
        "new": {"autoFailover": True, "degradedGraceMs": 2000},
        "changed": ["degradedGraceMs", "wakeTimeoutMs"],
    },
    "fleet.config.changed": {
        "action": "~",
        "subject": "model",
        "path": "domain b / inference gpu 0 / model chat",
        "detail": "servingUrl: http://127.0.0.1:9401/ -> http://127.0.0.1:9411/",
        "revision": 2,
    },
    "domain.launch.started": {"cluster": "haru-f-a", "attempt": 1, "role": "standby"},
    "domain.launch.succeeded": {"cluster": "haru-f-a", "attempt": 1, "observed": False},
    "domain.provisioning.failed": {
        "cluster": "haru-f-a",
        "attempt": 1,
        "reason": "launch_failed",
        "message": "sky launch exited 1",
        "argv": ["sky", "launch", "-c", "haru-f-a"],
        "exitCode": 1,
        "stderr": "No capacity",
    },
    "domain.address.recorded": {
        "cluster": "haru-f-a",
        "attempt": 1,
        "supervisorUrl": "http://10.0.0.9:8701",
        "servingBaseUrl": "http://10.0.0.9:8000",
    },
    "domain.cluster.lost": {
        "cluster": "haru-f-a",
        "attempt": 1,
        "clusterStatus": "STOPPED",
        "from": "ready",
        "role": "active",
    },
    "domain.relaunch": {
        "cluster": "haru-f-a",
        "relaunch": 1,
        "maxAttempts": 3,
        "backoffMs": 60000,
        "exhausted": False,
    },
    "domain.up.requested": {"from": "stopped"},
    "domain.down.requested": {"from": "ready"},
    "domain.teardown": {"cluster": "haru-f-a", "ok": True},
    "server.clock.skewed": {"skewMs": 10800000, "maxSkewMs": 2000, "host": "cp-2", "pid": 41},
    "server.clock.recovered": {"skewMs": -12, "maxSkewMs": 2000, "host": "cp-2", "pid": 41},
    "server.partitioned": {"domains": 2, "host": "cp-2", "pid": 41},
    "server.partition.healed": {"host": "cp-2", "pid": 41},
}


def test_every_event_type_has_one_model() -> None:
    assert set(EVENT_PAYLOADS) == {t.value for t in EventType}
    assert set(STORED) == set(EVENT_PAYLOADS)
    assert all(model.event_type.value == t for t, model in EVENT_PAYLOADS.items())
    assert len(set(EVENT_PAYLOADS.values())) == len(EVENT_PAYLOADS)


@pytest.mark.parametrize("type_", sorted(STORED))
def test_stored_payloads_read_typed_and_write_back_byte_for_byte(type_: str) -> None:
    stored = STORED[type_]
    data = parse_event_payload(type_, stored)
    assert isinstance(data, EVENT_PAYLOADS[type_])
    assert type(data) is EVENT_PAYLOADS[type_]
    document = event_payload_document(data)
    assert json.dumps(document) == json.dumps(stored)


def test_optional_facts_are_absent_not_null() -> None:
    failed = OperationFailed(
        step=OperationStep.WAKE_VLLM, code=OperationErrorCode.STEP_TIMEOUT, message="late"
    )
    assert event_payload_document(failed) == {
        "step": "wake_vllm",
        "code": "step_timeout",
        "message": "late",
    }
    done = OperationStepDone(step=OperationStep.PROBE, latency_ms={"m": 12.5})
    assert event_payload_document(done) == {"step": "probe", "latencyMs": {"m": 12.5}}


def test_typed_fields_read_back() -> None:
    not_ready = parse_event_payload("domain.not_ready", STORED["domain.not_ready"])
    assert isinstance(not_ready, DomainNotReady)
    assert not_ready.models_not_awake == ("b",)
    backoff = parse_event_payload(
        "operation.promotion_backoff", STORED["operation.promotion_backoff"]
    )
    assert isinstance(backoff, OperationPromotionBackoff)
    assert backoff.until == datetime(2025, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
    restore = parse_event_payload("operation.restore_demote", STORED["operation.restore_demote"])
    assert isinstance(restore, OperationRestoreDemote)
    assert restore.cause_operation_id == UUID(B)


def test_unknown_keys_are_ignored_like_every_peer_model() -> None:
    data = parse_event_payload("operation.started", {**STORED["operation.started"], "new": 1})
    assert not isinstance(data, UntypedEventPayload)


def test_an_unknown_type_reads_untyped_and_intact() -> None:
    data = parse_event_payload("provisioning.launched", {"cluster": "haru-a-b"})
    assert data == UntypedEventPayload(
        type="provisioning.launched", data={"cluster": "haru-a-b"}, error=None
    )


@pytest.mark.parametrize(
    ("type_", "payload"),
    [
        ("operation.step.done", {"step": "no-such-step"}),
        ("operation.step.done", {}),
        ("operation.failed", {"step": "probe", "code": "probe_failed"}),
        ("operation.promotion_backoff", {**STORED["operation.promotion_backoff"], "until": "x"}),
        ("routing.switched", {"toDomainId": "not-a-uuid", "fromDomainId": None}),
        ("domain.not_ready", [1]),
        ("fleet.layout.applied", "text"),
        ("slot.state.changed", None),
    ],
)
def test_a_malformed_payload_reads_untyped_with_the_reason(type_: str, payload: object) -> None:
    data = parse_event_payload(type_, payload)
    assert isinstance(data, UntypedEventPayload)
    assert data.data == payload
    assert data.error is not None


def test_event_data_is_typed_and_the_wire_payload_unchanged() -> None:
    raw = {
        "id": 3,
        "fleetId": A,
        "type": "operation.failed",
        "payload": STORED["operation.failed"],
        "createdAt": "2025-01-02T03:04:05+00:00",
    }
    event = Event.model_validate(raw)
    assert isinstance(event.data, OperationFailed)
    assert event.data.failed_models is not None
    assert event.data.failed_models[0].model == "m"
    assert json.loads(event.model_dump_json())["payload"] == STORED["operation.failed"]
    odd = Event.model_validate({**raw, "payload": {"step": 5}})
    assert isinstance(odd.data, UntypedEventPayload)
    assert json.loads(odd.model_dump_json())["payload"] == {"step": 5}


def test_the_event_schema_is_a_union_keyed_on_the_type() -> None:
    schema = event_json_schema()
    assert schema["discriminator"]["propertyName"] == "type"
    assert set(schema["discriminator"]["mapping"]) == set(EVENT_PAYLOADS)
    failed = schema["$defs"]["OperationFailed"]
    assert set(failed["required"]) == {"step", "code", "message"}
    assert "failedModels" in failed["properties"]
    assert "from" in schema["$defs"]["DomainNotReady"]["properties"]
