"""Layout rules of provisioned (``skypilot``/``skyserve``) domains."""

from __future__ import annotations

import json
from typing import Any

import pytest
from haru_protocol import FleetLayout, InferenceSlotSpec, Policy, Provider, Provisioning
from pydantic import ValidationError


def sky_doc() -> dict[str, Any]:
    placement = {"cloud": "gcp", "region": "us-central1", "accelerator": "EXAMPLE-GPU"}
    return {
        "slug": "sky-fleet",
        "activeDomainSlug": "alpha",
        "domains": [
            {
                "slug": slug,
                "provider": "skypilot",
                "placement": placement,
                "slots": [
                    {
                        "kind": "inference",
                        "gpuIndex": 0,
                        "models": [
                            {"name": "example-chat-small", "source": "org/small"},
                            {"name": "example-chat-medium"},
                        ],
                    },
                    {
                        "kind": "training",
                        "gpuIndex": 0,
                        "command": ["python", "train.py"],
                        "checkpointDir": "/ckpt",
                    },
                ],
            }
            for slug in ("alpha", "beta")
        ],
    }


def check(doc: dict[str, Any]) -> FleetLayout:
    return FleetLayout.model_validate_json(json.dumps(doc))


def rejected(doc: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        check(doc)


def test_provisioned_layout_defaults() -> None:
    layout = check(sky_doc())
    alpha = layout.domains[0]
    assert alpha.provider is Provider.SKYPILOT
    assert alpha.provisioning is None
    settings = alpha.settings
    assert settings == Provisioning()
    assert settings.vllm_version == "0.33.0"
    assert (settings.supervisor_port, settings.gateway_port, settings.vllm_base_port) == (
        8701,
        8000,
        8100,
    )
    assert settings.relaunch is True
    slot = alpha.slots[0]
    assert isinstance(slot, InferenceSlotSpec)
    # Two models on one GPU split vLLM's usual 0.9 evenly.
    assert slot.memory_shares() == {"example-chat-small": 0.45, "example-chat-medium": 0.45}
    assert slot.models[0].source == "org/small"
    assert slot.models[1].serving_url is None


def test_policy_defaults_of_the_provisioning_budgets() -> None:
    policy = Policy()
    assert policy.launch_timeout_ms == 1_800_000
    assert policy.cluster_up_timeout_ms == 1_800_000
    assert policy.supervisor_ready_timeout_ms == 1_800_000
    assert policy.relaunch_max_attempts == 3
    assert policy.relaunch_backoff_base_ms == 60_000


def test_explicit_memory_shares_and_args() -> None:
    doc = sky_doc()
    models = doc["domains"][0]["slots"][0]["models"]
    models[0]["gpuMemoryUtilization"] = 0.6
    models[1]["gpuMemoryUtilization"] = 0.3
    models[1]["extraVllmArgs"] = ["--max-model-len", "4096"]
    doc["domains"][0]["provisioning"] = {"vllmVersion": "0.11.0", "relaunch": False}
    alpha = check(doc).domains[0]
    slot = alpha.slots[0]
    assert isinstance(slot, InferenceSlotSpec)
    assert slot.memory_shares() == {"example-chat-small": 0.6, "example-chat-medium": 0.3}
    assert slot.models[1].extra_vllm_args == ("--max-model-len", "4096")
    assert alpha.settings.vllm_version == "0.11.0"
    assert alpha.settings.relaunch is False


def test_memory_shares_over_budget_or_partial_are_rejected() -> None:
    doc = sky_doc()
    models = doc["domains"][0]["slots"][0]["models"]
    models[0]["gpuMemoryUtilization"] = 0.6
    rejected(doc, "for every model of the slot or for none")
    models[1]["gpuMemoryUtilization"] = 0.5
    rejected(doc, "adds up to 1.1")


@pytest.mark.parametrize("version", ["latest", "0.33.0; rm -rf /", "", "v1"])
def test_bad_vllm_versions(version: str) -> None:
    doc = sky_doc()
    doc["domains"][0]["provisioning"] = {"vllmVersion": version}
    rejected(doc, "vllmVersion")


def test_extra_args_reject_control_characters() -> None:
    doc = sky_doc()
    doc["domains"][0]["slots"][0]["models"][0]["extraVllmArgs"] = ["--x\n"]
    rejected(doc, "control characters")


@pytest.mark.parametrize(
    ("key", "value"),
    [("supervisorUrl", "http://a.test"), ("servingBaseUrl", "http://a.test")],
)
def test_provisioned_domains_refuse_hand_typed_urls(key: str, value: str) -> None:
    doc = sky_doc()
    doc["domains"][0][key] = value
    rejected(doc, f"Haru records its URLs once the machine is up; remove {key}")


def test_provisioned_domains_refuse_serving_urls() -> None:
    doc = sky_doc()
    doc["domains"][0]["slots"][0]["models"][0]["servingUrl"] = "http://a.test"
    rejected(doc, "servingUrl of 'example-chat-small'")


def test_static_domains_need_serving_urls_and_no_provisioning_keys() -> None:
    doc = sky_doc()
    doc["domains"][0]["provider"] = "static"
    rejected(doc, "needs a servingUrl")
    for model in doc["domains"][0]["slots"][0]["models"]:
        model["servingUrl"] = "http://a.test"
    rejected(doc, r"sets \['source'\], which only provisioned domains use")
    del doc["domains"][0]["slots"][0]["models"][0]["source"]
    check(doc)
    doc["domains"][0]["provisioning"] = {}
    rejected(doc, "`provisioning` needs a provisioned provider")


def test_port_clashes_are_rejected() -> None:
    doc = sky_doc()
    doc["domains"][0]["provisioning"] = {"gatewayPort": 8701}
    rejected(doc, "must differ")
    doc["domains"][0]["provisioning"] = {"vllmBasePort": 8700}  # 8700, 8701 clash
    rejected(doc, "must differ")
    doc["domains"][0]["provisioning"] = {"vllmBasePort": 65535}
    rejected(doc, "leaves no room")


def test_skyserve_refuses_training_slots() -> None:
    doc = sky_doc()
    doc["domains"][0]["provider"] = "skyserve"
    rejected(doc, "a SkyServe service cannot train")
    doc["domains"][0]["slots"] = doc["domains"][0]["slots"][:1]
    doc["domains"][0]["provisioning"] = {"replicas": 2}
    assert check(doc).domains[0].settings.replicas == 2


def skyserve_doc() -> dict[str, Any]:
    """alpha: a skyserve active (inference only); beta: a skypilot standby that trains."""
    doc = sky_doc()
    doc["domains"][0]["provider"] = "skyserve"
    doc["domains"][0]["slots"] = doc["domains"][0]["slots"][:1]
    return doc


def test_skyserve_domain_can_only_be_the_active() -> None:
    assert check(skyserve_doc()).domains[0].provider is Provider.SKYSERVE
    doc = skyserve_doc()
    doc["activeDomainSlug"] = "beta"
    rejected(doc, r"skyserve domain\(s\) \['alpha'\] would be standbys")
    doc = skyserve_doc()
    del doc["activeDomainSlug"]
    rejected(doc, "can only be the activeDomainSlug")
    doc = skyserve_doc()
    doc["domains"][1]["provider"] = "skyserve"
    doc["domains"][1]["slots"] = doc["domains"][1]["slots"][:1]
    rejected(doc, r"\['beta'\] would be standbys")


def test_skyserve_refuses_gpus_a_replica_does_not_have() -> None:
    doc = skyserve_doc()
    doc["domains"][0]["slots"][0]["gpuIndex"] = 1
    rejected(doc, r"gpuIndex \[1\] does not exist on a replica with acceleratorCount 1")
    doc["domains"][0]["placement"]["acceleratorCount"] = 2
    assert check(doc).domains[0].slots[0].gpu_index == 1


def test_skyserve_refuses_supervisor_settings() -> None:
    doc = skyserve_doc()
    doc["domains"][0]["provisioning"] = {"supervisorPort": 8701}
    rejected(doc, "supervisorPort asks for a Haru supervisor, and SkyServe replicas run none")
    # The package carries the serving gateway too, so a replica installs it.
    doc["domains"][0]["provisioning"] = {"supervisorPackage": "haru-supervisor==0.2.0"}
    assert check(doc).domains[0].settings.supervisor_package == "haru-supervisor==0.2.0"
    # The other provisioning keys are the service's.
    doc["domains"][0]["provisioning"] = {"gatewayPort": 9000, "replicas": 3}
    assert check(doc).domains[0].settings.gateway_port == 9000


def test_replicas_only_on_skyserve() -> None:
    doc = sky_doc()
    doc["domains"][0]["provisioning"] = {"replicas": 2}
    rejected(doc, "skyserve domains only")


def test_serving_credentials_by_reference_on_static_domains_only() -> None:
    doc = sky_doc()
    doc["domains"][0]["slots"][0]["models"][0]["apiKeyEnv"] = "VLLM_KEY"
    rejected(doc, r"apiKeyEnv/apiKeyFile of .* apply to static domains only")
    static: dict[str, Any] = {
        "slug": "static-fleet",
        "domains": [
            {
                "slug": "alpha",
                "placement": {"cloud": "gcp", "region": "us-central1", "accelerator": "L4"},
                "slots": [
                    {
                        "kind": "inference",
                        "gpuIndex": 0,
                        "models": [
                            {
                                "name": "m",
                                "servingUrl": "https://gpu.example:8000",
                                "apiKeyFile": "/run/secrets/m",
                            }
                        ],
                    }
                ],
            }
        ],
    }
    model = check(static).domains[0].inference_slots[0].models[0]
    assert model.api_key_file == "/run/secrets/m"
    assert model.model_dump(mode="json", by_alias=True)["apiKeyFile"] == "/run/secrets/m"
    assert "apiKeyEnv" not in model.model_dump(mode="json", by_alias=True)
    static["domains"][0]["slots"][0]["models"][0]["apiKeyEnv"] = "VLLM_KEY"
    rejected(static, "sets both apiKeyEnv and apiKeyFile")
