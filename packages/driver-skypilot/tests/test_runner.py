from __future__ import annotations

import os
from pathlib import Path

import pytest
from haru_driver_skypilot import (
    Reply,
    ScriptedExec,
    SkyCliError,
    SkyCommandError,
    SkyOutputError,
    SkyRunner,
    SkyTimeoutError,
    SkyTimeouts,
    SkyUnavailableError,
    is_cold_server_failure,
    sky_environment,
    strip_ansi,
    temporary_yaml,
)
from haru_exec import STDERR_LIMIT, ExecError, ExecResult, ExecSpawnError, ExecTimeoutError

# What `sky` printed on a cold local API server (REFERENCE-FACTS SkyPilot section 3).
COLD_STDOUT = (
    "\x1b[2mFailed to connect to SkyPilot API server at http://127.0.0.1:46580. "
    "Starting a local server.\x1b[0m\n"
)
REFUSED_STDERR = "requests.exceptions.ConnectionError: [Errno 111] Connection refused\n"


class Sleeps:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def runner(fake: ScriptedExec, sleeps: Sleeps | None = None, **kwargs: object) -> SkyRunner:
    return SkyRunner(execute=fake, sleep=sleeps or Sleeps(), **kwargs)  # type: ignore[arg-type]


async def test_runs_argv_with_the_given_timeout() -> None:
    fake = ScriptedExec(Reply(stdout="ok\n"))
    result = await runner(fake).run(["status", "c", "-o", "json"], timeout=12.5)
    assert result.stdout == "ok\n"
    assert [(c.argv, c.timeout) for c in fake.calls] == [
        (("sky", "status", "c", "-o", "json"), 12.5)
    ]


async def test_sky_gets_what_skypilot_needs_and_none_of_harus_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HARU_SUPERVISOR_TOKEN", "tok-must-not-leak")
    monkeypatch.setenv("HARU_DATABASE_URL", "postgresql://u:pw@db/haru")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("SKYPILOT_API_SERVER_ENDPOINT", "http://127.0.0.1:46580")
    monkeypatch.setenv("KUBECONFIG", "/etc/kube/config")
    fake = ScriptedExec(Reply(), Reply())
    await runner(fake).run(["status", "c", "-o", "json"], timeout=1)
    await runner(fake).run(
        ["launch", "-c", "c", "-y", "-d", "--secret", "HARU_SUPERVISOR_TOKEN", "t.yaml"],
        timeout=1,
        extra_env={"HARU_SUPERVISOR_TOKEN": "tok-for-this-launch"},
        retry_cold=False,
    )
    status, launch = (dict(c.env or {}) for c in fake.calls)
    assert status == sky_environment()
    assert not [name for name in status if name.startswith("HARU_")]
    for name in ("PATH", "HOME", "AWS_ACCESS_KEY_ID", "SKYPILOT_API_SERVER_ENDPOINT", "KUBECONFIG"):
        assert status[name] == os.environ[name]
    # The launch's secret, for that one call only.
    assert launch == {**status, "HARU_SUPERVISOR_TOKEN": "tok-for-this-launch"}


async def test_sky_never_gets_a_workers_metrics_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    folder = str(tmp_path / "haru-metrics")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", folder)
    explicit = {"PATH": "/bin", "PROMETHEUS_MULTIPROC_DIR": folder}
    fake = ScriptedExec(Reply(), Reply())
    await runner(fake).run(["status", "c", "-o", "json"], timeout=1)
    await runner(fake, env=explicit).run(["status", "c", "-o", "json"], timeout=1)
    inherited, given = (dict(c.env or {}) for c in fake.calls)
    assert "PROMETHEUS_MULTIPROC_DIR" not in inherited
    assert inherited["PATH"] == os.environ["PATH"]
    assert given == {"PATH": "/bin"}
    assert explicit["PROMETHEUS_MULTIPROC_DIR"] == folder  # the caller's mapping is kept


