"""``haru keys``: create, list and revoke inference client keys.

Registered by :func:`haru_server.cli._register`; it talks to a running server's control API
(``/v1/keys``, admin token) as every fleet command does. The key is printed once, at creation.
"""

from __future__ import annotations

from typing import Annotated
from uuid import UUID

import typer

from haru_server.cli._common import (
    DEFAULT_URL,
    CliFailure,
    JsonOption,
    TokenOption,
    UrlOption,
    _client,
    _guard,
    _run,
)
from haru_server.cli._render import _cells, _console, _print_json, _table

keys_app = typer.Typer(help="Inference client keys (what clients of the proxy send).")


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Argument(help="Your name for the key (no spaces).")],
    fleet: Annotated[
        list[str] | None,
        typer.Option("--fleet", help="A fleet (slug or id) the key may use; repeat for more."),
    ] = None,
    models: Annotated[
        str | None, typer.Option("--models", help="Models the key may use: m1,m2.")
    ] = None,
    rpm: Annotated[
        int | None, typer.Option("--rpm", help="Requests per minute, per server process.")
    ] = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create a key and print it: it is shown this once (only its SHA-256 is stored)."""
    allowed = None if models is None else [m.strip() for m in models.split(",") if m.strip()]
    if allowed is not None and not allowed:
        raise typer.BadParameter("name at least one model", param_hint="--models")

    def body() -> None:
        async def go() -> None:
            async with _client(url, token) as client:
                made = await client.create_key(name, fleets=fleet or None, models=allowed, rpm=rpm)
            if as_json:
                _print_json(made.model_dump_json())
                return
            console = _console()
            console.print(f"key {made.key.id} ({made.key.name}) created", markup=False)
            console.print("send it as 'Authorization: Bearer <key>'; it is not shown again:")
            _print_json(made.secret)

        _run(go())

    _guard(body)


@keys_app.command("list")
def keys_list(
    url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False
) -> None:
    """List the keys (ids, names, limits; never the keys themselves)."""

    def body() -> None:
        async def go() -> None:
            async with _client(url, token) as client:
                listing = await client.keys()
            if as_json:
                _print_json(listing.model_dump_json())
                return
            table = _table("id", "name", "fleets", "models", "rpm", "created", "revoked")
            for key in listing.keys:
                table.add_row(
                    *_cells(
                        key.id,
                        key.name,
                        "any" if key.fleet_ids is None else ",".join(map(str, key.fleet_ids)),
                        "any" if key.models is None else ",".join(key.models),
                        "-" if key.rpm is None else key.rpm,
                        key.created_at.isoformat(timespec="seconds"),
                        "-" if key.revoked_at is None else key.revoked_at.isoformat("T", "seconds"),
                    )
                )
            _console().print(table)

        _run(go())

    _guard(body)


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(metavar="ID", help="The key's id (haru keys list).")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Revoke a key: every server refuses it within one route lease (HARU_ROUTE_LEASE_MS)."""

    def body() -> None:
        try:
            parsed = UUID(key_id)
        except ValueError:
            raise CliFailure(f"{key_id[:100]!r} is not a key id (see haru keys list)") from None

        async def go() -> None:
            async with _client(url, token) as client:
                key = await client.revoke_key(parsed)
            _console().print(f"key {key.id} ({key.name}) revoked", markup=False)

        _run(go())

    _guard(body)
