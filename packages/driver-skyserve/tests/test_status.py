from __future__ import annotations

import enum

import pytest
from haru_driver_skypilot import SkyOutputError, UnknownStatusError
from haru_driver_skyserve import (
    ServiceInfo,
    ServiceStatus,
    find_service,
    parse_service_status,
    service_info_from_record,
)

SERVICES = "\x1b[36m\x1b[1mServices\x1b[0m\n"

# Rendered by SkyPilot 0.14.1's own sky.serve.serve_utils.format_service_table (as
# `sky serve status` prints it after the "Services" title), trailing spaces included.
TABLE = (
    "NAME             VERSION  UPTIME    STATUS           REPLICAS  ENDPOINT        \n"
    "haru-demo-alpha  1        1h 2m 3s  \x1b[32mREADY\x1b[0m            1/2       "
    "34.1.2.3:30001  \n"
    "other-svc        -        -         \x1b[34mCONTROLLER_INIT\x1b[0m  0/0       -      "
    "         \n"
    "\n"
    "\x1b[36m\x1b[1mService Replicas\x1b[0m\n"
    "SERVICE_NAME     ID  VERSION  ENDPOINT             LAUNCHED     INFRA            "
    "RESOURCES      STATUS        \n"
    "haru-demo-alpha  1   1        http://3.3.3.3:8000  50 mins ago  AWS (us-east-1)  "
    "1x(gpus=L4:1)  \x1b[32mREADY\x1b[0m         \n"
    "haru-demo-alpha  2   1        -                    1 min ago    AWS (us-east-1)  "
    "1x(gpus=L4:1)  \x1b[34mPROVISIONING\x1b[0m  \n"
)


def table_with(name: str, status: str, *, version: str = "1", replicas: str = "1/1") -> str:
    width = max(len(name), 4) + 2
    status_width = max(len(status), 6) + 2
    return (
        SERVICES
        + f"{'NAME':<{width}}VERSION  UPTIME  {'STATUS':<{status_width}}REPLICAS  ENDPOINT  \n"
        + f"{name:<{width}}{version:<9}{'2m 1s':<8}\x1b[32m{status}\x1b[0m"
        + " " * (status_width - len(status))
        + f"{replicas:<10}-         \n\n"
        + "\x1b[36m\x1b[1mService Replicas\x1b[0m\nNo existing replicas.\n"
    )


def test_row_of_the_real_table_is_parsed() -> None:
    info = parse_service_status(SERVICES + TABLE, "haru-demo-alpha")
    assert info == ServiceInfo(
        name="haru-demo-alpha",
        status=ServiceStatus.READY,
        versions=(1,),
        ready_replicas=1,
        total_replicas=2,
        endpoint="34.1.2.3:30001",
    )


def test_a_second_row_with_dashes() -> None:
    info = parse_service_status(SERVICES + TABLE, "other-svc")
    assert info is not None
    assert info.status is ServiceStatus.CONTROLLER_INIT
    assert info.versions == ()
    assert info.endpoint is None
    assert (info.ready_replicas, info.total_replicas) == (0, 0)


def test_replica_rows_are_not_service_rows() -> None:
    # The replica table also has haru-demo-alpha rows; only the service table counts.
    output = SERVICES + TABLE.replace(
        "haru-demo-alpha  1        1h", "renamed-svc      1        1h"
    )
    with pytest.raises(SkyOutputError, match="neither lists"):
        parse_service_status(output, "haru-demo-alpha")


@pytest.mark.parametrize("status", list(ServiceStatus))
def test_every_documented_status_is_recognised(status: ServiceStatus) -> None:
    info = parse_service_status(table_with("haru-x", status.value), "haru-x")
    assert info is not None
    assert info.status is status


def test_several_active_versions_during_an_update() -> None:
    info = parse_service_status(table_with("haru-x", "READY", version="1,2"), "haru-x")
    assert info is not None
    assert info.versions == (1, 2)


