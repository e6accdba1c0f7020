"""``GET /readyz``: whether this server should receive traffic (liveness is ``/healthz``).

Ready when the state store answers, its schema is at this code's head revision, this host's
clock is within ``HARU_MAX_CLOCK_SKEW_MS`` of the database's (when the server samples it),
the background reconcile loop (unless ``HARU_RECONCILE_INTERVAL_MS`` turns it off) is ticking,
and the server is not draining after a stop signal (``HARU_SHUTDOWN_DRAIN_MS``). Otherwise
503 ``not_ready`` in the error envelope, its message saying why.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from haru_db import HaruDbError, SchemaOutdatedError, SchemaTooNewError, check_schema
from haru_protocol import ErrorCode, Readiness
from haru_web import ApiError

from haru_server._keys import (
    control_plane_key,
    draining_key,
    schema_gate_key,
    store_clock_key,
    store_key,
)

ready_routes = web.RouteTableDef()


def _not_ready(reason: str) -> ApiError:
    return ApiError(ErrorCode.NOT_READY, f"not ready: {reason}")


@ready_routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    if request.app[draining_key].is_set():
        raise _not_ready("draining: this server is stopping")
    store = request.app[store_key]
    checks = ["state store"]
    try:
        await store.ping()
        checks.append("schema at head")
        # A fresh connection, bounded like any store call: a newer release may have migrated
        # the shared database under this process, which must then stop taking traffic.
        async with asyncio.timeout(store.call_timeout_s):
            await check_schema(store.url)
    except SchemaTooNewError as exc:
        # This process stops reconciling at once, not only at its gate's next own check.
        gate = request.app.get(schema_gate_key)
        if gate is not None:
            gate.saw(exc)
        raise _not_ready(f"state store schema: {exc}") from None
    except SchemaOutdatedError as exc:
        raise _not_ready(f"state store schema: {exc}") from None
    except HaruDbError as exc:
        raise _not_ready(f"state store: {exc}") from None
    except TimeoutError:
        raise _not_ready("state store: the schema check timed out") from None
    gate = request.app.get(schema_gate_key)
    if gate is not None:
        gate.saw(None)
    clock = request.app[store_clock_key]
    if clock is not None:
        checks.append("clock")
        if not clock.synced:
            # Read it now: a store that was down at start-up may answer by now.
            await clock.sample()
        reason = clock.refusal()
        if reason is not None:
            raise _not_ready(reason)
    loop = request.app[control_plane_key].loop
    if loop is not None:
        checks.append("reconcile loop")
        reason = loop.stalled(time.monotonic())
        if reason is not None:
            raise _not_ready(reason)
    return web.json_response(text=Readiness(checks=tuple(checks)).model_dump_json())