async def test_custom_executable_and_env_are_passed() -> None:
    fake = ScriptedExec(Reply())
    env = {"PATH": "/bin", "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"}
    await runner(fake, executable="/opt/sky/bin/sky", env=env).run(["down", "c", "-y"], timeout=1)
    assert fake.calls[0].argv == ("/opt/sky/bin/sky", "down", "c", "-y")
    assert fake.calls[0].env == env


@pytest.mark.parametrize(
    ("stdout", "stderr"),
    [
        (COLD_STDOUT, REFUSED_STDERR),
        ("", REFUSED_STDERR),
        ("", "ConnectionRefusedError: ... /workspaces"),
        ("", "sky.exceptions.ApiServerConnectionError: Could not connect to SkyPilot API server"),
    ],
)
async def test_cold_server_failure_is_retried_once(stdout: str, stderr: str) -> None:
    fake = ScriptedExec(Reply(1, stdout, stderr), Reply(0, "[]\n"))
    sleeps = Sleeps()
    result = await runner(fake, sleeps, retry_delay=4.0).run(["status", "c"], timeout=60)
    assert result.stdout == "[]\n"
    assert len(fake.calls) == 2
    assert fake.calls[0].argv == fake.calls[1].argv
    assert sleeps.delays == [4.0]


async def test_a_second_cold_failure_is_raised() -> None:
    fake = ScriptedExec(Reply(1, COLD_STDOUT, REFUSED_STDERR), Reply(1, "", REFUSED_STDERR))
    with pytest.raises(SkyCliError) as info:
        await runner(fake).run(["status", "c"], timeout=60)
    assert info.value.returncode == 1
    assert "Connection refused" in info.value.stderr
    assert fake.remaining == 0


async def test_retries_can_be_disabled() -> None:
    fake = ScriptedExec(Reply(1, COLD_STDOUT, REFUSED_STDERR))
    with pytest.raises(SkyCliError):
        await runner(fake, cold_start_retries=0).run(["status", "c"], timeout=60)
    assert len(fake.calls) == 1


async def test_a_failure_after_the_server_start_line_is_not_retried() -> None:
    # The client prints "Failed to connect ... Starting a local server." and then reaches
    # the server it started: a failure after that is the command's own, not a cold server.
    fake = ScriptedExec(Reply(1, COLD_STDOUT, "sky.exceptions.ResourcesUnavailableError: x\n"))
    with pytest.raises(SkyCliError, match="ResourcesUnavailableError"):
        await runner(fake).run(["status", "c"], timeout=60)
    assert len(fake.calls) == 1


async def test_a_launch_is_never_run_twice() -> None:
    fake = ScriptedExec(Reply(1, "", REFUSED_STDERR))
    with pytest.raises(SkyCliError):
        await runner(fake).run(["launch", "-c", "c"], timeout=60, retry_cold=False)
    assert len(fake.calls) == 1


async def test_other_failures_are_not_retried() -> None:
    fake = ScriptedExec(Reply(2, "", "Error: No such option: -o\n"))
    with pytest.raises(SkyCliError) as info:
        await runner(fake).run(["serve", "status", "-o", "json"], timeout=60)
    err = info.value
    assert err.argv == ("sky", "serve", "status", "-o", "json")
    assert err.returncode == 2
    assert err.stderr == "Error: No such option: -o\n"
    assert "exited with status 2" in str(err)
    assert "No such option" in str(err)
    assert len(fake.calls) == 1


async def test_success_after_a_cold_start_message_is_not_retried() -> None:
    fake = ScriptedExec(Reply(0, COLD_STDOUT + "[]\n"))
    result = await runner(fake).run(["status", "c"], timeout=60)
    assert result.ok
    assert len(fake.calls) == 1


async def test_stderr_is_bounded_and_stdout_explains_an_empty_stderr() -> None:
    fake = ScriptedExec(Reply(1, "x" * 10_000 + "\nValueError: bad task", "e" * 10_000))
    with pytest.raises(SkyCliError) as info:
        await runner(fake).run(["launch"], timeout=1)
    assert len(info.value.stderr) == STDERR_LIMIT
    assert len(info.value.stdout_tail) == STDERR_LIMIT
    assert len(str(info.value)) < 2 * 1024 + 300

    fake = ScriptedExec(Reply(1, "noise\nValueError: bad task\n", ""))
    with pytest.raises(SkyCliError, match="stdout: noise ValueError: bad task"):
        await runner(fake).run(["launch"], timeout=1)


