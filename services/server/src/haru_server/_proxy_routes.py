"""Pure pieces of the inference proxy: the per-snapshot route table and body inspection."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
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
    ModelBinding,
    OperationStep,
    Policy,
    Provider,
    UrlJoinError,
    join_url,
    normalize_token,
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


class CredentialError(ValueError):
    """A model's serving credential cannot be read (the message names where, never a value)."""


@dataclass(frozen=True, slots=True)
class ServingCredentials:
    """Where the proxy finds the credential it presents to each upstream.

    Attributes:
        provisioned: ``HARU_SERVING_TOKEN``: presented to every provisioned (``skypilot``,
            ``skyserve``) domain's gateway; None = nothing is presented there.
        environ: The server's environment, where a static binding's ``apiKeyEnv`` is read.
    """

    provisioned: str | None = None
    environ: Mapping[str, str] = field(default_factory=dict)

    def authorization(self, provider: Provider, binding: ModelBinding) -> str | None:
        """The ``Authorization`` value for ``binding``'s upstream, or None for none.

        Raises:
            CredentialError: The binding names a variable that is unset or blank, or a file
                that cannot be read or is blank.
        """
        if provider is not Provider.STATIC:
            return None if self.provisioned is None else f"Bearer {self.provisioned}"
        if binding.api_key_env is not None:
            token = normalize_token(self.environ.get(binding.api_key_env))
            if token is None:
                raise CredentialError(f"apiKeyEnv {binding.api_key_env!r} is unset or blank")
            return f"Bearer {token}"
        if binding.api_key_file is not None:
            try:
                text = Path(binding.api_key_file).expanduser().read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise CredentialError(
                    f"apiKeyFile {binding.api_key_file!r} cannot be read ({type(exc).__name__})"
                ) from None
            token = normalize_token(text)
            if token is None:
                raise CredentialError(f"apiKeyFile {binding.api_key_file!r} is blank")
            return f"Bearer {token}"
        return None


class RouteTable:
    """Routing facts derived once per cached snapshot, so a cache hit costs dict lookups only.

    Eligibility is decided by :func:`haru_core.find_routable_binding` for every model the
    active domain binds; upstream URLs are joined with :func:`haru_protocol.join_url` (path
    prefix and query of the ``servingUrl`` kept) and parsed once, and each upstream's serving
    credential (:class:`ServingCredentials`) is read once. A model whose credential cannot be
    read is left unavailable (logged), never sent without it.

    Attributes:
        snapshot: The snapshot the table was built from.
        fleet_slug: The fleet's slug (for messages).
        routable: The active domain exists and is ready or degraded.
        models: Names of the active domain's eligible models, in layout order.
        bound: Names of every model the active domain binds, eligible or not.
        known: Names of every model any domain binds (metric labels of answers that fail).
    """

    __slots__ = (
        "_auth",
        "_origins",
        "_targets",
        "bound",
        "fleet_slug",
        "known",
        "models",
        "routable",
        "snapshot",
    )

    def __init__(
        self, snapshot: FleetSnapshot, credentials: ServingCredentials | None = None
    ) -> None:
        self.snapshot = snapshot
        self.fleet_slug = snapshot.slug
        active = snapshot.active_domain
        self.routable = active is not None and active.state in ROUTABLE_DOMAIN_STATES
        self.models: tuple[str, ...] = tuple(m.name for m in routable_models(snapshot))
        self._targets: dict[str, dict[str, URL]] = {}
        self._origins: dict[str, str] = {}
        self._auth: dict[str, str] = {}
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
            if credentials is not None:
                try:
                    auth = credentials.authorization(active.provider, binding)
                except CredentialError as exc:
                    logger.error(  # noqa: TRY400 -- the message is the reason
                        "fleet %s: model %r has no usable serving credential: %s",
                        snapshot.slug,
                        bound.name,
                        exc,
                    )
                    continue
                if auth is not None:
                    self._auth[binding.name] = auth
            self._targets[binding.name] = urls
            # Logged instead of the full URL: a servingUrl's query may carry a credential.
            self._origins[binding.name] = str(urls[CHAT_PATH].origin())

    def unserved(self, model: str) -> bool:
        """Whether the routable active binds ``model`` but no eligible slot serves it now.

        Its slot is failed (a crashed or unanswering vLLM server) or mid-transition: the model
        exists, so this is an outage to wait out (503, holdable), not an unknown model (404).
        """
        return self.routable and model in self.bound and model not in self._targets

    def authorization(self, model: str) -> str | None:
        """The ``Authorization`` header the proxy sends to ``model``'s upstream, if any."""
        return self._auth.get(model)

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
