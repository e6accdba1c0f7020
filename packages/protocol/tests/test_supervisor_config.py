"""The supervisor's config document (DESIGN 6.1): strict keys and its cross-field rules."""

from __future__ import annotations

import json
from typing import Any

import pytest
from haru_protocol import SupervisorConfig, SupervisorInferenceSlot, SupervisorTrainingSlot
from pydantic import ValidationError


def check(doc: dict[str, Any]) -> SupervisorConfig:
    return SupervisorConfig.model_validate_json(json.dumps(doc))


def test_valid_config(supervisor_doc: dict[str, Any]) -> None:
    config = check(supervisor_doc)
    assert [s.gpu_index for s in config.inference_slots] == [0, 1]
    assert [s.gpu_index for s in config.training_slots] == [0]
    assert isinstance(config.slots[0], SupervisorInferenceSlot)
    assert isinstance(config.slots[2], SupervisorTrainingSlot)
    assert config.training_slots[0].checkpoint_dir == "/ckpt"
    assert SupervisorConfig.model_validate_json(config.model_dump_json()) == config


def test_schema_key_allowed(supervisor_doc: dict[str, Any]) -> None:
    supervisor_doc["$schema"] = "./supervisor-config.schema.json"
    assert check(supervisor_doc).schema_uri == "./supervisor-config.schema.json"


@pytest.mark.parametrize(
    "path", [(), ("slots", 0), ("slots", 0, "models", 0), ("slots", 2)], ids=str
)
def test_unknown_keys_rejected(supervisor_doc: dict[str, Any], path: tuple[Any, ...]) -> None:
    node: Any = supervisor_doc
    for key in path:
        node = node[key]
    node["bogus"] = True
    with pytest.raises(ValidationError, match="bogus"):
        check(supervisor_doc)


@pytest.mark.parametrize("kind", ["inference", "training"])
def test_duplicate_slot(supervisor_doc: dict[str, Any], kind: str) -> None:
    twin = (
        {"kind": "inference", "gpuIndex": 0, "models": [{"name": "other", "port": 9999}]}
        if kind == "inference"
        else {"kind": "training", "gpuIndex": 0, "command": ["t2"], "checkpointDir": "/c2"}
    )
    supervisor_doc["slots"].append(twin)
    with pytest.raises(ValidationError, match=f"duplicate {kind} slot on GPU 0"):
        check(supervisor_doc)


def test_duplicate_model_names_across_slots(supervisor_doc: dict[str, Any]) -> None:
    supervisor_doc["slots"][1]["models"].append({"name": "chat-small", "port": 9000})
    with pytest.raises(ValidationError, match="chat-small"):
        check(supervisor_doc)


def test_shared_port_rejected(supervisor_doc: dict[str, Any]) -> None:
    supervisor_doc["slots"][1]["models"][0]["port"] = 8011
    with pytest.raises(ValidationError, match="port"):
        check(supervisor_doc)


@pytest.mark.parametrize("port", [0, -1, 65536, "8000", True, 80.0])
def test_port_range(supervisor_doc: dict[str, Any], port: object) -> None:
    supervisor_doc["slots"][0]["models"][0]["port"] = port
    with pytest.raises(ValidationError):
        check(supervisor_doc)


@pytest.mark.parametrize("port", [1, 65535])
def test_port_bounds_accepted(supervisor_doc: dict[str, Any], port: int) -> None:
    supervisor_doc["slots"][0]["models"][0]["port"] = port
    assert check(supervisor_doc).inference_slots[0].models[0].port == port


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("slots",), []),
        (("slots", 0, "models"), []),
        (("slots", 0, "models", 0, "name"), "Chat"),
        (("slots", 0, "models", 0, "name"), ""),
        (("slots", 2, "command"), []),
        (("slots", 2, "command"), [""]),
        (("slots", 2, "checkpointDir"), " "),
        (("slots", 0, "gpuIndex"), -1),
        (("slots", 0, "kind"), "cpu"),
    ],
)
def test_field_rules(supervisor_doc: dict[str, Any], path: tuple[Any, ...], value: object) -> None:
    node: Any = supervisor_doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ValidationError):
        check(supervisor_doc)
