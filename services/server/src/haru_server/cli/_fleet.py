"""``haru fleets``, ``haru fleet show`` and ``haru fleet policy set``: read and change fleets."""

from __future__ import annotations

from typing import Annotated

import typer

from haru_server.cli._common import (
    DEFAULT_URL,
    EXIT_USAGE,
    CliFailure,
    JsonOption,
    TokenOption,
    UrlOption,
    _client,
    _guard,
    _run,
)
from haru_server.cli._render import (
    _cells,
    _console,
    _print_json,
    _table,
    render_fleet,
    render_policy,
)


def fleets(
    url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False
) -> None:
    """List the fleets of the server with their active domain (by slug)."""
    import json

    async def go() -> None:
        async with _client(url, token) as client:
            listing = await client.fleets()
            slugs: dict[str, str | None] = {}
            for pointer in listing.fleets:
                active = None
                if pointer.active_domain_id is not None:
                    snapshot = await client.fleet(str(pointer.id))
                    domain = snapshot.domain(pointer.active_domain_id)
                    active = None if domain is None else domain.slug
                slugs[str(pointer.id)] = active
        if as_json:
            document = listing.model_dump(mode="json")
            for entry in document["fleets"]:
                entry["activeDomainSlug"] = slugs[entry["id"]]
            _print_json(json.dumps(document))
            return
        table = _table("slug", "id", "active domain", "route revision")
        for fleet in listing.fleets:
            table.add_row(
                *_cells(
                    fleet.slug,
                    fleet.id,
                    slugs[str(fleet.id)] or "-",
                    fleet.route_revision,
                )
            )
        _console().print(table)

    _guard(lambda: _run(go()))


def parse_policy_assignment(text: str) -> tuple[list[str], object]:
    """Parse ``key=value`` into (key path, JSON value).

    ``true``/``false`` and integers are typed, ``default`` clears the operator's value (null),
    anything else is a string.

    Raises:
        CliFailure: No ``=``, an empty key or an empty value (exit 2).
    """
    key, sep, raw = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise CliFailure(f"{text!r}: expected key=value (camelCase key)", code=EXIT_USAGE)
    if raw == "":
        raise CliFailure(
            f"{text!r} has no value; use {key}=default to follow the default again",
            code=EXIT_USAGE,
        )
    value: object
    if raw == "default":
        value = None
    elif raw in ("true", "false"):
        value = raw == "true"
    elif raw.isascii() and raw.isdigit():
        value = int(raw)
    else:
        value = raw
    return path, value


def policy_set(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    assignments: Annotated[
        list[str],
        typer.Argument(
            help="key=value (camelCase, e.g. degradedGraceMs=5000 autoFailover=true "
            "probe.prompt=hi); key=default follows the default again.",
            show_default=False,
        ),
    ],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Change a fleet's policy (validated by the server; the next reconcile tick uses it)."""
    patch: dict[str, object] = {}

    async def go() -> None:
        async with _client(url, token) as client:
            answer = await client.set_policy(ref, patch)
        if as_json:
            _print_json(answer.model_dump_json())
            return
        changed = ", ".join(answer.changed) if answer.changed else "nothing (already so)"
        _console().print(f"fleet {ref} policy changed: {changed}")
        _console().print(render_policy(answer.policy))

    def body() -> None:
        if not assignments:
            raise CliFailure("give at least one key=value", code=EXIT_USAGE)
        for text in assignments:
            path, value = parse_policy_assignment(text)
            target = patch
            for part in path[:-1]:
                nested = target.setdefault(part, {})
                if not isinstance(nested, dict):
                    raise CliFailure(f"{text!r} conflicts with another assignment", code=EXIT_USAGE)
                target = nested
            target[path[-1]] = value
        _run(go())

    _guard(body)


def fleet_show(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show a fleet's domains and slots with their states."""

    async def go() -> None:
        async with _client(url, token) as client:
            fleet = await client.fleet(ref)
        if as_json:
            _print_json(fleet.model_dump_json())
            return
        for table in render_fleet(fleet):
            _console().print(table)

    _guard(lambda: _run(go()))


# ---- promote / demote ------------------------------------------------------------------------
