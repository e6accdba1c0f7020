"""Configuration and fault knobs of the emulated vLLM server."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypedDict, get_args

from haru_sim._errors import SimConfigError

SleepMode = Literal["abort", "wait", "keep"]
"""How ``POST /sleep`` treats requests in flight (vLLM >= 0.17 ``mode`` query parameter)."""

SLEEP_MODES: tuple[SleepMode, ...] = get_args(SleepMode)
ReasoningField = Literal["reasoning", "reasoning_content"]
"""Where a ``--reasoning-parser`` puts the thinking text: ``reasoning`` (current vLLM) or the
older ``reasoning_content``."""

SLEEP_TAGS: tuple[str, ...] = ("weights", "kv_cache")
"""What a level-1/2 sleep puts to sleep; ``/wake_up?tags=...`` wakes a subset (vLLM's names)."""


class FaultUpdate(TypedDict, total=False):
    """A partial fault change: only the keys given are changed."""

    refuse: bool
    error_500: bool
    hang: bool
    cut_stream_after_chunks: int | None
    slow_first_token_ms: int
    is_sleeping_garbage: bool
    sleep_fails: bool
    wake_fails: bool


@dataclass(frozen=True, kw_only=True)
class Faults:
    """Faults the emulated server injects. All off by default.

    Attributes:
        refuse: Stop listening: new connects get ECONNREFUSED, and a request arriving on an
            already-open keep-alive connection has that connection dropped. Clearing it
            listens again on the same port. Only a server started by :class:`VllmSim` can do this.
        error_500: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` answer
            500 with an OpenAI-style error body.
        hang: Every route except ``/_sim/*`` accepts the request and never answers until the
            fault is cleared (then it is served normally) or the server stops.
        cut_stream_after_chunks: A streaming response is cut after this many SSE events: the
            TCP connection is closed without the final chunk or ``[DONE]``. ``0`` cuts right
            after the response headers. ``None`` = off.
        slow_first_token_ms: Extra delay before the first token of every generation (and
            before an embedding), on top of ``first_token_latency_ms``.
        is_sleeping_garbage: ``GET /is_sleeping`` answers 200 with a JSON body that has no
            ``is_sleeping`` boolean.
        sleep_fails: ``POST /sleep`` answers 500 and changes nothing.
        wake_fails: ``POST /wake_up`` answers 500 and changes nothing.
    """

    refuse: bool = False
    error_500: bool = False
    hang: bool = False
    cut_stream_after_chunks: int | None = None
    slow_first_token_ms: int = 0
    is_sleeping_garbage: bool = False
    sleep_fails: bool = False
    wake_fails: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "cut_stream_after_chunks":
                if value is not None and not _is_int(value, minimum=0):
                    raise SimConfigError(
                        f"cut_stream_after_chunks must be null or an int >= 0, got {value!r}"
                    )
            elif f.name == "slow_first_token_ms":
                if not _is_int(value, minimum=0):
                    raise SimConfigError(f"slow_first_token_ms must be an int >= 0, got {value!r}")
            elif not isinstance(value, bool):
                raise SimConfigError(f"{f.name} must be a boolean, got {value!r}")

    def updated(self, changes: Mapping[str, object]) -> Faults:
        """Return a copy with ``changes`` applied; unknown names raise :class:`SimConfigError`."""
        unknown = sorted(set(changes) - FAULT_NAMES)
        if unknown:
            known = ", ".join(sorted(FAULT_NAMES))
            raise SimConfigError(
                f"unknown fault(s) {', '.join(map(repr, unknown))}; known: {known}"
            )
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]  # validated in __post_init__

    def to_json(self) -> dict[str, object]:
        """The faults as a JSON object (snake_case keys, as accepted by ``POST /_sim/faults``)."""
        return dataclasses.asdict(self)


FAULT_NAMES: frozenset[str] = frozenset(f.name for f in dataclasses.fields(Faults))


