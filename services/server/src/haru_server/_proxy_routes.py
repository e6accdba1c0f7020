"""Pure pieces of the inference proxy: the per-snapshot route table and body inspection."""

from __future__ import annotations

import json
import logging
from typing import Final

from haru_core import (
    PROMOTE_STEPS,
    ROUTABLE_DOMAIN_STATES,
    find_routable_binding,
    inference_bindings,
    routable_models,
    step_budget_ms,
)
from haru_protocol import (
    ErrorCode,
    FleetSnapshot,
    OperationStep,
    Policy,
    UrlJoinError,
    join_url,
)
from haru_web import ApiError
from yarl import URL

logger = logging.getLogger(__name__)

CHAT_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"
EMBEDDINGS_PATH: Final = "/v1/embeddings"
MODELS_PATH: Final = "/v1/models"
UPSTREAM_PATHS: Final = (CHAT_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH)
"""The only paths the proxy ever builds on a binding's ``servingUrl`` (never an admin route)."""
PROXIED_PATHS: Final = frozenset((*UPSTREAM_PATHS, MODELS_PATH))
"""Every inference route the proxy answers (counted and access-logged as such)."""


class RouteTable:
    """Routing facts derived once per cached snapshot, so a cache hit costs dict lookups only.

    Eligibility is decided by :func:`haru_core.find_routable_binding` for every model the
    active domain binds; upstream URLs are joined with :func:`haru_protocol.join_url` (path
    prefix and query of the ``servingUrl`` kept) and parsed once.

    Attributes:
        snapshot: The snapshot the table was built from.
        fleet_slug: The fleet's slug (for messages).
        routable: The active domain exists and is ready or degraded.
        models: Names of the active domain's eligible models, in layout order.
        bound: Names of every model the active domain binds, eligible or not.
        known: Names of every model any domain binds (metric labels of answers that fail).
    """

    __slots__ = (
        "_origins",
        "_targets",
        "bound",
        "fleet_slug",
        "known",
        "models",
        "routable",
        "snapshot",
    )

    def __init__(self, snapshot: FleetSnapshot) -> None:
        self.snapshot = snapshot
        self.fleet_slug = snapshot.slug
        active = snapshot.active_domain
        self.routable = active is not None and active.state in ROUTABLE_DOMAIN_STATES
        self.models: tuple[str, ...] = tuple(m.name for m in routable_models(snapshot))
        self._targets: dict[str, dict[str, URL]] = {}
        self._origins: dict[str, str] = {}
        self.bound: frozenset[str] = frozenset()
        self.known: frozenset[str] = frozenset(
            b.name for domain in snapshot.domains for b in inference_bindings(domain)
        )
        """Every model any domain of the fleet binds (the layout's, so a bounded label set)."""
        if active is None:
            return
        self.bound = frozenset(b.name for b in inference_bindings(active))
        for bound in inference_bindings(active):
            binding = find_routable_binding(snapshot, bound.name)
            if binding is None or binding.serving_url is None:
                continue
            urls = _upstream_urls(binding.serving_url)
            if isinstance(urls, str):
                # The layout validated the URL; a join failing here means stored state that
                # cannot be routed, so the model stays unavailable instead of half-routed.
                logger.error(
                    "fleet %s: model %r has an unusable servingUrl: %s",
                    snapshot.slug,
                    bound.name,
                    urls,
                )
                continue
            self._targets[binding.name] = urls
            # Logged instead of the full URL: a servingUrl's query may carry a credential.
            self._origins[binding.name] = str(urls[CHAT_PATH].origin())

    def unserved(self, model: str) -> bool:
        """Whether the routable active binds ``model`` but no eligible slot serves it now.

        Its slot is failed (a crashed or unanswering vLLM server) or mid-transition: the model
        exists, so this is an outage to wait out (503, holdable), not an unknown model (404).
        """
        return self.routable and model in self.bound and model not in self._targets

    def origin(self, model: str) -> str | None:
        """The scheme, host and port of ``model``'s upstream (for logs), or None."""
        return self._origins.get(model)

    def target(self, model: str, path: str) -> URL | None:
        """The upstream URL of ``path`` for ``model``, or None when it is not eligible."""
        urls = self._targets.get(model)
        return None if urls is None else urls[path]


_UNTIL_FLIP: Final = PROMOTE_STEPS[: PROMOTE_STEPS.index(OperationStep.SWITCH_ACTIVE) + 1]


def promotion_budget_ms(policy: Policy) -> int:
    """How long a promotion may take to move the pointer: its step budgets up to the flip.

    ``stop_training`` + ``verify_gpu`` + ``wake_vllm`` + ``probe`` + ``switch_active``; the
    steps after the flip (draining the old active) do not keep anyone from being served.
    """
    return sum(step_budget_ms(policy, step) for step in _UNTIL_FLIP)


def _upstream_urls(serving_url: str) -> dict[str, URL] | str:
    """Every proxied path joined onto ``serving_url``, or why that is impossible."""
    try:
        return {path: URL(join_url(serving_url, path)) for path in UPSTREAM_PATHS}
    except (UrlJoinError, ValueError) as exc:
        return str(exc)


def model_of(body: bytes) -> str:
    """Read ``model`` from a request body without changing the body.

    Raises:
        ApiError: ``invalid_request`` when the body is not a JSON object or ``model`` is not a
            non-empty string.
    """
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError(
            ErrorCode.INVALID_REQUEST, f"the request body is not valid JSON: {exc}"
        ) from None
    if not isinstance(payload, dict):
        raise ApiError(ErrorCode.INVALID_REQUEST, "the request body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(ErrorCode.INVALID_REQUEST, "'model' must be a non-empty string")
    return model
