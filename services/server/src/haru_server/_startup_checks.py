"""Start-up checks that name a misconfiguration in the log (nothing here refuses to start)."""

from __future__ import annotations

import logging

from haru_core import inference_bindings
from haru_db import HaruDbError, StateStore
from haru_protocol import DomainSnapshot, Provider
from haru_supervisor_client import is_loopback_url
from yarl import URL

from haru_server._loop import ReconcileLoop

logger = logging.getLogger(__name__)


async def warn_auto_failover_without_loop(store: StateStore) -> None:
    try:
        pointers = await store.list_fleets()
        armed = []
        for pointer in pointers:
            fleet = await store.get_fleet_snapshot(str(pointer.id))
            if fleet is not None and fleet.policy.auto_failover:
                armed.append(fleet.slug)
    except HaruDbError as exc:
        logger.warning("could not check fleets for autoFailover at boot: %s", exc)
        return
    if armed:
        logger.warning(
            "!!! autoFailover is ON for fleet(s) %s but HARU_RECONCILE_INTERVAL_MS is off: "
            "no reconcile loop runs, so NOTHING will fail over automatically. Unset "
            "HARU_RECONCILE_INTERVAL_MS (the loop's default) or drive "
            "POST /v1/fleets/{ref}/reconcile.",
            ", ".join(armed),
        )


async def warn_plaintext_domains(store: StateStore, *, allowed: bool) -> None:
    """Name every domain whose supervisor is reached over plain HTTP beyond loopback."""
    try:
        clear: list[tuple[str, str, str]] = []
        for pointer in await store.list_fleets():
            fleet = await store.get_fleet_snapshot(str(pointer.id))
            if fleet is None:
                continue
            for domain in fleet.domains:
                url = domain.supervisor_url
                if url is not None and url.startswith("http://") and not is_loopback_url(url):
                    clear.append((fleet.slug, domain.slug, url))
    except HaruDbError as exc:
        logger.warning("could not check domains for plain-HTTP supervisors at boot: %s", exc)
        return
    for fleet_slug, domain_slug, url in clear:
        if allowed:
            logger.warning(
                "domain %s of fleet %s: supervisor %s is reached in CLEAR TEXT (the supervisor "
                "token and every call readable on the network; HARU_ALLOW_PLAINTEXT is set)",
                domain_slug,
                fleet_slug,
                url,
            )
        else:
            logger.error(
                "domain %s of fleet %s: supervisor %s is plain HTTP on another host: every call "
                "to it is refused (its heartbeats fail) until it serves https:// or "
                "HARU_ALLOW_PLAINTEXT=1 allows clear text on a private network",
                domain_slug,
                fleet_slug,
                url,
            )


async def warn_plaintext_serving(store: StateStore, *, allowed: bool) -> None:
    """Name every domain whose serving endpoint is reached over plain HTTP beyond loopback."""
    try:
        clear: list[tuple[str, DomainSnapshot, str]] = []
        for pointer in await store.list_fleets():
            fleet = await store.get_fleet_snapshot(str(pointer.id))
            if fleet is None:
                continue
            for domain in fleet.domains:
                urls = [str(b.serving_url) for b in inference_bindings(domain) if b.serving_url]
                plain = [u for u in urls if u.startswith("http://") and not is_loopback_url(u)]
                if plain:
                    clear.append((fleet.slug, domain, str(URL(plain[0]).origin())))
    except HaruDbError as exc:
        logger.warning("could not check domains for plain-HTTP serving endpoints at boot: %s", exc)
        return
    for fleet_slug, domain, origin in clear:
        if allowed or domain.provider is Provider.SKYSERVE:
            why = (
                "a skyserve endpoint has no certificate"
                if domain.provider is Provider.SKYSERVE and not allowed
                else "HARU_ALLOW_PLAINTEXT is set"
            )
            logger.warning(
                "domain %s of fleet %s: serving endpoint %s is reached in CLEAR TEXT (every "
                "prompt, completion and its serving credential readable on the network; %s)",
                domain.slug,
                fleet_slug,
                origin,
                why,
            )
        else:
            logger.error(
                "domain %s of fleet %s: serving endpoint %s is plain HTTP on another host: every "
                "request routed to it is refused (502) until it serves https:// or "
                "HARU_ALLOW_PLAINTEXT=1 allows clear text on a private network",
                domain.slug,
                fleet_slug,
                origin,
            )


async def warn_auto_failover_outside_loop(store: StateStore, loop: ReconcileLoop) -> None:
    if loop.fleet_refs is None:
        return
    try:
        uncovered = []
        for pointer in await store.list_fleets():
            fleet = await store.get_fleet_snapshot(str(pointer.id))
            if fleet is not None and fleet.policy.auto_failover and not await loop.covers(fleet.id):
                uncovered.append(fleet.slug)
    except HaruDbError as exc:
        logger.warning("could not check fleets for autoFailover at boot: %s", exc)
        return
    if uncovered:
        logger.warning(
            "!!! autoFailover is ON for fleet(s) %s but HARU_RECONCILE_FLEETS (%s) does not name "
            "them: NOTHING will fail over there, and promote/demote are refused (409 "
            "fleet_not_reconciled). Add them, or unset HARU_RECONCILE_FLEETS (every fleet).",
            ", ".join(uncovered),
            ",".join(loop.fleet_refs),
        )