@dataclass(frozen=True, kw_only=True)
class VllmSimConfig:
    """Configuration of one emulated vLLM server (one ``vllm serve`` process).

    Attributes:
        served_model_names: ``--served-model-name`` values. Requests must name one of them
            exactly (case-sensitive) or leave ``model`` empty; responses and metrics use the first.
        model: The model path reported as ``root`` in ``/v1/models``; defaults to the first name.
        dev_mode: ``VLLM_SERVER_DEV_MODE=1``: mounts ``/sleep``, ``/wake_up``, ``/is_sleeping``.
            Off, those routes answer 404 like FastAPI.
        sleep_latency_ms: Time a real sleep takes before ``POST /sleep`` answers.
        wake_latency_ms: Time a real wake takes before ``POST /wake_up`` answers.
        first_token_latency_ms: Time to first token of a generation (and the time an
            embedding takes).
        token_latency_ms: Time per generated token after the first.
        tokenize_latency_ms: Time a request spends in the frontend (tokenising) before it
            reaches the engine; meanwhile it is neither running nor waiting.
        step_period_ms: Period of the engine step that refreshes the
            ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` gauges (they also
            refresh when a step finishes a request). Must be > 0.
        max_num_seqs: Running capacity (``--max-num-seqs``); further requests wait, FIFO.
        start_asleep: Start at sleep level 1 (as if ``/sleep?level=1`` had completed).
        legacy_empty_bodies: ``/sleep`` and ``/wake_up`` answer an empty 200 whatever the
            version (vLLM <= 0.31 does so anyway).
        vllm_version: The emulated vLLM release (``GET /version``). It selects the shapes that
            changed: before 0.17 ``/sleep`` takes no ``mode`` and does not pause the
            scheduler; before 0.32 ``/sleep`` and ``/wake_up`` answer an empty 200.
        log_stats: False is ``--disable-log-stats``: ``/metrics`` has no ``vllm:*`` metric.
        api_key: ``--api-key``: ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` need
            ``Authorization: Bearer <key>`` (401 otherwise); other routes stay open.
        reasoning_field: Emulate ``--reasoning-parser``: a chat answer starts with
            ``reasoning_tokens`` tokens of reasoning, put in ``message.<reasoning_field>``;
            an answer cut within them has ``content: null``. None = no reasoning parser.
        reasoning_tokens: How many tokens of reasoning precede the content.
        max_model_len: Reported in ``/v1/models``.
        embedding_dimensions: Length of the vectors ``/v1/embeddings`` returns.
        request_log_size: How many raw inference request bodies are kept for inspection.
        faults: Faults active from the start.
    """

    served_model_names: tuple[str, ...] = ("haru-sim-model",)
    model: str | None = None
    dev_mode: bool = True
    sleep_latency_ms: float = 20.0
    wake_latency_ms: float = 20.0
    first_token_latency_ms: float = 0.0
    token_latency_ms: float = 2.0
    tokenize_latency_ms: float = 1.0
    step_period_ms: float = 2.0
    max_num_seqs: int = 256
    start_asleep: bool = False
    legacy_empty_bodies: bool = False
    vllm_version: str = "0.33.0"
    log_stats: bool = True
    api_key: str | None = None
    reasoning_field: ReasoningField | None = None
    reasoning_tokens: int = 8
    max_model_len: int = 4096
    embedding_dimensions: int = 8
    request_log_size: int = 64
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        # Checked at run time too: the CLI and JSON callers are not type-checked.
        names: object = self.served_model_names
        if not isinstance(names, tuple) or not names:
            raise SimConfigError("served_model_names must be a non-empty tuple of names")
        if any(not isinstance(n, str) or not n for n in names):
            raise SimConfigError(f"served model names must be non-empty strings, got {names!r}")
        if len(set(names)) != len(names):
            raise SimConfigError(f"served model names must be unique, got {names!r}")
        if self.model is not None and not self.model:
            raise SimConfigError("model must be a non-empty string or None")
        for name in (
            "sleep_latency_ms",
            "wake_latency_ms",
            "first_token_latency_ms",
            "token_latency_ms",
            "tokenize_latency_ms",
            "step_period_ms",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise SimConfigError(f"{name} must be a number >= 0, got {value!r}")
        self._check_emulation_options()
        faults: object = self.faults
        if not isinstance(faults, Faults):
            raise SimConfigError(f"faults must be a Faults, got {self.faults!r}")

    def _check_emulation_options(self) -> None:
        if not self.step_period_ms > 0:
            raise SimConfigError(f"step_period_ms must be > 0, got {self.step_period_ms!r}")
        _parse_version(self.vllm_version)
        api_key: object = self.api_key
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise SimConfigError("api_key must be a non-empty string or None")
        if self.reasoning_field not in (None, "reasoning", "reasoning_content"):
            raise SimConfigError(
                "reasoning_field must be None, 'reasoning' or 'reasoning_content', "
                f"got {self.reasoning_field!r}"
            )
        if not isinstance(self.log_stats, bool):
            raise SimConfigError(f"log_stats must be a boolean, got {self.log_stats!r}")
        for name in (
            "max_model_len",
            "embedding_dimensions",
            "request_log_size",
            "max_num_seqs",
            "reasoning_tokens",
        ):
            if not _is_int(getattr(self, name), minimum=1):
                raise SimConfigError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")

    @property
    def primary_model_name(self) -> str:
        """The first served name: the ``model`` of every response and the metrics label."""
        return self.served_model_names[0]

    @property
    def version_tuple(self) -> tuple[int, int, int]:
        """``vllm_version`` as (major, minor, patch); a suffix such as ``rc1`` is ignored."""
        return _parse_version(self.vllm_version)

    @property
    def sleep_pauses(self) -> bool:
        """From vLLM 0.17, ``/sleep`` takes ``mode`` and pauses the scheduler first (vllm#34528)."""
        return self.version_tuple >= (0, 17, 0)

    @property
    def admin_json_bodies(self) -> bool:
        """From vLLM 0.32 ``/sleep`` and ``/wake_up`` answer JSON (not with legacy_empty_bodies)."""
        return self.version_tuple >= (0, 32, 0) and not self.legacy_empty_bodies

    @property
    def model_root(self) -> str:
        """The model path reported as ``root`` by ``/v1/models``."""
        return self.model if self.model is not None else self.served_model_names[0]


_VERSION_RE = re.compile(r"([0-9]+)\.([0-9]+)(?:\.([0-9]+))?")


def _parse_version(version: object) -> tuple[int, int, int]:
    match = _VERSION_RE.match(version) if isinstance(version, str) else None
    if match is None:
        raise SimConfigError(f"vllm_version must look like 0.33.0, got {version!r}")
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def _is_int(value: object, *, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
