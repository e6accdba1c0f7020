"""Schemathesis hooks loaded by the fuzz run (``SCHEMATHESIS_HOOKS=st_hooks``).

One extra check: every answer of 400 or more is the ``{"error": {"code", "message"}}`` envelope
with a known code, except an inference answer the upstream itself produced (the proxy streams
those back as they are, DESIGN 7.5; the emulated vLLM marks none of the fuzz cases' answers).
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from haru_protocol import ErrorCode

_CODES = {code.value for code in ErrorCode}


@schemathesis.check
def error_envelope(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: Any
) -> bool | None:
    if response.status_code < 400:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(
            f"{response.status_code} answer is not JSON: {response.content[:200]!r}"
        ) from None
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)):
        raise AssertionError(f"{response.status_code} answer is not the error envelope: {body!r}")
    error = body["error"]
    if set(error) != {"code", "message"} or not isinstance(error["message"], str):
        raise AssertionError(f"malformed envelope: {body!r}")
    if error["code"] not in _CODES:
        raise AssertionError(f"unknown error code {error['code']!r}")
    if error["code"] == "internal_error":
        raise AssertionError(f"internal error: {error['message']}")
    return None
