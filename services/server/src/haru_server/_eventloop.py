"""The event loop the server runs on: uvloop where it is installed, else asyncio's own.

``bench/proxy_overhead.py --asyncio`` runs Haru on both side by side: on the development
machine uvloop took about a tenth off the CPU a proxied request costs (docs/BENCHMARKS.md).
uvloop is a dependency of haru-server except on Windows, where it does not exist.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a new event loop (uvloop's when available)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows, or a build without uvloop
        return asyncio.run(main)
    return uvloop.run(main)
