"""Validation of the renders and parsers by SkyPilot itself (the optional ``sky`` extra).

Run by .ci/sky-lane.sh in a separate environment with skypilot==0.14.1; skipped elsewhere.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from haru_driver_skypilot import (
    ClusterStatus,
    SkyPilotSdk,
    cluster_info_from_record,
    cluster_name,
    find_cluster,
    parse_status_json,
)

pytestmark = pytest.mark.sky

GOLDEN_FILES = sorted((Path(__file__).parent / "golden").glob("*.yaml"))


def load(path: Path) -> dict[str, Any]:
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(config, dict)
    return config


def validate_task(sky: types.ModuleType, config: dict[str, Any]) -> Any:
    schemas = importlib.import_module("sky.utils.schemas")
    common_utils = importlib.import_module("sky.utils.common_utils")
    common_utils.validate_schema(config, schemas.get_task_schema(), "Invalid task YAML: ")
    common_utils.validate_schema(
        config["resources"], schemas.get_resources_schema(), "Invalid resources YAML: "
    )
    # from_yaml_config consumes its input: give it a copy.
    return sky.Task.from_yaml_config(copy.deepcopy(config))


def test_the_skypilot_under_test_is_the_pinned_one(sky: types.ModuleType) -> None:
    assert sky.__version__ == "0.14.1"


def test_golden_files_exist() -> None:
    assert len(GOLDEN_FILES) >= 3


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
def test_golden_render_is_a_valid_skypilot_task(sky: types.ModuleType, path: Path) -> None:
    config = load(path)
    task = validate_task(sky, config)
    (resources,) = list(task.resources)
    accelerator, count = config["resources"]["accelerators"].split(":")
    assert task.name == config["name"]
    assert resources.infra.to_str() == config["resources"]["infra"]
    assert resources.accelerators == {accelerator: int(count)}
    assert resources.use_spot is config["resources"]["use_spot"]
    # SkyPilot normalises ports into ranges ("8000-8001"); compare the opened set.
    resources_utils = importlib.import_module("sky.utils.resources_utils")
    opened = resources_utils.port_ranges_to_set(resources.ports or [])
    assert opened == set(config["resources"].get("ports", []))
    assert dict(task.envs) == config.get("envs", {})
    assert task.run == config["run"]
    assert task.setup == config.get("setup")
    importlib.import_module("sky.utils.common_utils").check_cluster_name_is_valid(config["name"])


@pytest.mark.parametrize(
    ("section", "good", "bad"),
    [("resources", "accelerators", "acelerators"), (None, "setup", "stup"), (None, "run", "rnu")],
)
def test_a_misspelled_key_is_rejected(
    sky: types.ModuleType, section: str | None, good: str, bad: str
) -> None:
    config = load(GOLDEN_FILES[0])
    target = config[section] if section else config
    target[bad] = target.pop(good, "echo")
    exceptions = importlib.import_module("sky.exceptions")
    with pytest.raises(exceptions.InvalidSkyPilotConfigError, match=f"did you mean '{good}'"):
        validate_task(sky, config)


def test_numeric_env_values_would_be_rejected_by_the_schema(sky: types.ModuleType) -> None:
    # Why render_task_yaml writes env values as strings.
    config = load(GOLDEN_FILES[0])
    config["envs"] = {"PORT": 8000}
    exceptions = importlib.import_module("sky.exceptions")
    with pytest.raises(exceptions.InvalidSkyPilotConfigError, match="string"):
        validate_task(sky, config)


def test_infra_plus_cloud_would_be_rejected(sky: types.ModuleType) -> None:
    # Why render_task_yaml writes only `infra`.
    config = load(GOLDEN_FILES[0])
    config["resources"]["cloud"] = "aws"
    with pytest.raises(ValueError, match="Cannot specify both"):
        sky.Task.from_yaml_config(copy.deepcopy(config))


@pytest.mark.parametrize(
    ("fleet", "domain"),
    [
        ("a", "b"),
        ("f" * 63, "d" * 63),
        ("x" * 47 + "-y", "z" * 20),
        ("0fleet", "9domain"),
        ("prod-eu", "alpha"),  # haru-prod-eu--alpha: the `--` separator
    ],
)
def test_derived_names_pass_skypilots_name_check(
    sky: types.ModuleType, fleet: str, domain: str
) -> None:
    common_utils = importlib.import_module("sky.utils.common_utils")
    common_utils.check_cluster_name_is_valid(cluster_name(fleet, domain))


def status_response(**overrides: Any) -> Any:
    responses = importlib.import_module("sky.schemas.api.responses")
    status_lib = importlib.import_module("sky.utils.status_lib")
    fields: dict[str, Any] = {
        "name": "haru-demo-alpha",
        "launched_at": 1764460800,
        "status": status_lib.ClusterStatus.UP,
        "autostop": 30,
        "to_down": True,
        "cluster_hash": "0c5e",
        "cluster_ever_up": True,
        "user_hash": "abcd1234",
        "user_name": "haru",
        "workspace": "default",
        "is_managed": False,
        "nodes": 1,
        "cloud": "AWS",
        "region": "us-east-1",
        "resources_str": "1x AWS(g5.xlarge, {'A10G': 1})",
    }
    fields.update(overrides)
    return responses.StatusResponse(**fields)


@pytest.mark.parametrize("status", list(ClusterStatus))
def test_json_printed_the_way_the_cli_prints_it_parses(
    sky: types.ModuleType, status: ClusterStatus
) -> None:
    status_lib = importlib.import_module("sky.utils.status_lib")
    record = status_response(status=status_lib.ClusterStatus(status.value))
    # sky/client/cli/command.py, `sky status -o json`, after a human preamble line.
    stdout = (
        "Cluster(s) not found: \x1b[1mother\x1b[0m.\n"
        + json.dumps([record.model_dump(mode="json", exclude={"handle", "credentials"})], indent=2)
        + "\n"
    )
    info = find_cluster(parse_status_json(stdout), "haru-demo-alpha")
    assert info is not None
    assert info.status is status
    assert info.autostop_minutes == 30
    assert info.to_down is True
    assert info.cloud == "AWS"
    assert info.launched_at is not None
    assert int(info.launched_at.timestamp()) == 1764460800


def test_every_skypilot_cluster_status_is_known(sky: types.ModuleType) -> None:
    status_lib = importlib.import_module("sky.utils.status_lib")
    assert {s.value for s in status_lib.ClusterStatus} == {s.value for s in ClusterStatus}


async def test_sdk_facade_calls_the_real_sdk_functions(
    sky: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SDK needs an API server; stand in for the network round trip only, and check the
    # call against the real signature so a renamed parameter fails here.
    common = importlib.import_module("sky.utils.common")
    force = common.StatusRefreshMode.FORCE
    inspect.signature(sky.status).bind(
        cluster_names=["haru-demo-alpha"], all_users=True, refresh=force
    )
    inspect.signature(sky.get).bind("request-id")
    inspect.signature(sky.api_cancel).bind("request-id", silent=True)
    seen: list[object] = []

    def fake_status(**kwargs: Any) -> str:
        seen.append(kwargs)
        return "request-id"

    def fake_get(request_id: str) -> list[Any]:
        assert request_id == "request-id"
        return [status_response()]

    monkeypatch.setattr(sky, "status", fake_status)
    monkeypatch.setattr(sky, "get", fake_get)
    records = await SkyPilotSdk().cluster_records(["haru-demo-alpha"], timeout=30)
    await SkyPilotSdk().cluster_records(["haru-demo-alpha"], timeout=30, refresh=True)
    assert seen == [
        {"cluster_names": ["haru-demo-alpha"], "all_users": True},
        {"cluster_names": ["haru-demo-alpha"], "all_users": True, "refresh": force},
    ]
    assert "handle" not in records[0]
    info = cluster_info_from_record(records[0])
    assert info.status is ClusterStatus.UP
    assert info.resources == "1x AWS(g5.xlarge, {'A10G': 1})"
