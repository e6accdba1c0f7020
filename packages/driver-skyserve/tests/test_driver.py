from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import yaml
from haru_driver_skypilot import (
    InvalidSpecError,
    Reply,
    ScriptedExec,
    SkyCliError,
    SkyOutputError,
    SkyRunner,
    SkySdkError,
    SkyTimeoutError,
    SkyTimeouts,
    TaskSpec,
)
from haru_driver_skyserve import (
    ServiceDriver,
    ServiceSpec,
    ServiceStatus,
    SkyServeDriver,
    render_service_yaml,
)
from haru_exec import ExecTimeoutError
from haru_protocol import DomainLayout, Placement

SPEC = ServiceSpec(
    task=TaskSpec(
        name="haru-demo-alpha",
        placement=Placement.model_validate(
            {"cloud": "aws", "region": "us-east-1", "accelerator": "L4"}
        ),
        ports=(8000,),
        envs={"HF_TOKEN": "hf_secret_value"},
        run="vllm serve m",
    ),
    readiness_path="/health",
    replicas=2,
)

STATUS_READY = (
    "\x1b[36m\x1b[1mServices\x1b[0m\n"
    "NAME             VERSION  UPTIME  STATUS           REPLICAS  ENDPOINT        \n"
    "haru-demo-alpha  1        5m 2s   \x1b[32mREADY\x1b[0m            2/2       "
    "34.1.2.3:30001  \n"
    "\n\x1b[36m\x1b[1mService Replicas\x1b[0m\nNo existing replicas.\n"
)


async def no_sleep(_delay: float) -> None:
    return None


def driver(fake: ScriptedExec, **kwargs: object) -> SkyServeDriver:
    return SkyServeDriver(SkyRunner(execute=fake, sleep=no_sleep), **kwargs)  # type: ignore[arg-type]


def exists(path: str) -> bool:
    return Path(path).exists()


async def test_launch_runs_sky_serve_up_with_the_rendered_file() -> None:
    fake = ScriptedExec(Reply(stdout="Service name: haru-demo-alpha\n"))
    await driver(fake).launch_service(SPEC)
    (call,) = fake.calls
    path = call.argv[-1]
    assert call.argv == ("sky", "serve", "up", "-n", "haru-demo-alpha", "-y", path)
    assert call.timeout == 1800.0
    assert call.files == {path: render_service_yaml(SPEC)}
    assert yaml.safe_load(call.files[path])["service"]["readiness_probe"] == "/health"
    assert not exists(path)
    assert not any("hf_secret_value" in arg for arg in call.argv)


async def test_launch_timeout_is_typed_and_cleans_up() -> None:
    fake = ScriptedExec(ExecTimeoutError("slow", argv=("sky",), timeout=1800))
    with pytest.raises(SkyTimeoutError):
        await driver(fake).launch_service(SPEC)
    assert not exists(fake.calls[0].argv[-1])


async def test_status_parses_the_table() -> None:
    fake = ScriptedExec(Reply(stdout=STATUS_READY))
    info = await driver(fake).get_service_status("haru-demo-alpha")
    assert info is not None
    assert info.status is ServiceStatus.READY
    assert (info.ready_replicas, info.total_replicas) == (2, 2)
    assert [(c.argv, c.timeout) for c in fake.calls] == [
        (("sky", "serve", "status", "haru-demo-alpha"), 60.0)
    ]


async def test_status_of_an_absent_service_is_none() -> None:
    fake = ScriptedExec(Reply(stdout="\x1b[36m\x1b[1mServices\x1b[0m\nNo live services.\n"))
    assert await driver(fake).get_service_status("haru-demo-alpha") is None


async def test_status_retries_a_cold_server_then_parses() -> None:
    fake = ScriptedExec(
        Reply(
            1,
            "Failed to connect to SkyPilot API server at http://127.0.0.1:46580.\n",
            "ConnectionRefusedError: [Errno 111] Connection refused\n",
        ),
        Reply(stdout=STATUS_READY),
    )
    assert await driver(fake).get_service_status("haru-demo-alpha") is not None
    assert len(fake.calls) == 2


async def test_status_errors() -> None:
    fake = ScriptedExec(Reply(1, "", "RuntimeError: Failed to fetch service statuses\n"))
    with pytest.raises(SkyCliError):
        await driver(fake).get_service_status("haru-demo-alpha")
    fake = ScriptedExec(Reply(stdout="Controller is initializing.\n"))
    with pytest.raises(SkyOutputError):
        await driver(fake).get_service_status("haru-demo-alpha")


