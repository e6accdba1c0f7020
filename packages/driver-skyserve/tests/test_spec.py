from __future__ import annotations

import pytest
from haru_driver_skypilot import InvalidSpecError, TaskSpec
from haru_driver_skyserve import ServiceSpec
from haru_protocol import Placement


def task(*ports: int) -> TaskSpec:
    return TaskSpec(
        name="haru-demo-alpha",
        placement=Placement.model_validate(
            {"cloud": "aws", "region": "us-east-1", "accelerator": "L4"}
        ),
        ports=ports,
        run="vllm serve m",
    )


def test_defaults_with_one_port() -> None:
    spec = ServiceSpec(task=task(8000))
    assert spec.name == "haru-demo-alpha"
    assert spec.readiness_path == "/"
    assert spec.initial_delay_seconds is None
    assert spec.replicas == 1
    assert spec.service_port is None


def test_several_ports_need_a_service_port_among_them() -> None:
    with pytest.raises(InvalidSpecError, match="needs service_port"):
        ServiceSpec(task=task(8000, 8001))
    with pytest.raises(InvalidSpecError, match="one of the task's ports"):
        ServiceSpec(task=task(8000, 8001), service_port=9000)
    assert ServiceSpec(task=task(8000, 8001), service_port=8001).service_port == 8001


def test_a_task_without_ports_cannot_be_served() -> None:
    with pytest.raises(InvalidSpecError, match="needs service_port"):
        ServiceSpec(task=task())
    with pytest.raises(InvalidSpecError, match="one of the task's ports"):
        ServiceSpec(task=task(), service_port=8000)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"readiness_path": "health"}, "readiness path"),
        ({"readiness_path": "/a b"}, "readiness path"),
        ({"readiness_path": ""}, "readiness path"),
        ({"initial_delay_seconds": -1}, "initial_delay_seconds"),
        ({"initial_delay_seconds": True}, "initial_delay_seconds"),
        ({"initial_delay_seconds": 1.5}, "initial_delay_seconds"),
        ({"replicas": 0}, "replicas"),
        ({"replicas": "2"}, "replicas"),
        ({"service_port": True}, "service_port"),
    ],
)
def test_bad_service_settings_are_rejected(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        ServiceSpec(task=task(1), **overrides)  # type: ignore[arg-type]


def test_probe_path_may_carry_a_query() -> None:
    assert ServiceSpec(task=task(8000), readiness_path="/v1/models?x=1").readiness_path
