"""Optional structured status through SkyPilot's Python SDK (the ``sky`` extra).

SDK calls are asynchronous on SkyPilot's side: each returns a request id that ``sky.get``
waits on. ``sky.get`` blocks, so it runs in a worker thread under a time bound; a call that
overruns is reported as :class:`SkySdkError` (the worker thread finishes on its own).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar

from haru_driver_skypilot._errors import SkySdkError

logger = logging.getLogger(__name__)

StatusSource = Literal["cli", "sdk", "auto"]
"""Where drivers read status from: the ``sky`` CLI (default), the SDK, or the SDK when
SkyPilot's Python package is importable and the CLI otherwise."""

_T = TypeVar("_T")

# Fields the CLI leaves out of `sky status -o json` too: a pickled handle and credentials.
_EXCLUDED_FIELDS = frozenset({"handle", "credentials"})


def sdk_available() -> bool:
    """Whether SkyPilot's Python package (``sky``) can be imported here (it is not imported)."""
    return importlib.util.find_spec("sky") is not None


class SkySdk(Protocol):
    """The status queries drivers make through SkyPilot's SDK (inject a fake in tests)."""

    async def cluster_records(
        self, names: Sequence[str], *, timeout: float
    ) -> list[Mapping[str, object]]:
        """``sky.get(sky.status(cluster_names=names))`` as JSON-shaped records."""
        ...

    async def service_records(
        self, names: Sequence[str], *, timeout: float
    ) -> list[Mapping[str, object]]:
        """``sky.get(sky.serve.status(service_names=names))`` (statuses may be enum members)."""
        ...


def status_record_to_mapping(record: object) -> dict[str, object]:
    """Turn an SDK cluster record into the same dict ``sky status -o json`` prints.

    SkyPilot 0.14 returns ``StatusResponse`` pydantic models; older servers returned dicts.

    Raises:
        SkySdkError: the record is neither.
    """
    if isinstance(record, Mapping):
        return {str(k): v for k, v in record.items() if k not in _EXCLUDED_FIELDS}
    dump = getattr(record, "model_dump", None)
    if callable(dump):
        dumped = dump(mode="json", exclude=set(_EXCLUDED_FIELDS))
        if isinstance(dumped, dict):
            return dumped
    raise SkySdkError(f"unexpected SkyPilot status record type {type(record).__name__}")


def service_record_to_mapping(record: object) -> dict[str, object]:
    """Check that an SDK service record is a dict (SkyPilot 0.14 returns plain dicts).

    Raises:
        SkySdkError: it is not.
    """
    if isinstance(record, Mapping):
        return {str(k): v for k, v in record.items()}
    raise SkySdkError(f"unexpected SkyServe status record type {type(record).__name__}")


def _serve_controller_down(sky: Any) -> bool:
    common = importlib.import_module("sky.utils.common")
    pattern = f"{common.SKY_SERVE_CONTROLLER_PREFIX}*"
    records = sky.get(sky.status(cluster_names=[pattern], all_users=True))
    if not records:
        return True
    status = status_record_to_mapping(records[0]).get("status")
    return getattr(status, "value", status) == "STOPPED"


class SkyPilotSdk:
    """:class:`SkySdk` backed by the installed ``sky`` package (imported on first use)."""

    def __init__(self) -> None:
        """Create the facade; raises :class:`SkySdkError` when ``sky`` is not installed."""
        if not sdk_available():
            raise SkySdkError("SkyPilot's Python package is not installed (extra `sky`)")

    async def cluster_records(
        self, names: Sequence[str], *, timeout: float
    ) -> list[Mapping[str, object]]:
        wanted = list(names)

        def call(sky: Any) -> list[Mapping[str, object]]:
            records = sky.get(sky.status(cluster_names=wanted))
            return [status_record_to_mapping(r) for r in records]

        return await self._call("sky.status", call, timeout=timeout)

    async def service_records(
        self, names: Sequence[str], *, timeout: float
    ) -> list[Mapping[str, object]]:
        wanted = list(names)

        def call(sky: Any) -> list[Mapping[str, object]]:
            serve = importlib.import_module("sky.serve")
            try:
                records = sky.get(serve.status(service_names=wanted))
            except RuntimeError:
                # As `sky serve status` does: without a serve controller (or with a stopped
                # one) the SDK raises, and that means "no services", not a failure.
                if _serve_controller_down(sky):
                    return []
                raise
            return [service_record_to_mapping(r) for r in records]

        return await self._call("sky.serve.status", call, timeout=timeout)

    @staticmethod
    async def _call(what: str, call: Callable[[Any], _T], *, timeout: float) -> _T:
        def run() -> _T:
            sky = importlib.import_module("sky")
            return call(sky)

        try:
            async with asyncio.timeout(timeout):
                return await asyncio.to_thread(run)
        except TimeoutError:
            raise SkySdkError(f"{what} did not answer within {timeout:g} s") from None
        except SkySdkError:
            raise
        # The SDK raises untyped errors across its boundary (RuntimeError, requests errors,
        # sky.exceptions.*); every one of them means "no trustworthy status".
        except Exception as exc:
            raise SkySdkError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
