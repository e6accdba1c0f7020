"""Optional structured status through SkyPilot's Python SDK (the ``sky`` extra).

SDK calls are asynchronous on SkyPilot's side: each returns a request id that ``sky.get``
waits on. ``sky.get`` blocks with no read timeout (``sky/client/sdk.py``: ``get`` sends
``timeout=(connect, None)``), so it runs in one of this facade's own worker threads
(:data:`SDK_THREADS`, never the event loop's default executor) under a time bound. A call
that overruns is reported as :class:`SkySdkError` and its request is cancelled on the API
server (``sky.api_cancel``), which ends the blocked ``sky.get``; while every worker is still
busy, a new call is refused at once instead of queueing behind them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar

from haru_driver_skypilot._errors import SkySdkError

logger = logging.getLogger(__name__)

StatusSource = Literal["cli", "sdk", "auto"]
"""Where drivers read status from: the ``sky`` CLI (default), the SDK, or the SDK when
SkyPilot's Python package is importable and the CLI otherwise."""

_T = TypeVar("_T")

SDK_THREADS = 2
"""Worker threads of one :class:`SkyPilotSdk`: the most SDK calls that wait at once."""

# Fields the CLI leaves out of `sky status -o json` too: a pickled handle and credentials.
_EXCLUDED_FIELDS = frozenset({"handle", "credentials"})


def sdk_available() -> bool:
    """Whether SkyPilot's Python package (``sky``) can be imported here (it is not imported)."""
    return importlib.util.find_spec("sky") is not None


class SkySdk(Protocol):
    """The status queries drivers make through SkyPilot's SDK (inject a fake in tests)."""

    async def cluster_records(
        self, names: Sequence[str], *, timeout: float, refresh: bool = False
    ) -> list[Mapping[str, object]]:
        """``sky.get(sky.status(cluster_names=names, all_users=True))`` as JSON records.

        ``refresh`` asks the clouds now (``StatusRefreshMode.FORCE``).
        """
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

    def __init__(self, *, threads: int = SDK_THREADS) -> None:
        """Create the facade; raises :class:`SkySdkError` when ``sky`` is not installed.

        Args:
            threads: Worker threads (the most calls waiting on the API server at once).
        """
        if not sdk_available():
            raise SkySdkError("SkyPilot's Python package is not installed (extra `sky`)")
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self._threads = threads
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="haru-sky-sdk"
        )
        self._lock = threading.Lock()
        self._busy = 0

    @property
    def busy(self) -> int:
        """Worker threads still running a call (a timed-out one until its cancel lands)."""
        with self._lock:
            return self._busy

    async def cluster_records(
        self, names: Sequence[str], *, timeout: float, refresh: bool = False
    ) -> list[Mapping[str, object]]:
        wanted = list(names)

        def submit(sky: Any) -> object:
            # `all_users=True`: the CLI forces it when names are given (sky/client/cli/
            # command.py `status`); the SDK's default (False) hides another identity's
            # cluster, which would read as lost.
            kwargs: dict[str, Any] = {"cluster_names": wanted, "all_users": True}
            if refresh:
                common = importlib.import_module("sky.utils.common")
                kwargs["refresh"] = common.StatusRefreshMode.FORCE
            return sky.status(**kwargs)

        def finish(sky: Any, request_id: object) -> list[Mapping[str, object]]:
            return [status_record_to_mapping(r) for r in sky.get(request_id)]

        return await self._call("sky.status", submit, finish, timeout=timeout)

    async def service_records(
        self, names: Sequence[str], *, timeout: float
    ) -> list[Mapping[str, object]]:
        wanted = list(names)

        def submit(sky: Any) -> object:
            serve = importlib.import_module("sky.serve")
            return serve.status(service_names=wanted)

        def finish(sky: Any, request_id: object) -> list[Mapping[str, object]]:
            try:
                records = sky.get(request_id)
            except RuntimeError:
                # As `sky serve status` does: without a serve controller (or with a stopped
                # one) the SDK raises, and that means "no services", not a failure.
                if _serve_controller_down(sky):
                    return []
                raise
            return [service_record_to_mapping(r) for r in records]

        return await self._call("sky.serve.status", submit, finish, timeout=timeout)

    async def _call(
        self,
        what: str,
        submit: Callable[[Any], object],
        finish: Callable[[Any, object], _T],
        *,
        timeout: float,
    ) -> _T:
        with self._lock:
            if self._busy >= self._threads:
                raise SkySdkError(
                    f"{what} refused: {self._busy} earlier SDK calls still wait on the API server"
                )
            self._busy += 1
        submitted: list[object] = []

        def run() -> _T:
            try:
                sky = importlib.import_module("sky")
                request_id = submit(sky)
                submitted.append(request_id)
                return finish(sky, request_id)
            finally:
                with self._lock:
                    self._busy -= 1

        future = asyncio.get_running_loop().run_in_executor(self._executor, run)
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(future)
        except TimeoutError:
            if submitted:
                self._cancel(what, submitted[0])
            raise SkySdkError(f"{what} did not answer within {timeout:g} s") from None
        except SkySdkError:
            raise
        # The SDK raises untyped errors across its boundary (RuntimeError, requests errors,
        # sky.exceptions.*); every one of them means "no trustworthy status".
        except Exception as exc:
            raise SkySdkError(f"{what} failed: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _cancel(what: str, request_id: object) -> None:
        """``sky.api_cancel`` the overdue request, so the worker's ``sky.get`` returns."""

        def cancel() -> None:
            try:
                sky = importlib.import_module("sky")
                sky.api_cancel(request_id, silent=True)
            # Best effort (the bound already held); the SDK raises untyped errors.
            except Exception as exc:  # noqa: BLE001
                logger.warning("cancelling the overdue %s request failed: %s", what, exc)

        threading.Thread(target=cancel, name="haru-sky-sdk-cancel", daemon=True).start()