@pytest.mark.parametrize(
    "stdout",
    [
        SERVICES + "No live services.\n",
        SERVICES + "No existing services.\n\nService 'haru-x' not found.\n",
        SERVICES + TABLE + "\nService 'haru-x' not found.\n",
        "\x1b[36m\x1b[1mServices\x1b[0m\n\x1b[0mNo live services.\x1b[0m\n",
    ],
)
def test_absent_service_is_none(stdout: str) -> None:
    assert parse_service_status(stdout, "haru-x") is None


def test_not_found_for_another_name_does_not_mean_absent() -> None:
    stdout = SERVICES + TABLE + "\nService 'haru-y' not found.\n"
    with pytest.raises(SkyOutputError):
        parse_service_status(stdout, "haru-x")


def test_unrecognised_status_is_typed() -> None:
    argv = ("sky", "serve", "status", "haru-x")
    with pytest.raises(UnknownStatusError) as info:
        parse_service_status(table_with("haru-x", "NO_REPLICAS"), "haru-x", argv=argv)
    assert info.value.status == "NO_REPLICAS"
    assert info.value.argv == argv


@pytest.mark.parametrize(
    "stdout",
    [
        "",
        SERVICES + "Controller is initializing. Please wait.\n",
        "Failed to connect to serve controller, please try again later.\n",
    ],
)
def test_output_without_table_or_absence_is_an_error(stdout: str) -> None:
    with pytest.raises(SkyOutputError):
        parse_service_status(stdout, "haru-x")


class SdkServiceStatus(enum.Enum):  # shaped like sky.serve.ServiceStatus
    READY = "READY"
    BOGUS = "BOGUS"


class SdkReplicaStatus(enum.Enum):  # shaped like sky.serve.ReplicaStatus
    READY = "READY"
    STARTING = "STARTING"
    FAILED_PROBING = "FAILED_PROBING"


def test_sdk_record_maps_like_the_cli_columns() -> None:
    record: dict[str, object] = {
        "name": "haru-x",
        "active_versions": [2, 3],
        "uptime": 1764460800,
        "status": SdkServiceStatus.READY,
        "endpoint": "http://34.1.2.3:30001",
        "replica_info": [
            {"replica_id": 1, "status": SdkReplicaStatus.READY},
            {"replica_id": 2, "status": SdkReplicaStatus.STARTING},
            {"replica_id": 3, "status": SdkReplicaStatus.FAILED_PROBING},
        ],
    }
    info = service_info_from_record(record)
    assert info == ServiceInfo(
        name="haru-x",
        status=ServiceStatus.READY,
        versions=(2, 3),
        ready_replicas=1,
        total_replicas=2,
        endpoint="http://34.1.2.3:30001",
    )


def test_sdk_record_with_string_status_and_no_replicas() -> None:
    info = service_info_from_record({"name": "haru-x", "status": "NO_REPLICA", "endpoint": None})
    assert info.status is ServiceStatus.NO_REPLICA
    assert info.endpoint is None
    assert info.ready_replicas is None


@pytest.mark.parametrize(
    ("record", "error"),
    [
        ({"status": "READY"}, SkyOutputError),
        ({"name": "haru-x"}, SkyOutputError),
        ({"name": "haru-x", "status": SdkServiceStatus.BOGUS}, UnknownStatusError),
        ({"name": "haru-x", "status": "READY", "replica_info": "x"}, SkyOutputError),
        ({"name": "haru-x", "status": "READY", "replica_info": [1]}, SkyOutputError),
    ],
)
def test_bad_sdk_records(record: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        service_info_from_record(record)


def test_find_service() -> None:
    records: list[dict[str, object]] = [
        {"name": "a", "status": "FAILED"},
        {"name": "haru-x", "status": "SHUTTING_DOWN"},
    ]
    found = find_service(records, "haru-x")
    assert found is not None
    assert found.status is ServiceStatus.SHUTTING_DOWN
    assert find_service(records, "haru-y") is None
