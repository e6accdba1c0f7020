"""HTTP plumbing the emulated vLLM's route modules share: app key, errors, middlewares, ids.

Error shapes follow vLLM 0.33: OpenAI-style ``{"error": {"message", "type", "param", "code"}}``
for API errors, FastAPI's ``{"detail": "Not Found"}`` for routing errors, and the sim's own
``{"error": {"code", "message"}}`` on its ``/_sim/*`` control routes.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web

from haru_sim._engine import Engine
from haru_sim._engine_waits import ServerClosingError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ENGINE_KEY: Final = web.AppKey("haru_sim_engine", Engine)

CONTROL_PREFIX: Final = "/_sim/"
# vllm/entrypoints/serve/middleware/authenticate.py (0.33.0): only these need the API key.
_GUARDED_PREFIXES: Final = ("/v1", "/v2", "/inference", "/cohere")


class OpenAIError(Exception):
    """Rendered as vLLM's OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type_ = type_
        self.param = param

    def response(self) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.type_,
                "param": self.param,
                "code": self.status,
            }
        }
        return web.json_response(body, status=self.status)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, type_="BadRequestError", param=param)


def internal_error(message: str) -> OpenAIError:
    return OpenAIError(500, message, type_="InternalServerError")


def control_error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def drop_connection(request: web.BaseRequest) -> None:
    transport = request.transport
    if transport is not None:
        transport.close()


# -- middlewares -------------------------------------------------------------------------------


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except OpenAIError as exc:
        return exc.response()
    except ServerClosingError:
        # Like a server process going away: the client sees the connection close.
        drop_connection(request)
        return web.Response(status=503)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # FastAPI's shape for routing errors (404 unknown path, 405 wrong method, 413).
        return web.json_response({"detail": exc.reason}, status=exc.status)


@web.middleware
async def fault_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith(CONTROL_PREFIX):
        return await handler(request)
    engine = request.app[ENGINE_KEY]
    if engine.faults.refuse:
        # The listener is closed; a keep-alive connection opened before must not be served either.
        drop_connection(request)
        return web.Response(status=503)
    resource = request.match_info.route.resource
    if resource is not None:
        engine.requests_served[resource.canonical] += 1
    if engine.faults.hang:
        await engine.wait_while_hung()
    return await handler(request)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    # Like vLLM's AuthenticationMiddleware: OPTIONS and unguarded paths pass.
    api_key = request.app[ENGINE_KEY].config.api_key
    if (
        api_key is not None
        and request.method != "OPTIONS"
        and request.path.startswith(_GUARDED_PREFIXES)
        and request.headers.get("Authorization") != f"Bearer {api_key}"
    ):
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
