"""Operator documents: the fleet layout's field and cross-field rules, and the policy patch."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from haru_protocol import (
    MAX_DURATION_MS,
    FleetLayout,
    InferenceSlotSpec,
    Policy,
    PolicyPatch,
    ProbeSettings,
    Provider,
    SlotKind,
    TrainingSlotSpec,
    is_slug,
    resolve_policy,
)
from pydantic import ValidationError


def check(doc: dict[str, Any]) -> FleetLayout:
    return FleetLayout.model_validate_json(json.dumps(doc))


def rejected(doc: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        check(doc)


# ---- the valid document ----


def test_valid_layout_parses(layout_doc: dict[str, Any]) -> None:
    layout = check(layout_doc)
    assert layout.slug == "fleet-1"
    assert layout.active_domain_slug == "alpha"
    alpha, beta = layout.domains
    assert alpha.provider is Provider.STATIC
    assert beta.provider is Provider.STATIC  # the default
    assert beta.supervisor_url is None
    assert beta.placement.accelerator_count == 1
    assert beta.placement.use_spot is False
    assert isinstance(alpha.slots[0], InferenceSlotSpec)
    assert alpha.slots[0].sleep_level == 1
    assert isinstance(alpha.slots[1], TrainingSlotSpec)
    assert alpha.slots[1].kind is SlotKind.TRAINING
    assert [s.gpu_index for s in alpha.inference_slots] == [0]
    # URLs are kept exactly as written (path prefix and query included).
    assert alpha.serving_base_url == "https://alpha.test/serve?team=a"


def test_layout_round_trip(layout_doc: dict[str, Any]) -> None:
    layout = check(layout_doc)
    assert FleetLayout.model_validate_json(layout.model_dump_json()) == layout


def test_schema_key_accepted(layout_doc: dict[str, Any]) -> None:
    layout_doc["$schema"] = "./fleet-layout.schema.json"
    layout = check(layout_doc)
    assert layout.schema_uri == "./fleet-layout.schema.json"
    assert json.loads(layout.model_dump_json())["$schema"] == "./fleet-layout.schema.json"


# ---- strict keys ----


@pytest.mark.parametrize(
    "path",
    [
        (),
        ("policy",),
        ("policy", "probe"),
        ("domains", 0),
        ("domains", 0, "placement"),
        ("domains", 0, "slots", 0),
        ("domains", 0, "slots", 0, "models", 0),
        ("domains", 0, "slots", 1),
    ],
    ids=lambda p: "/".join(map(str, p)) or "root",
)
def test_unknown_key_rejected_everywhere(layout_doc: dict[str, Any], path: tuple[Any, ...]) -> None:
    node: Any = layout_doc
    for key in path:
        node = node[key]
    node["unexpectedKey"] = 1
    rejected(layout_doc, "unexpectedKey")


def test_snake_case_typo_is_not_silently_ignored(layout_doc: dict[str, Any]) -> None:
    layout_doc["active_domain_slg"] = "alpha"
    rejected(layout_doc, "active_domain_slg")


# ---- cross-field rules ----


def test_active_slug_must_be_listed(layout_doc: dict[str, Any]) -> None:
    layout_doc["activeDomainSlug"] = "gamma"
    rejected(layout_doc, "not a listed domain")


def test_active_domain_needs_an_inference_slot(layout_doc: dict[str, Any]) -> None:
    layout_doc["domains"][1]["slots"] = [
        {"kind": "training", "gpuIndex": 0, "command": ["t"], "checkpointDir": "/c"}
    ]
    check(layout_doc)  # fine while beta is a standby
    layout_doc["activeDomainSlug"] = "beta"
    rejected(layout_doc, "has no inference slot")


def test_no_active_domain_is_fine(layout_doc: dict[str, Any]) -> None:
    del layout_doc["activeDomainSlug"]
    assert check(layout_doc).active_domain_slug is None


def test_duplicate_domain_slugs(layout_doc: dict[str, Any]) -> None:
    layout_doc["domains"][1]["slug"] = "alpha"
    rejected(layout_doc, "duplicate domain slugs")


@pytest.mark.parametrize("kind", ["inference", "training"])
def test_duplicate_gpu_and_kind(layout_doc: dict[str, Any], kind: str) -> None:
    slots = layout_doc["domains"][0]["slots"]
    original = next(s for s in slots if s["kind"] == kind)
    twin = copy.deepcopy(original)
    if kind == "inference":
        twin["models"] = [{"name": "other", "servingUrl": "http://x.test"}]
    slots.append(twin)
    rejected(layout_doc, f"duplicate {kind} slot on GPU 0")


def test_same_gpu_different_kind_is_fine(layout_doc: dict[str, Any]) -> None:
    layout = check(layout_doc)
    assert {(s.gpu_index, s.kind) for s in layout.domains[0].slots} == {
        (0, SlotKind.INFERENCE),
        (0, SlotKind.TRAINING),
    }


def test_duplicate_model_names_across_slots_of_a_domain(layout_doc: dict[str, Any]) -> None:
    layout_doc["domains"][0]["slots"].append(
        {
            "kind": "inference",
            "gpuIndex": 1,
            "models": [{"name": "chat-small", "servingUrl": "http://alpha.test:9000"}],
        }
    )
    rejected(layout_doc, "chat-small")


def test_duplicate_model_names_within_a_slot(layout_doc: dict[str, Any]) -> None:
    models = layout_doc["domains"][0]["slots"][0]["models"]
    models.append({"name": "chat-small", "servingUrl": "http://alpha.test:9000"})
    rejected(layout_doc, "unique")


def test_same_model_name_in_two_domains_is_fine(layout_doc: dict[str, Any]) -> None:
    layout = check(layout_doc)
    assert layout.domains[1].inference_slots[0].models[0].name == "chat-small"


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("domains",), [], "at least 1"),
        (("domains", 0, "slots"), [], "at least 1"),
        (("domains", 0, "slots", 0, "models"), [], "at least 1"),
        (("domains", 0, "slots", 1, "command"), [], "at least 1"),
        (("domains", 0, "slots", 1, "command"), ["ok", " "], "blank"),
        (("domains", 0, "slots", 1, "checkpointDir"), "", "blank"),
        (("domains", 0, "slots", 0, "sleepLevel"), 2, "1"),
        (("domains", 0, "slots", 0, "gpuIndex"), -1, "greater than or equal"),
        (("domains", 0, "slots", 0, "gpuIndex"), "0", "integer"),
        (("domains", 0, "slots", 0, "kind"), "gpu", "kind"),
        (("domains", 0, "placement", "cloud"), "moon", "cloud"),
        (("domains", 0, "placement", "region"), "", "blank"),
        (("domains", 0, "placement", "acceleratorCount"), 0, "greater than or equal"),
        (("domains", 0, "placement", "useSpot"), "yes", "boolean"),
        (("domains", 0, "provider"), "aws", "provider"),
        (("displayName",), "  ", "blank"),
    ],
)
def test_field_rules(
    layout_doc: dict[str, Any], path: tuple[Any, ...], value: object, match: str
) -> None:
    node: Any = layout_doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    rejected(layout_doc, match)


def test_placement_requires_accelerator(layout_doc: dict[str, Any]) -> None:
    del layout_doc["domains"][0]["placement"]["accelerator"]
    rejected(layout_doc, "accelerator")


# ---- slugs ----

VALID_SLUGS = ["a", "0", "a-b", "a1-2b-c3", "x" * 63, "-".join(["ab"] * 21)]
INVALID_SLUGS = ["", "x" * 64, "-a", "a-", "a--b", "A", "aB", "a_b", "a.b", "a b", "é", "a/b"]


@pytest.mark.parametrize("slug", VALID_SLUGS)
def test_valid_slugs(layout_doc: dict[str, Any], slug: str) -> None:
    assert is_slug(slug)
    layout_doc["slug"] = slug
    layout_doc["domains"][1]["slug"] = slug
    assert check(layout_doc).domains[1].slug == slug


@pytest.mark.parametrize("slug", INVALID_SLUGS)
@pytest.mark.parametrize("where", ["fleet", "domain", "active"])
def test_invalid_slugs(layout_doc: dict[str, Any], slug: str, where: str) -> None:
    assert not is_slug(slug)
    if where == "fleet":
        layout_doc["slug"] = slug
    elif where == "domain":
        layout_doc["domains"][1]["slug"] = slug
    else:
        layout_doc["activeDomainSlug"] = slug
    rejected(layout_doc, "invalid slug")


# ---- model names ----


@pytest.mark.parametrize("name", ["Chat", "CHAT-SMALL", "chat-Small"])
def test_uppercase_model_name_rejected(layout_doc: dict[str, Any], name: str) -> None:
    layout_doc["domains"][0]["slots"][0]["models"][0]["name"] = name
    rejected(layout_doc, "lowercase")


def test_empty_model_name_rejected(layout_doc: dict[str, Any]) -> None:
    layout_doc["domains"][0]["slots"][0]["models"][0]["name"] = ""
    rejected(layout_doc, "empty")


@pytest.mark.parametrize("name", ["org/model-7b", "m", "qwen2.5-0.5b-instruct", "モデル"])
def test_lowercase_model_names_accepted(layout_doc: dict[str, Any], name: str) -> None:
    layout_doc["domains"][0]["slots"][0]["models"][0]["name"] = name
    assert check(layout_doc).domains[0].inference_slots[0].models[0].name == name


# ---- URLs ----


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "mailto:ops@example.com",
        "ftp://h.test/",
        "javascript:alert(1)",
        "h.test:8000",
        "/relative",
        "http://",
        "http://h.test:99999",
        "",
    ],
)
@pytest.mark.parametrize("field", ["supervisorUrl", "servingBaseUrl", "servingUrl"])
def test_bad_urls_rejected(layout_doc: dict[str, Any], url: str, field: str) -> None:
    domain = layout_doc["domains"][0]
    if field == "servingUrl":
        domain["slots"][0]["models"][0]["servingUrl"] = url
    else:
        domain[field] = url
    rejected(layout_doc, "URL")


@pytest.mark.parametrize(
    "url",
    [
        "http://h.test",
        "https://h.test:8443/prefix/",
        "http://10.0.0.1:8000/v?x=1",
        "http://[::1]:80",
    ],
)
def test_good_urls_kept_verbatim(layout_doc: dict[str, Any], url: str) -> None:
    layout_doc["domains"][0]["supervisorUrl"] = url
    assert check(layout_doc).domains[0].supervisor_url == url


# ---- durations ----

DURATION_KEYS = [
    "heartbeatStaleMs",
    "degradedGraceMs",
    "deadConfirmMs",
    "trainingStopGraceMs",
    "failoverTrainingStopGraceMs",
    "stopTrainingTimeoutMs",
    "verifyGpuTimeoutMs",
    "wakeTimeoutMs",
    "probeTimeoutMs",
    "switchActiveTimeoutMs",
    "sleepTimeoutMs",
    "startTrainingTimeoutMs",
    "promotionBackoffBaseMs",
    "promotionBackoffMaxMs",
    "launchTimeoutMs",
    "clusterUpTimeoutMs",
    "supervisorReadyTimeoutMs",
    "relaunchBackoffBaseMs",
    "relaunchBackoffMaxMs",
]


def test_duration_keys_are_every_policy_duration() -> None:
    aliases = {f.alias for n, f in Policy.model_fields.items() if n.endswith("_ms")}
    assert aliases == set(DURATION_KEYS)


@pytest.mark.parametrize("key", DURATION_KEYS)
@pytest.mark.parametrize("value", [1, MAX_DURATION_MS])
def test_durations_accepted(layout_doc: dict[str, Any], key: str, value: int) -> None:
    assert MAX_DURATION_MS == 2_147_483_647
    layout_doc["policy"][key] = value
    patch = check(layout_doc).policy
    assert patch is not None
    assert patch.stored()[key] == value
    assert patch.resolve().model_dump()[key] == value


@pytest.mark.parametrize("key", DURATION_KEYS)
@pytest.mark.parametrize("value", [0, -1, 2_147_483_648, "1000", True, False, 1.0, 1.5, None])
def test_durations_rejected(layout_doc: dict[str, Any], key: str, value: object) -> None:
    if value is None:
        # An explicit null means "not written" in a patch, but a resolved policy needs a value.
        with pytest.raises(ValidationError):
            Policy.model_validate({key: None})
        return
    layout_doc["policy"][key] = value
    rejected(layout_doc, key)
    with pytest.raises(ValidationError):
        Policy.model_validate({key: value})


@pytest.mark.parametrize("value", ["true", 1, 0, None])
def test_auto_failover_must_be_boolean(value: object) -> None:
    with pytest.raises(ValidationError):
        Policy.model_validate({"autoFailover": value})


@pytest.mark.parametrize("value", [0, 4097, "4", True])
def test_probe_max_tokens_bounds(value: object) -> None:
    with pytest.raises(ValidationError):
        PolicyPatch.model_validate({"probe": {"maxTokens": value}})


# ---- policy patch ----


def test_stored_keeps_only_written_keys() -> None:
    patch = PolicyPatch.model_validate_json(
        '{"wakeTimeoutMs": 5000, "autoFailover": false, "probe": {"maxTokens": 8}}'
    )
    assert patch.stored() == {
        "wakeTimeoutMs": 5000,
        "autoFailover": False,
        "probe": {"maxTokens": 8},
    }
    assert PolicyPatch().stored() == {}
    assert PolicyPatch.model_validate({"probe": {}}).stored() == {"probe": {}}


def test_stored_round_trips_through_the_patch() -> None:
    patch = PolicyPatch(heartbeat_stale_ms=1_000, probe=None)
    assert PolicyPatch.model_validate(patch.stored()) == patch


def test_resolve_fills_every_unwritten_key_with_the_current_default() -> None:
    patch = PolicyPatch.model_validate({"sleepTimeoutMs": 7, "probe": {"prompt": "hi"}})
    policy = patch.resolve()
    assert policy.sleep_timeout_ms == 7
    assert policy.probe == ProbeSettings(prompt="hi", max_tokens=4)
    defaults = Policy()
    for name in Policy.model_fields:
        if name not in {"sleep_timeout_ms", "probe"}:
            assert (
                getattr(policy, name)
                == getattr(defaults, name)
                == Policy.model_fields[name].default
            )


def test_partial_probe_patch_keeps_other_probe_default() -> None:
    policy = PolicyPatch.model_validate({"probe": {"maxTokens": 16}}).resolve()
    assert policy.probe == ProbeSettings(prompt="ping", max_tokens=16)


def test_resolve_none_and_empty() -> None:
    assert resolve_policy(None) == Policy()
    assert resolve_policy(PolicyPatch()) == Policy()
    assert PolicyPatch().resolve() == Policy()


def test_policy_defaults_match_spec() -> None:
    assert Policy().model_dump() == {
        "autoFailover": False,
        "heartbeatStaleMs": 30_000,
        "degradedGraceMs": 60_000,
        "deadConfirmMs": 1_000,
        "trainingStopGraceMs": 30_000,
        "failoverTrainingStopGraceMs": 5_000,
        "stopTrainingTimeoutMs": 90_000,
        "verifyGpuTimeoutMs": 30_000,
        "wakeTimeoutMs": 120_000,
        "probeTimeoutMs": 60_000,
        "switchActiveTimeoutMs": 10_000,
        "sleepTimeoutMs": 60_000,
        "startTrainingTimeoutMs": 30_000,
        "promotionBackoffBaseMs": 30_000,
        "promotionBackoffMaxMs": 900_000,
        "launchTimeoutMs": 1_800_000,
        "clusterUpTimeoutMs": 1_800_000,
        "supervisorReadyTimeoutMs": 1_800_000,
        "relaunchMaxAttempts": 3,
        "relaunchBackoffBaseMs": 60_000,
        "relaunchBackoffMaxMs": 900_000,
        "probe": {"prompt": "ping", "maxTokens": 4},
    }


def test_policy_patch_rejects_unknown_keys() -> None:
    with pytest.raises(ValidationError, match="heartbeatStale"):
        PolicyPatch.model_validate({"heartbeatStale": 5})
    with pytest.raises(ValidationError, match="tokens"):
        PolicyPatch.model_validate({"probe": {"tokens": 5}})