async def test_timeout_is_typed() -> None:
    argv = ("sky", "launch", "-c", "c")
    fake = ScriptedExec(ExecTimeoutError("too slow", argv=argv, timeout=1800))
    with pytest.raises(SkyTimeoutError) as info:
        await runner(fake).run(["launch", "-c", "c"], timeout=1800)
    assert info.value.argv == argv
    assert info.value.timeout == 1800
    assert isinstance(info.value, SkyCommandError)
    assert isinstance(info.value.__cause__, ExecTimeoutError)
    assert len(fake.calls) == 1  # a timeout is never retried


async def test_missing_binary_is_typed() -> None:
    fake = ScriptedExec(ExecSpawnError("cannot run 'sky'", argv=("sky",)))
    with pytest.raises(SkyUnavailableError) as info:
        await runner(fake).run(["status"], timeout=1)
    assert info.value.argv == ("sky", "status")


async def test_oversized_output_is_an_output_error() -> None:
    fake = ScriptedExec(ExecError("wrote more than 16 MiB", argv=("sky",)))
    with pytest.raises(SkyOutputError) as info:
        await runner(fake).run(["status"], timeout=1)
    assert info.value.argv == ("sky", "status")


def test_runner_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="retries"):
        SkyRunner(cold_start_retries=-1)
    with pytest.raises(ValueError, match="retry_delay"):
        SkyRunner(retry_delay=-1)


def test_timeouts_defaults_and_checks() -> None:
    t = SkyTimeouts()
    assert (t.launch, t.status, t.stop, t.down) == (1800.0, 60.0, 300.0, 300.0)
    with pytest.raises(ValueError, match="status"):
        SkyTimeouts(status=0)


def test_cold_detection_needs_a_failure() -> None:
    ok = ExecResult(argv=("sky",), returncode=0, stdout=COLD_STDOUT, stderr="")
    bad = ExecResult(argv=("sky",), returncode=1, stdout=COLD_STDOUT, stderr=REFUSED_STDERR)
    other = ExecResult(argv=("sky",), returncode=1, stdout="", stderr="ValueError: nope")
    started = ExecResult(argv=("sky",), returncode=1, stdout=COLD_STDOUT, stderr="ValueError: x")
    assert not is_cold_server_failure(ok)
    assert is_cold_server_failure(bad)
    assert not is_cold_server_failure(other)
    assert not is_cold_server_failure(started)


def test_strip_ansi() -> None:
    assert strip_ansi("Cluster(s) not found: \x1b[1mnonexistent\x1b[0m.") == (
        "Cluster(s) not found: nonexistent."
    )
    assert strip_ansi("\x1b[36m\x1b[1mServices\x1b[0m") == "Services"
    assert strip_ansi("\x1b]8;;http://x\x07link\x1b]8;;\x07") == "link"


def snapshot(path: Path) -> tuple[str, int]:
    return path.read_text(), os.stat(path.parent).st_mode


def exists(path: Path) -> bool:
    return path.exists()


async def test_temporary_yaml_is_private_and_removed() -> None:
    async with temporary_yaml("a: 1\n", filename="c.yaml") as path:
        assert path.name == "c.yaml"
        text, mode = snapshot(path)
    assert text == "a: 1\n"
    assert mode & 0o077 == 0
    assert not exists(path)
    assert not exists(path.parent)


async def test_temporary_yaml_is_removed_on_error() -> None:
    seen: list[Path] = []

    async def fail_inside() -> None:
        async with temporary_yaml("a: 1\n", filename="c.yaml") as path:
            seen.append(path)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await fail_inside()
    assert seen
    assert not exists(seen[0].parent)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b.yaml"])
async def test_temporary_yaml_rejects_paths(name: str) -> None:
    with pytest.raises(ValueError, match="file name"):
        async with temporary_yaml("", filename=name):
            pass
