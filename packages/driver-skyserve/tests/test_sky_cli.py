"""Every ``sky`` command line the drivers build, parsed by SkyPilot 0.14.1's own CLI.

The drivers are run against a scripted exec, so the argv lists checked here are exactly the
ones Haru would run; each is then parsed by SkyPilot's click command tree (``sky.client.cli.
command.cli``) the way ``sky`` parses it, down to the leaf command, options and arguments
included, without running anything. A flag SkyPilot renames or drops fails here. Run by
.ci/sky-lane.sh (``test_sky_live.py`` runs some of the same commands against a local API
server).
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from collections.abc import Sequence

import click
import pytest
from haru_driver_skypilot import (
    Reply,
    ScriptedExec,
    SkyPilotDriver,
    SkyRunner,
    example_domain_task,
)
from haru_driver_skyserve import ServiceSpec, SkyServeDriver

pytestmark = pytest.mark.sky

API_INFO = '{"server": {"status": "healthy", "version": "0.14.1", "url": "http://x"}}'
NO_SERVER = "No SkyPilot API server is connected\n"
GONE = "Services\nNo live services.\n"


async def no_sleep(_delay: float) -> None:
    return None


async def built_commands() -> list[tuple[str, ...]]:
    """The argv (after ``sky``) of every command the two drivers build."""
    fake = ScriptedExec(
        Reply(),  # launch
        Reply(stdout="[]\n"),  # status N1 N2 -o json
        Reply(stdout="[]\n"),  # status N1 N2 --refresh -o json
        Reply(stdout="[]\n"),  # status N -o json
        Reply(stdout="1.2.3.4:8000\n"),  # status --endpoint PORT N
        Reply(stdout="1.2.3.4\n"),  # status --ip N
        Reply(),  # stop
        Reply(),  # down
        Reply(stdout="skypilot, version 0.14.1\n"),  # --version
        Reply(stdout=NO_SERVER),  # api info -o json
        Reply(),  # api start
        Reply(stdout=API_INFO),  # api info -o json
        Reply(),  # serve up
        Reply(stdout=GONE),  # serve status N
        Reply(),  # serve down N -y --purge
        Reply(stdout=GONE),  # serve status N (the wait)
    )
    runner = SkyRunner(execute=fake, sleep=no_sleep)
    cluster = SkyPilotDriver(runner)
    task = example_domain_task(start_asleep=True)
    await cluster.launch_domain(task, secrets=dict.fromkeys(task.secrets, "value"))
    names = [task.name, "haru-demo--gamma"]
    await cluster.get_domain_statuses(names)
    await cluster.get_domain_statuses(names, refresh=True)
    await cluster.get_domain_status(task.name)
    await cluster.get_endpoint(task.name, 8000)
    await cluster.get_head_ip(task.name)
    await cluster.stop_domain(task.name)
    await cluster.teardown_domain(task.name)
    await cluster.preflight()
    service = SkyServeDriver(runner, sleep=no_sleep)
    spec = ServiceSpec(task=dataclasses.replace(task, ports=(8000,), secrets=()))
    await service.launch_service(spec)
    await service.get_service_status(spec.name)
    await service.teardown_service(spec.name)
    assert fake.remaining == 0
    return [call.argv[1:] for call in fake.calls]


def parse(sky: types.ModuleType, argv: Sequence[str]) -> list[str]:
    """Parse ``sky ARGV`` with SkyPilot's CLI down to the leaf command; its path of names."""
    command = importlib.import_module("sky.client.cli.command")
    group: click.Command = command.cli
    args = list(argv)
    if args == ["--version"]:
        with pytest.raises(click.exceptions.Exit) as exited:
            group.make_context("sky", args)
        assert exited.value.exit_code == 0
        return ["--version"]
    ctx = group.make_context("sky", args)
    path: list[str] = []
    while isinstance(group, click.Group):
        rest = [*ctx.protected_args, *ctx.args]
        name, sub, rest = group.resolve_command(ctx, rest)
        assert name is not None, argv
        assert sub is not None, argv
        path.append(name)
        ctx = sub.make_context(name, rest, parent=ctx)
        group = sub
    return path


async def test_every_command_haru_builds_parses_with_skypilots_cli(
    sky: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `--secret NAME` takes its value from the environment, as when Haru launches.
    for name in example_domain_task(start_asleep=True).secrets:
        monkeypatch.setenv(name, "value")
    commands = await built_commands()
    leaves = [tuple(parse(sky, argv)) for argv in commands]
    assert sorted(set(leaves)) == sorted(
        {
            ("launch",),
            ("status",),
            ("stop",),
            ("down",),
            ("--version",),
            ("api", "info"),
            ("api", "start"),
            ("serve", "up"),
            ("serve", "status"),
            ("serve", "down"),
        }
    )


async def test_a_renamed_flag_would_fail_here(sky: types.ModuleType) -> None:
    with pytest.raises(click.exceptions.NoSuchOption):
        parse(sky, ["status", "--endpoint-port", "8000", "c"])
