from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from haru_driver_skypilot import TaskSpec, cluster_name, task_config
from haru_driver_skyserve import ServiceSpec, domain_service, render_service_yaml, service_config
from haru_protocol import Cloud, DomainLayout, Placement

GOLDEN_DIR = Path(__file__).parent / "golden"


def golden_specs() -> dict[str, ServiceSpec]:
    """Representative service specs; each has a committed render in tests/golden/<key>.yaml."""
    return {
        "on-demand-probe-path": ServiceSpec(
            task=TaskSpec(
                name=cluster_name("demo", "alpha"),
                placement=Placement(cloud=Cloud.AWS, region="us-east-1", accelerator="L4"),
                ports=(8000,),
                setup="pip install 'vllm==0.11.0'\n",
                run="vllm serve example-chat-small --port 8000\n",
            ),
            readiness_path="/health",
            replicas=2,
        ),
        "spot-ports-delay": ServiceSpec(
            task=TaskSpec(
                name=cluster_name("demo", "beta"),
                placement=Placement(
                    cloud=Cloud.GCP,
                    region="us-central1",
                    accelerator="A100",
                    accelerator_count=4,
                    use_spot=True,
                ),
                ports=(8000, 8001, 9100),
                envs={"MODEL_NAME": "example-chat-large", "TP": "4"},
                run='vllm serve "$MODEL_NAME" --tensor-parallel-size "$TP" --port 8000',
            ),
            readiness_path="/v1/models",
            initial_delay_seconds=900,
            replicas=1,
            service_port=8000,
        ),
        "no-envs-zero-delay": ServiceSpec(
            task=TaskSpec(
                name=cluster_name("edge", "gamma"),
                placement=Placement(
                    cloud=Cloud.RUNPOD, region="US", accelerator="RTX4090", accelerator_count=1
                ),
                ports=(8080,),
                run="python -m http.server 8080",
            ),
            initial_delay_seconds=0,
            replicas=3,
            service_port=8080,
        ),
        # What the reconciler launches for a skyserve domain (haru_driver_skyserve.domain_service).
        "domain-service": _domain_service(),
    }


def skyserve_domain() -> DomainLayout:
    """A skyserve domain: two models on GPU 0, one on GPU 1, two replicas."""
    return DomainLayout.model_validate(
        {
            "slug": "alpha",
            "provider": "skyserve",
            "placement": {
                "cloud": "aws",
                "region": "us-east-1",
                "accelerator": "EXAMPLE-GPU",
                "acceleratorCount": 2,
            },
            "provisioning": {"vllmVersion": "0.33.0", "replicas": 2, "gatewayPort": 8080},
            "slots": [
                {
                    "kind": "inference",
                    "gpuIndex": 0,
                    "models": [
                        {"name": "example-chat-small", "source": "example-org/chat-small"},
                        {"name": "example-chat-medium"},
                    ],
                },
                {"kind": "inference", "gpuIndex": 1, "models": [{"name": "example-chat-large"}]},
            ],
        }
    )


def _domain_service() -> ServiceSpec:
    domain = skyserve_domain()
    return domain_service(
        cluster_name("demo", domain.slug), domain.placement, domain.slots, domain.settings
    )


GOLDEN = golden_specs()


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_render_matches_committed_golden(key: str) -> None:
    expected = (GOLDEN_DIR / f"{key}.yaml").read_text(encoding="utf-8")
    assert render_service_yaml(GOLDEN[key]) == expected


def test_every_golden_file_has_a_spec() -> None:
    assert {p.stem for p in GOLDEN_DIR.glob("*.yaml")} == set(GOLDEN)


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_render_is_the_task_plus_a_service_block(key: str) -> None:
    spec = GOLDEN[key]
    loaded = yaml.safe_load(render_service_yaml(spec))
    assert loaded == service_config(spec)
    service = loaded.pop("service")
    assert loaded == task_config(spec.task)
    assert service["replicas"] == spec.replicas


def test_probe_is_a_bare_path_without_a_delay() -> None:
    service = service_config(GOLDEN["on-demand-probe-path"])["service"]
    assert service == {"readiness_probe": "/health", "replicas": 2}


def test_probe_is_an_object_with_a_delay_and_ports_is_an_integer() -> None:
    service = service_config(GOLDEN["spot-ports-delay"])["service"]
    assert service == {
        "readiness_probe": {"path": "/v1/models", "initial_delay_seconds": 900},
        "replicas": 1,
        "ports": 8000,
    }
    assert isinstance(service["ports"], int)


def test_a_zero_delay_is_kept() -> None:
    probe = service_config(GOLDEN["no-envs-zero-delay"])["service"]["readiness_probe"]
    assert probe == {"path": "/", "initial_delay_seconds": 0}


def test_service_block_comes_last() -> None:
    assert list(service_config(GOLDEN["spot-ports-delay"]))[-1] == "service"
