"""``haru domain status|up|down``: inspect, launch and tear down provisioned (skypilot) domains."""

from __future__ import annotations

from typing import Annotated

import typer

from haru_server.cli._common import (
    DEFAULT_URL,
    JsonOption,
    TokenOption,
    UrlOption,
    _client,
    _guard,
    _run,
)
from haru_server.cli._render import _console, _escape, _print_json, format_event


def domain_status(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    domain: Annotated[str, typer.Argument(help="Domain slug or id.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show a domain's row, its SkyPilot cluster status and its last provisioning events."""
    console = _console()

    async def go() -> None:
        async with _client(url, token) as client:
            answer = await client.domain_status(ref, domain)
        if as_json:
            _print_json(answer.model_dump_json())
            return
        row = answer.domain
        console.print(
            f"domain [bold]{_escape(row.slug)}[/] "
            + _escape(
                f"({row.provider.value}, {answer.role}): "
                f"{row.state.value}, launch attempt {row.launch_attempt}"
            )
        )
        console.print(f"supervisor: {row.supervisor_url or '-'}", markup=False)
        if answer.cluster_name is not None:
            shown = answer.cluster_status or f"unknown ({answer.cluster_error})"
            console.print(f"cluster {answer.cluster_name}: {shown}", markup=False)
        for event in answer.events:
            console.print(format_event(event), markup=False, highlight=False)

    _guard(lambda: _run(go()))


def _domain_action(
    action: str, ref: str, domain: str, url: str, token: str | None, as_json: bool
) -> None:
    console = _console()

    async def go() -> None:
        async with _client(url, token) as client:
            answer = await client.domain_action(ref, domain, action)
        if as_json:
            _print_json(answer.model_dump_json())
            return
        console.print(
            f"domain [bold]{_escape(answer.domain.slug)}[/] {action} accepted: "
            + _escape(answer.domain.state.value)
        )

    _guard(lambda: _run(go()))


def domain_up(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    domain: Annotated[str, typer.Argument(help="Stopped or failed skypilot domain.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Launch a stopped or failed skypilot domain again (the reconciler runs `sky launch`)."""
    _domain_action("up", ref, domain, url, token, as_json)


def domain_down(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    domain: Annotated[str, typer.Argument(help="Standby skypilot domain.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Tear a standby skypilot domain down (`sky down`); refused for the active domain."""
    _domain_action("down", ref, domain, url, token, as_json)
