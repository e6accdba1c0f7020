"""``haru events``: print a fleet's audit trail (``--follow`` polls for new events)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from haru_server.cli._common import DEFAULT_URL, TokenOption, UrlOption, _client, _guard, _run
from haru_server.cli._render import _console, _print_json, format_event

if TYPE_CHECKING:
    from uuid import UUID


def events(
    ref: Annotated[str, typer.Argument(help="Fleet slug or id.")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new events.")
    ] = False,
    after: Annotated[int, typer.Option("--after", min=0, help="Start after this event id.")] = 0,
    interval: Annotated[
        float, typer.Option("--interval", min=0.05, help="Seconds between polls with --follow.")
    ] = 1.0,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print each event as one JSON line (JSON Lines).")
    ] = False,
) -> None:
    """Print a fleet's audit trail, oldest first, each event's domain by slug.

    JSON lines carry ``domainSlug`` beside ``domainId`` (null for an event of no domain, or of
    a domain the fleet no longer has).
    """
    import asyncio
    import json

    async def go() -> None:
        cursor = after
        async with _client(url, token) as client:
            domains: dict[UUID, str] = {}

            async def learn() -> None:
                snapshot = await client.fleet(ref)
                domains.update({domain.id: domain.slug for domain in snapshot.domains})

            await learn()
            while True:
                page = await client.events(ref, after=cursor, limit=500)
                if any(e.domain_id is not None and e.domain_id not in domains for e in page.events):
                    await learn()  # a domain added since (with --follow)
                for event in page.events:
                    if as_json:
                        document = json.loads(event.model_dump_json(by_alias=True))
                        document["domainSlug"] = (
                            None if event.domain_id is None else domains.get(event.domain_id)
                        )
                        _print_json(json.dumps(document, separators=(",", ":")))
                    else:
                        _console().print(format_event(event, domains), markup=False)
                    cursor = event.id
                if page.next_after is not None:
                    continue
                if not follow:
                    return
                await asyncio.sleep(interval)

    try:
        _guard(lambda: _run(go()))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
