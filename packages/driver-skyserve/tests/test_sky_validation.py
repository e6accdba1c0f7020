"""Validation of the service renders and the status parser by SkyPilot itself (extra ``sky``).

Run by .ci/sky-lane.sh in a separate environment with skypilot==0.14.1; skipped elsewhere.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import time
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from haru_driver_skypilot import SkyPilotSdk
from haru_driver_skyserve import ServiceStatus, parse_service_status, service_info_from_record

pytestmark = pytest.mark.sky

GOLDEN_FILES = sorted((Path(__file__).parent / "golden").glob("*.yaml"))


def load(path: Path) -> dict[str, Any]:
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(config, dict)
    return config


def validate_service(sky: types.ModuleType, config: dict[str, Any]) -> Any:
    schemas = importlib.import_module("sky.utils.schemas")
    common_utils = importlib.import_module("sky.utils.common_utils")
    common_utils.validate_schema(config, schemas.get_task_schema(), "Invalid task YAML: ")
    common_utils.validate_schema(
        config["resources"], schemas.get_resources_schema(), "Invalid resources YAML: "
    )
    common_utils.validate_schema(
        config["service"], schemas.get_service_schema(), "Invalid service YAML: "
    )
    task = sky.Task.from_yaml_config(copy.deepcopy(config))  # it consumes its input
    # What `sky serve up` runs before submitting (port rules); it lives in
    # sky/serve/serve_utils.py and is re-exported as sky.serve.validate_service_task.
    sky.serve.validate_service_task(task, pool=False)
    return task


def test_validate_service_task_is_where_we_call_it(sky: types.ModuleType) -> None:
    serve_utils = importlib.import_module("sky.serve.serve_utils")
    assert sky.serve.validate_service_task is serve_utils.validate_service_task


def test_golden_files_exist() -> None:
    assert len(GOLDEN_FILES) >= 3


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
def test_golden_render_is_a_valid_skyserve_service(sky: types.ModuleType, path: Path) -> None:
    config = load(path)
    task = validate_service(sky, config)
    service = config["service"]
    probe = service["readiness_probe"]
    path_expected = probe if isinstance(probe, str) else probe["path"]
    assert task.name == config["name"]
    assert task.service.readiness_path == path_expected
    if isinstance(probe, dict):
        assert task.service.initial_delay_seconds == probe["initial_delay_seconds"]
    assert task.service.min_replicas == service["replicas"]
    assert task.service.max_replicas is None
    if "ports" in service:
        assert task.service.ports == str(service["ports"])
    else:  # SkyServe takes the single resources port as the replica ingress port
        assert task.service.ports is None
        assert len(config["resources"]["ports"]) == 1
    (resources,) = list(task.resources)
    assert resources.use_spot is config["resources"]["use_spot"]


@pytest.mark.parametrize(
    ("section", "good", "bad"),
    [
        ("service", "readiness_probe", "readiness_prob"),
        ("resources", "accelerators", "acelerators"),
    ],
)
def test_a_misspelled_key_is_rejected(
    sky: types.ModuleType, section: str, good: str, bad: str
) -> None:
    config = load(GOLDEN_FILES[0])
    config[section][bad] = config[section].pop(good)
    exceptions = importlib.import_module("sky.exceptions")
    with pytest.raises(exceptions.InvalidSkyPilotConfigError, match=f"did you mean '{good}'"):
        validate_service(sky, config)


def test_several_ports_without_service_ports_would_be_rejected(sky: types.ModuleType) -> None:
    # Why ServiceSpec requires service_port when the task opens several ports.
    config = next(load(p) for p in GOLDEN_FILES if len(load(p)["resources"]["ports"]) > 1)
    del config["service"]["ports"]
    with pytest.raises(ValueError, match=r"service\.ports"):
        validate_service(sky, config)


def test_every_skyserve_status_is_known(sky: types.ModuleType) -> None:
    assert {s.value for s in sky.serve.ServiceStatus} == {s.value for s in ServiceStatus}


def sdk_record(sky: types.ModuleType, name: str, status: Any, now: float) -> dict[str, Any]:
    replica = sky.serve.ReplicaStatus
    return {
        "name": name,
        "active_versions": [1, 2],
        "controller_job_id": 1,
        "uptime": now - 3723,
        "status": status,
        "controller_port": 20001,
        "load_balancer_port": 30001,
        "endpoint": "34.1.2.3:30001",
        "policy": "Fixed 3 replicas",
        "requested_resources_str": "1x AWS(L4:1)",
        "load_balancing_policy": "least_load",
        "tls_encrypted": False,
        "replica_info": [
            {
                "replica_id": i,
                "name": f"{name}-{i}",
                "status": s,
                "version": 2,
                "launched_at": now - 100,
                "handle": None,
                "cloud": "AWS",
                "region": "us-east-1",
                "infra": "AWS (us-east-1)",
                "resources_str": "1x(gpus=L4:1)",
                "resources_str_full": "",
                "endpoint": None,
            }
            for i, s in enumerate([replica.READY, replica.STARTING, replica.FAILED_PROBING], 1)
        ],
    }


@pytest.mark.parametrize("status", list(ServiceStatus))
def test_the_table_skyserve_prints_parses(sky: types.ModuleType, status: ServiceStatus) -> None:
    serve_utils = importlib.import_module("sky.serve.serve_utils")
    now = time.time()
    records = [
        sdk_record(sky, "haru-demo-alpha", sky.serve.ServiceStatus(status.value), now),
        sdk_record(sky, "other", sky.serve.ServiceStatus.READY, now),
    ]
    # Exactly what `sky serve status NAME` prints (command.py: title, then the table).
    stdout = "\x1b[36m\x1b[1mServices\x1b[0m\n" + serve_utils.format_service_table(
        copy.deepcopy(records), False, False
    )
    info = parse_service_status(stdout + "\n", "haru-demo-alpha")
    assert info is not None
    assert info.status is status
    assert info.versions == (1, 2)
    assert (info.ready_replicas, info.total_replicas) == (1, 2)
    assert info.endpoint == "34.1.2.3:30001"
    # The SDK path maps the same record to the same answer.
    assert service_info_from_record(records[0]) == info


def test_empty_table_message_is_absent(sky: types.ModuleType) -> None:
    serve_utils = importlib.import_module("sky.serve.serve_utils")
    stdout = serve_utils.format_service_table([], False, False) + "\n\nService 'x' not found.\n"
    assert parse_service_status(stdout, "haru-demo-alpha") is None


async def test_sdk_facade_calls_the_real_serve_status(
    sky: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    inspect.signature(sky.serve.status).bind(service_names=["haru-demo-alpha"])
    seen: list[object] = []
    record = sdk_record(sky, "haru-demo-alpha", sky.serve.ServiceStatus.READY, time.time())

    def fake_status(**kwargs: Any) -> str:
        seen.append(kwargs)
        return "request-id"

    def fake_get(request_id: str) -> list[Any]:
        assert request_id == "request-id"
        return [record]

    monkeypatch.setattr(sky.serve, "status", fake_status)
    monkeypatch.setattr(sky, "get", fake_get)
    records = await SkyPilotSdk().service_records(["haru-demo-alpha"], timeout=30)
    assert seen == [{"service_names": ["haru-demo-alpha"]}]
    info = service_info_from_record(records[0])
    assert info.status is ServiceStatus.READY
    assert (info.ready_replicas, info.total_replicas) == (1, 2)
