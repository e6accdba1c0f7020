"""The aiohttp application both services start from: one middleware order, one document route.

Outermost first: the request id, the error envelope, what the service adds around its guards,
the browser guard and the bearer gate, then what it adds inside them. The order is the point:
every answer, a refusal included, carries the request id and the envelope, and nothing a
service adds inside the guards runs for a refused request.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Middleware

from haru_web._listener import ListenerSettings
from haru_web._logs import install_request_ids, request_id_middleware
from haru_web._metrics import metrics_guarded
from haru_web._middleware import bearer_middleware, browser_guard_middleware, error_middleware
from haru_web._openapi import OPENAPI_PATH, ApiTable, openapi_handler
from haru_web._tokens import TokenSource

_AIOHTTP_MAX_BODY: Final = 1024**2
"""aiohttp's own ``client_max_size`` default."""


def service_app(
    settings: ListenerSettings,
    token: TokenSource | None,
    table: ApiTable,
    *,
    outer: Sequence[Middleware] = (),
    inner: Sequence[Middleware] = (),
    unguarded: Collection[str] = (),
    client_max_size: int = _AIOHTTP_MAX_BODY,
) -> web.Application:
    """A service's application with its guards in place and ``GET /openapi.json`` routed.

    Args:
        settings: The service's settings: whether a token guards it (no token: browsers are
            kept out, and so are foreign ``Host`` names unless it is open to the network on
            purpose) and whether ``/metrics`` is public.
        token: The guarding token as the bearer gate asks it on every request (a rotated file
            needs no restart); None when the service has none.
        table: The service's route table, served at :data:`OPENAPI_PATH`.
        outer: Middlewares between the error envelope and the guards.
        inner: Middlewares inside the guards.
        unguarded: Paths under ``/v1`` that check their own credential instead of the token.
        client_max_size: The largest request body aiohttp itself reads.
    """
    app = web.Application(
        middlewares=[
            request_id_middleware,
            error_middleware,
            *outer,
            browser_guard_middleware(
                open_api=not settings.guarded, check_host=not settings.open_to_network
            ),
            bearer_middleware(
                token,
                guarded=_except(unguarded, metrics_guarded(public=settings.metrics_public)),
            ),
            *inner,
        ],
        client_max_size=client_max_size,
    )
    install_request_ids(app)
    app.router.add_get(OPENAPI_PATH, openapi_handler(table))
    return app


def _except(paths: Collection[str], guarded: Callable[[str], bool]) -> Callable[[str], bool]:
    if not paths:
        return guarded
    exempt = frozenset(paths)

    def check(path: str) -> bool:
        return path not in exempt and guarded(path)

    return check
