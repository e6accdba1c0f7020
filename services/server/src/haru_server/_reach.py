"""How a connection ended (:class:`haru_core.Reach`): a bounded TCP connect, a failed call.

The reconciler uses it on the active domain's serving endpoints when the domain's supervisor
refused the heartbeat's connection: an endpoint that refuses too, or has no route, is part of
the proof that the host is gone. Nothing is sent; the connection is closed at once.
"""

from __future__ import annotations

import asyncio
import socket
from contextlib import suppress

from haru_core import Reach
from haru_supervisor_client import (
    SupervisorCallError,
    SupervisorConnectError,
    SupervisorRejectedError,
    SupervisorTimeoutError,
    connect_failure,
)

ENDPOINT_CONNECT_TIMEOUT_S = 1.0
"""Bound of one serving-endpoint connect (all its addresses together)."""


async def connect_reach(host: str, port: int, *, timeout_s: float) -> Reach:
    """Connect to ``host:port`` once per resolved address, within ``timeout_s`` in all.

    ``answered`` as soon as one address accepts. Otherwise ``refused`` or ``no_route`` only
    when every address failed that way (the first such reason), ``connect_timeout`` when the
    bound ran out, ``broken`` for anything else (a name that does not resolve, say).
    """
    loop = asyncio.get_running_loop()
    failures: list[Reach] = []
    try:
        async with asyncio.timeout(timeout_s):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            for family, kind, proto, _, address in infos:
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, address)
                except OSError as exc:
                    failure = connect_failure(exc)
                    failures.append(Reach.BROKEN if failure is None else Reach(failure))
                    continue
                finally:
                    with suppress(OSError):
                        sock.close()
                return Reach.ANSWERED
    except TimeoutError:
        return Reach.CONNECT_TIMEOUT
    except OSError:
        return Reach.BROKEN
    strong = [f for f in failures if f is not Reach.BROKEN]
    if failures and len(strong) == len(failures):
        return strong[0]
    return Reach.BROKEN


def reach_of_call_error(exc: SupervisorCallError) -> Reach:
    """How a failed heartbeat's connection ended (only refused / no route are strong)."""
    if isinstance(exc, SupervisorConnectError):
        return Reach(exc.reason)
    if isinstance(exc, SupervisorTimeoutError):
        # A connect nobody answered and a slow answer both end here: weak either way.
        return Reach.SLOW
    if isinstance(exc, SupervisorRejectedError):
        return Reach.ANSWERED  # an error status came from the host
    return Reach.BROKEN  # TLS, plain HTTP refused, a reset after connecting, a bad answer
