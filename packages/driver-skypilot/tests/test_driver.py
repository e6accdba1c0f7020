from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import yaml
from haru_driver_skypilot import (
    ClusterStatus,
    DomainDriver,
    InvalidSpecError,
    Reply,
    ScriptedExec,
    SkyCliError,
    SkyOutputError,
    SkyPilotDriver,
    SkyRunner,
    SkySdkError,
    SkyTimeouts,
    TaskSpec,
    render_task_yaml,
    sdk_available,
)
from haru_protocol import Placement

NOT_FOUND_STDOUT = "Cluster(s) not found: \x1b[1mnonexistent\x1b[0m.\n[]\n"

SPEC = TaskSpec(
    name="haru-demo-alpha",
    placement=Placement.model_validate(
        {"cloud": "aws", "region": "us-east-1", "accelerator": "L4", "useSpot": True}
    ),
    ports=(8000,),
    envs={"HF_TOKEN": "hf_secret_value"},
    run="vllm serve m",
)


async def no_sleep(_delay: float) -> None:
    return None


def driver(fake: ScriptedExec, **kwargs: object) -> SkyPilotDriver:
    return SkyPilotDriver(SkyRunner(execute=fake, sleep=no_sleep), **kwargs)  # type: ignore[arg-type]


def exists(path: str) -> bool:
    return Path(path).exists()


async def test_launch_renders_a_temp_file_and_runs_sky_launch() -> None:
    fake = ScriptedExec(Reply(stdout="Job submitted, ID: 1\n"))
    await driver(fake).launch_domain(SPEC)
    (call,) = fake.calls
    path = call.argv[-1]
    assert call.argv == ("sky", "launch", "-c", "haru-demo-alpha", "-y", "-d", path)
    assert call.timeout == 1800.0
    assert path.endswith("/haru-demo-alpha.yaml")
    assert call.files == {path: render_task_yaml(SPEC)}
    assert yaml.safe_load(call.files[path])["resources"]["use_spot"] is True
    assert not exists(path)
    assert not exists(str(Path(path).parent))
    # Secrets travel in the file, never on the command line.
    assert not any("hf_secret_value" in arg for arg in call.argv)


async def test_failed_launch_raises_and_still_removes_the_file() -> None:
    fake = ScriptedExec(Reply(1, "", "sky.exceptions.ResourcesUnavailableError: no capacity\n"))
    with pytest.raises(SkyCliError, match="ResourcesUnavailableError") as info:
        await driver(fake).launch_domain(SPEC)
    assert info.value.argv[:3] == ("sky", "launch", "-c")
    assert not exists(fake.calls[0].argv[-1])


async def test_status_of_an_unknown_cluster_is_none() -> None:
    fake = ScriptedExec(Reply(stdout=NOT_FOUND_STDOUT))
    assert await driver(fake).get_domain_status("nonexistent") is None
    assert fake.calls[0].argv == ("sky", "status", "nonexistent", "-o", "json")
    assert fake.calls[0].timeout == 60.0


async def test_status_returns_the_typed_record() -> None:
    record = {"name": "haru-demo-alpha", "status": "STOPPED", "nodes": 1, "autostop": -1}
    fake = ScriptedExec(Reply(stdout=json.dumps([record], indent=2) + "\n"))
    info = await driver(fake).get_domain_status("haru-demo-alpha")
    assert info is not None
    assert info.status is ClusterStatus.STOPPED
    assert info.nodes == 1


async def test_status_survives_a_cold_server() -> None:
    fake = ScriptedExec(
        Reply(1, "", "ConnectionRefusedError: [Errno 111] Connection refused\n"),
        Reply(stdout=NOT_FOUND_STDOUT),
    )
    assert await driver(fake).get_domain_status("nonexistent") is None
    assert len(fake.calls) == 2


