from __future__ import annotations

import enum
import json
from datetime import UTC, datetime

import pytest
from haru_driver_skypilot import (
    ClusterStatus,
    SkyOutputError,
    UnknownStatusError,
    cluster_info_from_record,
    find_cluster,
    parse_status_json,
)

# Captured from SkyPilot 0.14.1 (REFERENCE-FACTS SkyPilot section 3): stdout of
# `sky status -o json nonexistent`, exit 0, empty stderr.
NOT_FOUND_STDOUT = "Cluster(s) not found: \x1b[1mnonexistent\x1b[0m.\n[]\n"

# One record as `sky status -o json` prints it (StatusResponse.model_dump(mode="json"),
# json.dumps(indent=2)), summary mode.
RECORD = {
    "name": "haru-demo-alpha",
    "launched_at": 1764460800,
    "last_use": "sky launch -c haru-demo-alpha -y -d /tmp/x/haru-demo-alpha.yaml",
    "status": "UP",
    "autostop": -1,
    "to_down": False,
    "owner": ["AIDA..."],
    "metadata": {},
    "cluster_hash": "0c5e",
    "cluster_ever_up": True,
    "status_updated_at": 1764460900,
    "user_hash": "abcd1234",
    "user_name": "haru",
    "config_hash": None,
    "workspace": "default",
    "last_creation_yaml": None,
    "last_creation_command": None,
    "is_managed": False,
    "last_event": None,
    "init_kind": None,
    "init_status_reason": None,
    "resources_str": "1x AWS(g5.xlarge, {'A10G': 1}, ports=['8000'])",
    "resources_str_full": None,
    "nodes": 1,
    "cloud": "AWS",
    "region": "us-east-1",
    "cpus": None,
    "memory": None,
    "accelerators": "{'A10G': 1}",
    "labels": None,
    "cluster_name_on_cloud": "haru-demo-alpha-2ea4",
    "node_names": None,
    "priority": None,
    "priority_class": None,
    "links": None,
}


def test_unknown_cluster_output_is_an_empty_list() -> None:
    assert parse_status_json(NOT_FOUND_STDOUT) == []
    assert find_cluster(parse_status_json(NOT_FOUND_STDOUT), "nonexistent") is None


def test_pretty_json_after_human_lines_is_found() -> None:
    stdout = (
        "\x1b[2mFailed to connect to SkyPilot API server at http://127.0.0.1:46580. "
        "Starting a local server.\x1b[0m\n"
        "[notice] API server started.\n" + json.dumps([RECORD], indent=2) + "\n"
    )
    records = parse_status_json(stdout)
    assert records == [RECORD]


def test_compact_json_and_ansi_prefix_on_the_list_line() -> None:
    stdout = "\x1b[0m" + json.dumps([RECORD]) + "\n"
    assert parse_status_json(stdout) == [RECORD]


def test_trailing_text_after_the_list_is_ignored() -> None:
    stdout = json.dumps([RECORD], indent=2) + "\n[hint] run sky status -r to refresh\n"
    assert parse_status_json(stdout) == [RECORD]


@pytest.mark.parametrize(
    "stdout", ["", "Cluster(s) not found: x.\n", "[1, 2]\n", "{}\n", "[\n  {broken\n"]
)
def test_no_json_list_of_objects_is_an_output_error(stdout: str) -> None:
    with pytest.raises(SkyOutputError) as info:
        parse_status_json(stdout, argv=("sky", "status", "x", "-o", "json"))
    assert info.value.argv == ("sky", "status", "x", "-o", "json")


def test_record_maps_to_cluster_info() -> None:
    info = cluster_info_from_record(RECORD)
    assert info.name == "haru-demo-alpha"
    assert info.status is ClusterStatus.UP
    assert info.launched_at == datetime(2025, 11, 30, tzinfo=UTC)
    assert info.cloud == "AWS"
    assert info.region == "us-east-1"
    assert info.resources == "1x AWS(g5.xlarge, {'A10G': 1}, ports=['8000'])"
    assert info.nodes == 1
    assert info.autostop_minutes is None
    assert info.to_down is False
    assert info.init_kind is None


def test_sparse_record_with_autostop_and_init_reason() -> None:
    info = cluster_info_from_record(
        {
            "name": "c",
            "status": "INIT",
            "autostop": 30,
            "to_down": True,
            "init_kind": "unhealthy",
            "init_status_reason": "node terminated",
        }
    )
    assert info.status is ClusterStatus.INIT
    assert info.launched_at is None
    assert info.autostop_minutes == 30
    assert info.to_down is True
    assert info.init_kind == "unhealthy"
    assert info.status_reason == "node terminated"
    assert info.cloud is None


@pytest.mark.parametrize("status", list(ClusterStatus))
def test_every_documented_status_maps(status: ClusterStatus) -> None:
    assert cluster_info_from_record({"name": "c", "status": status.value}).status is status


def test_enum_members_from_the_sdk_map_by_value() -> None:
    class SdkClusterStatus(enum.Enum):  # shaped like sky.utils.status_lib.ClusterStatus
        STOPPED = "STOPPED"

    info = cluster_info_from_record({"name": "c", "status": SdkClusterStatus.STOPPED})
    assert info.status is ClusterStatus.STOPPED


def test_unknown_status_is_typed() -> None:
    with pytest.raises(UnknownStatusError) as info:
        cluster_info_from_record({"name": "c", "status": "EXPLODED"}, argv=("sky", "status"))
    assert info.value.status == "EXPLODED"
    assert info.value.argv == ("sky", "status")
    assert isinstance(info.value, SkyOutputError)


@pytest.mark.parametrize("record", [{"status": "UP"}, {"name": "c"}, {"name": 1, "status": "UP"}])
def test_record_without_name_or_status_is_an_output_error(record: dict[str, object]) -> None:
    with pytest.raises(SkyOutputError, match="name"):
        cluster_info_from_record(record)


def test_find_cluster_picks_the_named_record() -> None:
    other = dict(RECORD, name="other", status="STOPPED")
    info = find_cluster([other, RECORD], "haru-demo-alpha")
    assert info is not None
    assert info.status is ClusterStatus.UP
    assert find_cluster([other], "haru-demo-alpha") is None