async def test_teardown_and_custom_timeouts() -> None:
    gone = Reply(stdout="Services\nNo live services.\n")
    fake = ScriptedExec(Reply(), Reply(stdout=STATUS_READY), Reply(), gone)
    d = driver(fake, timeouts=SkyTimeouts(launch=21, status=22, stop=23, down=24))
    await d.launch_service(SPEC)
    await d.get_service_status("haru-demo-alpha")
    await d.teardown_service("haru-demo-alpha")
    assert fake.calls[-2].argv == ("sky", "serve", "down", "haru-demo-alpha", "-y", "--purge")
    assert fake.calls[-1].argv == ("sky", "serve", "status", "haru-demo-alpha")
    assert [c.timeout for c in fake.calls] == [21, 22, 24, 22]


@pytest.mark.parametrize("name", ["", "--all", "-a", "a b", "UPPER"])
async def test_bad_names_never_reach_sky(name: str) -> None:
    fake = ScriptedExec()
    with pytest.raises(InvalidSpecError):
        await driver(fake).get_service_status(name)
    with pytest.raises(InvalidSpecError):
        await driver(fake).teardown_service(name)
    assert fake.calls == []


class FakeSdk:
    def __init__(self, records: list[Mapping[str, object]] | Exception) -> None:
        self.records = records
        self.calls: list[tuple[tuple[str, ...], float]] = []

    async def cluster_records(
        self, names: Sequence[str], *, timeout: float, refresh: bool = False
    ) -> list[Mapping[str, object]]:
        raise AssertionError("not used by the SkyServe driver")

    async def service_records(
        self, names: Sequence[str], *, timeout: float
    ) -> list[Mapping[str, object]]:
        self.calls.append((tuple(names), timeout))
        if isinstance(self.records, Exception):
            raise self.records
        return self.records


async def test_sdk_status_source() -> None:
    fake = ScriptedExec()
    sdk = FakeSdk([{"name": "haru-demo-alpha", "status": "REPLICA_INIT", "replica_info": []}])
    d = driver(fake, status_source="sdk", sdk=sdk)
    assert d.uses_sdk
    info = await d.get_service_status("haru-demo-alpha")
    assert info is not None
    assert info.status is ServiceStatus.REPLICA_INIT
    assert (info.ready_replicas, info.total_replicas) == (0, 0)
    assert sdk.calls == [(("haru-demo-alpha",), 60.0)]
    assert fake.calls == []
    assert await driver(fake, status_source="sdk", sdk=FakeSdk([])).get_service_status("x") is None
    failing = driver(fake, status_source="sdk", sdk=FakeSdk(SkySdkError("network")))
    with pytest.raises(SkySdkError):
        await failing.get_service_status("x")


def test_driver_satisfies_the_protocol() -> None:
    implementation: ServiceDriver = SkyServeDriver()
    assert not SkyServeDriver().uses_sdk
    assert isinstance(implementation, SkyServeDriver)


async def test_sky_serve_never_gets_a_workers_metrics_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # What a HARU_WORKERS worker has in its environment; explicit or inherited, never passed.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "haru-metrics"))
    fake = ScriptedExec(Reply(stdout=STATUS_READY), Reply(stdout=STATUS_READY))
    await driver(fake).get_service_status("haru-demo-alpha")
    explicit = SkyRunner(execute=fake, env=dict(os.environ), sleep=no_sleep)
    await SkyServeDriver(explicit).get_service_status("haru-demo-alpha")
    inherited, given = (dict(c.env or {}) for c in fake.calls)
    assert [c.argv[:3] for c in fake.calls] == [("sky", "serve", "status")] * 2
    assert "PROMETHEUS_MULTIPROC_DIR" not in inherited
    assert given == {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}


async def test_launch_passes_each_secret_through_the_environment() -> None:
    from haru_driver_skypilot import SERVING_TOKEN_SECRET
    from haru_driver_skyserve import domain_service

    layout = DomainLayout.model_validate(
        {
            "slug": "alpha",
            "provider": "skyserve",
            "placement": {"cloud": "aws", "region": "us-east-1", "accelerator": "L4"},
            "slots": [{"kind": "inference", "gpuIndex": 0, "models": [{"name": "chat-a"}]}],
        }
    )
    spec = domain_service("haru-demo-alpha", layout.placement, layout.slots, layout.settings)
    with pytest.raises(InvalidSpecError, match=SERVING_TOKEN_SECRET):
        await driver(ScriptedExec()).launch_service(spec)
    fake = ScriptedExec(Reply(stdout="Service name: haru-demo-alpha\n"))
    await driver(fake).launch_service(spec, secrets={SERVING_TOKEN_SECRET: "serving-value-1"})
    (call,) = fake.calls
    assert call.argv[:9] == (
        "sky",
        "serve",
        "up",
        "-n",
        "haru-demo-alpha",
        "-y",
        "--secret",
        SERVING_TOKEN_SECRET,
        call.argv[-1],
    )
    assert call.env is not None
    assert call.env[SERVING_TOKEN_SECRET] == "serving-value-1"
    assert "serving-value-1" not in " ".join(call.argv)
    assert "serving-value-1" not in call.files[call.argv[-1]]
