"""A skyserve domain's service: its structure and the endpoint URL.

The gateway itself is tested as a process in haru-supervisor's tests/test_gateway.py.
"""

from __future__ import annotations

import pytest
import yaml
from haru_driver_skypilot import SERVING_TOKEN_SECRET, InvalidSpecError, cluster_name
from haru_driver_skyserve import READINESS_PATH, domain_service, endpoint_url, service_config
from haru_protocol import DomainLayout


def domain(**provisioning: object) -> DomainLayout:
    return DomainLayout.model_validate(
        {
            "slug": "alpha",
            "provider": "skyserve",
            "placement": {"cloud": "aws", "region": "us-east-1", "accelerator": "L4"},
            "provisioning": provisioning,
            "slots": [
                {
                    "kind": "inference",
                    "gpuIndex": 0,
                    "models": [{"name": "chat-a"}, {"name": "chat-b", "source": "org/b"}],
                }
            ],
        }
    )


def test_the_service_is_the_domain_less_the_supervisor() -> None:
    layout = domain(replicas=3, gatewayPort=9000, readinessInitialDelayS=5400)
    spec = domain_service(
        cluster_name("demo", "alpha"), layout.placement, layout.slots, layout.settings
    )
    config = service_config(spec)
    assert config["name"] == "haru-demo--alpha"
    # SkyServe's default delay (1,200 s) can be shorter than a vLLM install plus a model load.
    probe = {"path": READINESS_PATH, "initial_delay_seconds": 5400}
    assert config["service"] == {"readiness_probe": probe, "replicas": 3, "ports": 9000}
    assert config["resources"]["ports"] == [9000]
    # No supervisor: nothing configures or starts it, and no supervisor token is asked for;
    # the gateway (in the haru-supervisor package) needs the serving credential.
    assert config["secrets"] == {SERVING_TOKEN_SECRET: None}
    assert "vllm==0.33.0 haru-supervisor" in config["setup"]
    run = config["run"]
    assert "supervisor.json" not in run
    assert "HARU_SUPERVISOR" not in run
    assert "sleep-when-ready" not in run
    assert run.count('CUDA_VISIBLE_DEVICES=0 nohup "$VLLM" serve') == 2
    assert "serve org/b --served-model-name chat-b --host 127.0.0.1 --port 8101" in run
    # The gateway is the replica's foreground process (its exit ends the replica).
    assert run.splitlines()[-1] == (
        'exec "$GATEWAY" --listen 9000 --token-env HARU_SERVING_TOKEN '
        "--route chat-a=8100 --route chat-b=8101"
    )
    assert yaml.safe_load(yaml.safe_dump(config)) == config


@pytest.mark.parametrize(
    ("shown", "url"),
    [
        ("34.1.2.3:30001", "http://34.1.2.3:30001"),
        ("http://34.1.2.3:30001/", "http://34.1.2.3:30001"),
        ("https://svc.example.org", "https://svc.example.org"),
        ("[2001:db8::1]:30001", "http://[2001:db8::1]:30001"),
    ],
)
def test_endpoint_url(shown: str, url: str) -> None:
    assert endpoint_url(shown) == url


@pytest.mark.parametrize("shown", ["", "-x y:1", "ftp://h:1", "h:99999", "h:port"])
def test_endpoint_url_refuses_what_is_no_endpoint(shown: str) -> None:
    with pytest.raises(InvalidSpecError, match="is not HOST:PORT"):
        endpoint_url(shown)