async def test_status_failure_and_garbage_are_errors() -> None:
    fake = ScriptedExec(Reply(1, "", "RuntimeError: boom\n"))
    with pytest.raises(SkyCliError):
        await driver(fake).get_domain_status("c")
    fake = ScriptedExec(Reply(stdout="Usage: sky status [OPTIONS]\n"))
    with pytest.raises(SkyOutputError):
        await driver(fake).get_domain_status("c")


async def test_stop_and_down_commands_and_timeouts() -> None:
    fake = ScriptedExec(Reply(), Reply())
    d = driver(fake)
    await d.stop_domain("haru-demo-alpha")
    await d.teardown_domain("haru-demo-alpha")
    assert [(c.argv, c.timeout) for c in fake.calls] == [
        (("sky", "stop", "haru-demo-alpha", "-y"), 300.0),
        (("sky", "down", "haru-demo-alpha", "-y"), 300.0),
    ]


async def test_custom_timeouts_are_propagated() -> None:
    fake = ScriptedExec(Reply(), Reply(stdout="[]"), Reply(), Reply())
    d = driver(fake, timeouts=SkyTimeouts(launch=11, status=12, stop=13, down=14))
    await d.launch_domain(SPEC)
    await d.get_domain_status("c")
    await d.stop_domain("c")
    await d.teardown_domain("c")
    assert [c.timeout for c in fake.calls] == [11, 12, 13, 14]


@pytest.mark.parametrize("name", ["", "-rf", "a b", "--all", "x" * 64])
async def test_bad_names_never_reach_sky(name: str) -> None:
    fake = ScriptedExec()
    d = driver(fake)
    with pytest.raises(InvalidSpecError):
        await d.get_domain_status(name)
    with pytest.raises(InvalidSpecError):
        await d.stop_domain(name)
    with pytest.raises(InvalidSpecError):
        await d.teardown_domain(name)
    assert fake.calls == []


class FakeSdk:
    def __init__(self, records: list[Mapping[str, object]] | Exception) -> None:
        self.records = records
        self.calls: list[tuple[str, tuple[str, ...], float]] = []

    async def cluster_records(
        self, names: Sequence[str], *, timeout: float, refresh: bool = False
    ) -> list[Mapping[str, object]]:
        self.calls.append(("cluster", tuple(names), timeout))
        if isinstance(self.records, Exception):
            raise self.records
        return self.records

    async def service_records(
        self, names: Sequence[str], *, timeout: float
    ) -> list[Mapping[str, object]]:
        raise AssertionError("not used by the SkyPilot driver")


async def test_sdk_status_source_reads_records_without_the_cli() -> None:
    fake = ScriptedExec()
    sdk = FakeSdk([{"name": "c", "status": "UP"}])
    d = driver(fake, status_source="sdk", sdk=sdk, timeouts=SkyTimeouts(status=7))
    assert d.uses_sdk
    info = await d.get_domain_status("c")
    assert info is not None
    assert info.status is ClusterStatus.UP
    assert sdk.calls == [("cluster", ("c",), 7)]
    assert fake.calls == []


async def test_sdk_absent_cluster_and_errors() -> None:
    assert (
        await driver(ScriptedExec(), status_source="sdk", sdk=FakeSdk([])).get_domain_status("c")
        is None
    )
    failing = driver(ScriptedExec(), status_source="sdk", sdk=FakeSdk(SkySdkError("down")))
    with pytest.raises(SkySdkError, match="down"):
        await failing.get_domain_status("c")


async def test_cli_is_the_default_even_when_an_sdk_is_given() -> None:
    d = driver(ScriptedExec(), sdk=FakeSdk([]))
    assert not d.uses_sdk


@pytest.mark.skipif(sdk_available(), reason="SkyPilot is installed here")
def test_sdk_source_without_skypilot_is_an_error_and_auto_falls_back() -> None:
    with pytest.raises(SkySdkError, match="not installed"):
        SkyPilotDriver(status_source="sdk")
    assert not SkyPilotDriver(status_source="auto").uses_sdk


def test_driver_satisfies_the_protocol() -> None:
    implementation: DomainDriver = SkyPilotDriver()
    assert isinstance(implementation, SkyPilotDriver)
