"""Opening the upstream request: the target, its credential, TLS and connect failures.

The request goes to the active domain's binding of its model, with the upstream's own
credential (never the client's). ``https://`` is verified (a ``skypilot`` domain's gateway
against its fleet's CA, anything else against ``HARU_SERVING_CA_FILE`` or the system store);
``http://`` beyond loopback is refused unless ``HARU_ALLOW_PLAINTEXT``. A failure is sorted by
whether the request may be held and sent again (:class:`UnansweredError`) or is answered now;
a connect failure asks for a reconcile of the fleet and stamps the active as unreachable
(DESIGN 7.5, 10).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time

import aiohttp
from aiohttp import hdrs, web
from haru_protocol import ErrorCode, Provider
from haru_supervisor_client import connect_failure, is_loopback_url
from haru_web import ApiError
from yarl import URL

from haru_server._access_log import note_route, note_upstream
from haru_server._async_utils import KickDebouncer
from haru_server._pki import FleetPki
from haru_server._proxy_errors import (
    UnansweredError,
    origin,
    routing_headers,
    unroutable,
    unserved,
)
from haru_server._proxy_routes import RouteTable
from haru_server._route_cache import RouteCache
from haru_server._route_entries import RouteLookup
from haru_server._route_http import resolve_route
from haru_server._stamps import ConnectStamps

logger = logging.getLogger(__name__)


class Upstreams:
    """Opens requests to the fleets' active domains over one pooled session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        cache: RouteCache[RouteTable],
        *,
        pki: FleetPki | None,
        allow_plaintext: bool,
        serving_ssl: ssl.SSLContext | None,
        header_timeout_s: float,
        kick: KickDebouncer,
        stamps: ConnectStamps,
    ) -> None:
        self._session = session
        self.cache = cache
        self._pki = pki
        self._allow_plaintext = allow_plaintext
        self._serving_ssl = serving_ssl
        self._header_timeout = header_timeout_s
        self._kick = kick
        self.stamps = stamps

    async def attempt(
        self,
        request: web.Request,
        ref: str,
        model: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
    ) -> tuple[RouteLookup[RouteTable], aiohttp.ClientResponse]:
        """Route the request on the fleet's current pointer and open its upstream answer.

        Raises :class:`UnansweredError` when no server answered and nothing went to the
        client (the request may be held); any other failure is an :class:`ApiError`.
        """
        lookup = await resolve_route(self.cache, ref)
        routes = lookup.routes
        url = routes.target(model, path) if routes.routable else None
        # A model of the fleet's layout keeps its label even when it cannot be served now.
        known = url is not None or model in routes.known
        note_route(request, routes.snapshot, model=model if known else None, stale=lookup.stale)
        if not routes.routable:
            raise UnansweredError(unroutable(lookup), lookup)
        if url is None and routes.unserved(model):
            raise UnansweredError(unserved(lookup, model), lookup)
        if url is None:
            available = ", ".join(routes.models) or "none"
            raise ApiError(
                ErrorCode.MODEL_NOT_FOUND,
                f"model {model[:200]!r} is not available on fleet {routes.fleet_slug!r}; "
                f"available models: {available}",
                headers=routing_headers(lookup),
            )
        auth = routes.authorization(model)
        if auth is not None:
            # The upstream's own credential; the client's Authorization is never forwarded.
            headers = {**headers, hdrs.AUTHORIZATION: auth}
        tls = await self._tls_for(url, lookup)
        sent = time.monotonic()
        upstream = await self._open(url, body, headers, lookup, tls)
        note_upstream(request, routes.origin(model) or origin(url), time.monotonic() - sent)
        return lookup, upstream

    async def _tls_for(
        self, url: URL, lookup: RouteLookup[RouteTable]
    ) -> tuple[ssl.SSLContext | bool, str | None]:
        """The ``ssl`` and ``server_hostname`` of a request to the active domain at ``url``.

        ``http://`` beyond loopback is refused unless ``HARU_ALLOW_PLAINTEXT`` (a ``skyserve``
        endpoint has no certificate to serve: warned about at boot instead). A ``skypilot``
        domain's gateway is trusted by its fleet's CA under the domain's name only; any other
        ``https://`` endpoint by ``HARU_SERVING_CA_FILE`` (else the system store).
        """
        active = lookup.snapshot.active_domain
        slug = lookup.routes.fleet_slug
        if url.scheme == "http":
            if (
                self._allow_plaintext
                or is_loopback_url(str(url))
                or (active is not None and active.provider is Provider.SKYSERVE)
            ):
                return True, None
            raise ApiError(
                ErrorCode.UPSTREAM_UNREACHABLE,
                f"the model server of fleet {slug!r} is plain HTTP on another host: refused "
                "(prompts, completions and its credential would cross the network in clear "
                "text); serve it over https:// or allow plain HTTP on a private network (the "
                "server's HARU_ALLOW_PLAINTEXT=1)",
                headers=routing_headers(lookup),
            )
        pki = self._pki
        if active is not None and active.provider is Provider.SKYPILOT and pki is not None:
            trust = await pki.domain_trust(lookup.fleet_id, slug, active.slug)
            if trust is None:
                raise ApiError(
                    ErrorCode.UPSTREAM_UNREACHABLE,
                    f"fleet {slug!r} has no CA in the store to verify its domain "
                    f"{active.slug!r} with",
                    headers=routing_headers(lookup),
                )
            return trust.ssl, trust.server_name
        return (self._serving_ssl if self._serving_ssl is not None else True), None

    async def _open(
        self,
        url: URL,
        body: bytes,
        headers: dict[str, str],
        lookup: RouteLookup[RouteTable],
        tls: tuple[ssl.SSLContext | bool, str | None],
    ) -> aiohttp.ClientResponse:
        routing = routing_headers(lookup)
        context, server_name = tls
        try:
            async with asyncio.timeout(self._header_timeout):
                # Never follow a redirect: following re-sends the client's body and headers
                # to wherever the upstream points (another host, an admin route).
                return await self._session.post(
                    url,
                    data=body,
                    headers=headers,
                    allow_redirects=False,
                    ssl=context,
                    server_hostname=server_name,
                )
        except aiohttp.ClientSSLError as exc:
            # A failed verification (foreign CA, wrong name, expired) or handshake: refused,
            # never retried elsewhere nor in clear text. Nothing was sent.
            reason = _tls_reason(exc)
            logger.warning(
                "fleet %s: upstream %s refused: %s", lookup.routes.fleet_slug, origin(url), reason
            )
            raise ApiError(
                ErrorCode.UPSTREAM_UNREACHABLE,
                f"the model server of fleet {lookup.routes.fleet_slug!r} failed TLS "
                f"verification: {reason}",
                headers=routing,
            ) from None
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            # Connect failures (refused, unroutable, connect timeout) mean the active domain's
            # server is not there: ask the reconciler to look now instead of at its next tick.
            self._kick_for(lookup, url, "unreachable", exc)
            active = lookup.snapshot.active_domain_id
            if active is not None and connect_failure(exc) is not None:
                # Refused or no route (never a timeout): every replica's tick sees it.
                self.stamps(lookup.routes.fleet_slug, active)
            # Refused, unroutable or a connect timeout: the body was never sent.
            error = ApiError(
                ErrorCode.UPSTREAM_UNREACHABLE,
                f"the model server of fleet {lookup.routes.fleet_slug!r} is unreachable",
                headers=routing,
            )
            raise UnansweredError(error, lookup) from None
        except TimeoutError:
            raise ApiError(
                ErrorCode.UPSTREAM_TIMEOUT,
                "the model server sent no response headers within "
                f"{int(self._header_timeout * 1000)} ms",
                headers=routing,
            ) from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # The connection closed or was reset before any byte of an answer (a server that
            # died with the request, or while its body was being sent): nothing came back, so
            # it may be sent to the next active, once.
            self._kick_for(lookup, url, "went away before answering", exc)
            error = ApiError(
                ErrorCode.UPSTREAM_UNREACHABLE,
                f"the model server of fleet {lookup.routes.fleet_slug!r} went away before "
                f"answering ({type(exc).__name__})",
                headers=routing,
            )
            raise UnansweredError(error, lookup, reached=True) from None
        except aiohttp.ClientError as exc:
            # An answer that is not HTTP: the server did answer, so it is never sent again.
            logger.warning(
                "fleet %s: upstream %s failed before answering: %s",
                lookup.routes.fleet_slug,
                origin(url),
                exc,
            )
            raise ApiError(
                ErrorCode.UPSTREAM_UNREACHABLE,
                f"the model server of fleet {lookup.routes.fleet_slug!r} failed before "
                f"answering ({type(exc).__name__})",
                headers=routing,
            ) from None

    def _kick_for(
        self, lookup: RouteLookup[RouteTable], url: URL, what: str, exc: BaseException
    ) -> None:
        if self._kick(lookup.fleet_id):
            logger.warning(
                "fleet %s: upstream %s %s (%s); requested a reconcile",
                lookup.routes.fleet_slug,
                origin(url),
                what,
                exc,
            )


def _tls_reason(exc: aiohttp.ClientSSLError) -> str:
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        cert_error = exc.certificate_error
        reason = getattr(cert_error, "verify_message", None) or str(cert_error)
        return f"certificate verification failed: {reason}"
    return f"TLS handshake failed: {exc.os_error}"
