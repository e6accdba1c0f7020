"""Commands of other distributions (``haru.commands`` entry points), listed without importing.

:func:`_group_class` builds the ``haru`` group: the built-in commands, then each registered
command (its module imported only when it runs), then the optional commands whose distribution
is not installed (they explain how to install it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from importlib import metadata
from typing import Any, Final

import typer
from typer.core import TyperCommand, TyperGroup

from haru_server.cli._common import CliFailure, _fail, refuse_token_argument
from haru_server.cli._render import _err_console

COMMAND_GROUP: Final = "haru.commands"
"""Entry-point group whose entries ``haru`` mounts as commands (name: the command's name;
object: a ``typer.Typer`` with one command, or a function typer turns into one)."""

OPTIONAL_COMMANDS: Final[Mapping[str, tuple[str, str]]] = {
    "demo": ("haru-demo", "Run a whole local fleet (no GPU needed)."),
}
"""Commands that come with another distribution: name -> (distribution, what it does)."""


def discover_commands() -> list[metadata.EntryPoint]:
    """The entry points of :data:`COMMAND_GROUP` in the installed distributions."""
    return list(metadata.entry_points(group=COMMAND_GROUP))


def _load_command(entry: metadata.EntryPoint) -> TyperCommand | TyperGroup:
    try:
        target = entry.load()
    except Exception as exc:  # any failure while importing a plugin is reported
        raise _fail(
            CliFailure(f"cannot load command {entry.name!r} ({entry.value}): {exc!r}")
        ) from exc
    if not isinstance(target, typer.Typer):
        if not callable(target):
            raise _fail(
                CliFailure(f"command {entry.name!r} ({entry.value}) is not a Typer app or function")
            )
        function = target
        target = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
        target.command(entry.name)(function)
    command = typer.main.get_command(target)
    assert isinstance(command, TyperCommand | TyperGroup)  # noqa: S101 -- typer's own classes
    return command


def _summary(entry: metadata.EntryPoint) -> str:
    dist = entry.dist
    # Parentheses, not brackets: the help is rich markup.
    if dist is None:
        return f"({entry.value})"
    summary = dist.metadata["Summary"]
    return f"{summary} ({dist.name})" if summary else f"({dist.name})"


class _Listed(TyperCommand):
    """A registered command as ``haru --help`` lists it, without importing its module."""

    def __init__(self, entry: metadata.EntryPoint) -> None:
        super().__init__(entry.name, help=_summary(entry))
        self.entry = entry


def _missing_command(name: str, distribution: str, what: str) -> TyperCommand:
    def explain() -> None:
        _err_console().print(
            f"[bold red]error:[/] haru {name} comes with the {distribution} package, which is "
            "not installed.\n"
            f"  {what}\n"
            f"  Install it with:  pip install {distribution}\n"
            f"  In a checkout of the Haru repository:  pip install uv && uv run haru {name}",
            soft_wrap=True,
        )
        raise typer.Exit(2)

    return TyperCommand(
        name,
        callback=explain,
        help=f"{what} (not installed: pip install {distribution})",
        # Whatever follows (options of the real command, --help) gets the same explanation.
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )


def _group_class(
    provide: Callable[[], Sequence[metadata.EntryPoint]],
) -> type[TyperGroup]:
    class HaruGroup(TyperGroup):
        """The ``haru`` group: built-in commands, then the registered and the missing ones."""

        @cached_property
        def _registered(self) -> dict[str, metadata.EntryPoint]:
            # A package cannot replace a built-in command; the first entry of a name wins.
            found: dict[str, metadata.EntryPoint] = {}
            for entry in provide():
                if entry.name not in self.commands:
                    found.setdefault(entry.name, entry)
            return found

        def _missing(self) -> list[str]:
            return [
                name
                for name in OPTIONAL_COMMANDS
                if name not in self._registered and name not in self.commands
            ]

        # ``ctx`` is typer's (or click's) Context; ``Any`` keeps these overrides independent of
        # which click typer is built on.
        def list_commands(self, ctx: Any) -> list[str]:
            extra = sorted({*self._registered, *self._missing()})
            return [*super().list_commands(ctx), *extra]

        def get_command(self, ctx: Any, cmd_name: str) -> Any:
            found = super().get_command(ctx, cmd_name)
            if found is not None:
                return found
            if cmd_name in self._registered:
                return _Listed(self._registered[cmd_name])
            if cmd_name in self._missing():
                distribution, what = OPTIONAL_COMMANDS[cmd_name]
                return _missing_command(cmd_name, distribution, what)
            return None

        def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
            refuse_token_argument(args)
            result: list[str] = super().parse_args(ctx, args)
            return result

        def resolve_command(self, ctx: Any, args: list[str]) -> tuple[str | None, Any, list[str]]:
            name, command, rest = super().resolve_command(ctx, args)
            if isinstance(command, _Listed):
                command = _load_command(command.entry)
            return name, command, rest

    return HaruGroup
