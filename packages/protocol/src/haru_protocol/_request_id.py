"""The request id header: one name and one validity rule for every hop.

Client, server, supervisor and vLLM all see the same ``X-Request-Id``.
"""

from __future__ import annotations

import re
from typing import Final

REQUEST_ID_HEADER: Final = "X-Request-Id"

MAX_REQUEST_ID_LENGTH: Final = 128

# Letters, digits and a few separators: safe in a log line, a JSON string and a header, and
# enough for UUIDs, ULIDs and the ids of common tracing systems.
_REQUEST_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+=/-]*")


def is_request_id(value: str) -> bool:
    """Whether ``value`` is a request id a service accepts from a caller (else it makes one)."""
    return len(value) <= MAX_REQUEST_ID_LENGTH and _REQUEST_ID.fullmatch(value) is not None
