"""A small HTTP client of the control API, used by the ``haru`` CLI."""

from __future__ import annotations

import json
import ssl
from types import TracebackType
from typing import Self, TypeVar
from uuid import UUID

import aiohttp
from haru_protocol import (
    AcceptedResponse,
    AlreadyActiveResponse,
    ApplyResponse,
    ClientKeyCreated,
    ClientKeyList,
    ClientKeyView,
    DomainActionResponse,
    DomainStatusResponse,
    EventList,
    FleetList,
    FleetPolicyResponse,
    FleetSnapshot,
    Operation,
    OperationKind,
    OperationRequestResponse,
    PeerModel,
    ReconcileResponse,
    bearer_header,
    join_url,
)
from haru_supervisor_client import is_loopback_url
from pydantic import TypeAdapter, ValidationError

from haru_server._errors import HaruServerError

_M = TypeVar("_M", bound=PeerModel)
_REQUEST_RESPONSE: TypeAdapter[AlreadyActiveResponse | AcceptedResponse] = TypeAdapter(
    OperationRequestResponse
)


class ControlApiError(HaruServerError):
    """The control API could not be reached or answered with an error.

    Attributes:
        status: The HTTP status, or None when no answer came.
        code: The error envelope's code, when there was one.
        unreachable: No answer came (connection refused, name not resolved, no answer in time).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        unreachable: bool = False,
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.unreachable = unreachable


class ControlClient:
    """Typed calls to a running control server.

    Args:
        base_url: The server, e.g. ``http://127.0.0.1:8700``.
        token: ``HARU_API_TOKEN`` of that server, if it has one.
        timeout_s: Bound of each call.
        ssl_context: Verifies an ``https://`` server (a CA bundle, maybe a client certificate);
            None = the system trust store.
        allow_plaintext: Allow ``http://`` to a host other than loopback (a private network);
            otherwise every call there is refused before anything (the token) is sent.
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None,
        timeout_s: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
        allow_plaintext: bool = False,
    ) -> None:
        self._base_url = base_url
        self._headers = bearer_header(token)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._allow_plaintext = allow_plaintext

    async def __aenter__(self) -> Self:
        self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fleets(self) -> FleetList:
        """``GET /v1/fleets``."""
        return parse_or_raise(FleetList, await self._call("GET", "/v1/fleets"))

    async def fleet(self, ref: str) -> FleetSnapshot:
        """``GET /v1/fleets/{ref}``."""
        return parse_or_raise(FleetSnapshot, await self._call("GET", _fleet_path(ref)))

    async def operation(self, ref: str, operation_id: UUID) -> Operation:
        """``GET /v1/fleets/{ref}/operations/{id}``."""
        raw = await self._call("GET", f"{_fleet_path(ref)}/operations/{operation_id}")
        return parse_or_raise(Operation, raw)

    async def events(self, ref: str, *, after: int = 0, limit: int = 100) -> EventList:
        """``GET /v1/fleets/{ref}/events``."""
        raw = await self._call(
            "GET", f"{_fleet_path(ref)}/events", params={"after": after, "limit": limit}
        )
        return parse_or_raise(EventList, raw)

    async def reconcile(self, ref: str) -> ReconcileResponse:
        """``POST /v1/fleets/{ref}/reconcile``."""
        raw = await self._call("POST", f"{_fleet_path(ref)}/reconcile", body={})
        return parse_or_raise(ReconcileResponse, raw)

    async def set_policy(self, ref: str, patch: dict[str, object]) -> FleetPolicyResponse:
        """``PATCH /v1/fleets/{ref}/policy`` (a null value clears the operator's value)."""
        raw = await self._call("PATCH", f"{_fleet_path(ref)}/policy", body=patch)
        return parse_or_raise(FleetPolicyResponse, raw)

    async def apply(
        self,
        ref: str,
        layout: dict[str, object],
        *,
        dry_run: bool,
        revisions: list[dict[str, object]] | None = None,
    ) -> ApplyResponse:
        """``POST /v1/fleets/{ref}/apply`` (``dry_run``: only the plan)."""
        body: dict[str, object] = {"layout": layout, "dryRun": dry_run}
        if revisions is not None:
            body["revisions"] = revisions
        raw = await self._call("POST", f"{_fleet_path(ref)}/apply", body=body)
        return parse_or_raise(ApplyResponse, raw)

    async def create_key(
        self,
        name: str,
        *,
        fleets: list[str] | None = None,
        models: list[str] | None = None,
        rpm: int | None = None,
    ) -> ClientKeyCreated:
        """``POST /v1/keys``: a new inference client key (its ``secret`` shown this once)."""
        body: dict[str, object] = {"name": name, "fleets": fleets, "models": models, "rpm": rpm}
        raw = await self._call("POST", "/v1/keys", body=body)
        return parse_or_raise(ClientKeyCreated, raw)

    async def keys(self) -> ClientKeyList:
        """``GET /v1/keys``."""
        return parse_or_raise(ClientKeyList, await self._call("GET", "/v1/keys"))

    async def revoke_key(self, key_id: UUID) -> ClientKeyView:
        """``DELETE /v1/keys/{id}``."""
        raw = await self._call("DELETE", f"/v1/keys/{key_id}")
        return parse_or_raise(ClientKeyView, raw)

    async def domain_status(self, ref: str, domain: str) -> DomainStatusResponse:
        """``GET /v1/fleets/{ref}/domains/{domain}``."""
        raw = await self._call("GET", f"{_fleet_path(ref)}/domains/{_segment(domain)}")
        return parse_or_raise(DomainStatusResponse, raw)

    async def domain_action(self, ref: str, domain: str, action: str) -> DomainActionResponse:
        """``POST /v1/fleets/{ref}/domains/{domain}/up`` or ``/down``."""
        raw = await self._call(
            "POST", f"{_fleet_path(ref)}/domains/{_segment(domain)}/{action}", body={}
        )
        return parse_or_raise(DomainActionResponse, raw)

    async def request_operation(
        self, ref: str, kind: OperationKind, target_domain_id: UUID
    ) -> AlreadyActiveResponse | AcceptedResponse:
        """``POST /v1/fleets/{ref}/promote`` or ``.../demote``."""
        raw = await self._call(
            "POST",
            f"{_fleet_path(ref)}/{kind.value}",
            body={"targetDomainId": str(target_domain_id)},
        )
        try:
            return _REQUEST_RESPONSE.validate_json(raw)
        except ValidationError as exc:
            raise ControlApiError(f"unexpected answer from the server: {exc}") from exc

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, object] | None = None,
        params: dict[str, int] | None = None,
    ) -> bytes:
        if self._session is None:
            raise RuntimeError("use ControlClient as an async context manager")
        url = join_url(self._base_url, path)
        if url.startswith("http://") and not self._allow_plaintext and not is_loopback_url(url):
            raise ControlApiError(
                f"refusing plain HTTP to {self._base_url}: the token and every answer would "
                "cross the network in clear text; use https:// (HARU_CA_FILE names a private "
                "CA) or set HARU_ALLOW_PLAINTEXT=1 on a private network"
            )
        try:
            async with self._session.request(
                method, url, json=body, params=params, allow_redirects=False, ssl=self._ssl
            ) as response:
                raw = await response.read()
                status = response.status
        except TimeoutError as exc:
            raise ControlApiError(f"{method} {url}: no answer in time", unreachable=True) from exc
        except aiohttp.ClientConnectorCertificateError as exc:
            cert_error = exc.certificate_error
            reason = getattr(cert_error, "verify_message", None) or str(cert_error)
            raise ControlApiError(
                f"TLS: the server at {self._base_url} failed verification: {reason} "
                "(HARU_CA_FILE names the CA to trust)",
                unreachable=True,
            ) from exc
        except aiohttp.ClientError as exc:
            raise ControlApiError(
                f"cannot reach the server at {self._base_url}: {exc}", unreachable=True
            ) from exc
        if status >= 400:
            code, message = _envelope(raw)
            raise ControlApiError(
                f"{method} {path}: {status} {code or ''}: {message}".replace(" :", ":"),
                status=status,
                code=code,
            )
        return raw


def _segment(value: str) -> str:
    if not value or "/" in value or value in (".", ".."):
        raise ControlApiError(f"invalid domain reference {value!r}")
    return value


def _fleet_path(ref: str) -> str:
    if not ref or "/" in ref or ref in (".", ".."):
        raise ControlApiError(f"invalid fleet reference {ref!r}")
    return f"/v1/fleets/{ref}"


def _envelope(raw: bytes) -> tuple[str | None, str]:
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None, raw[:200].decode("utf-8", "replace")
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict):
        return None, raw[:200].decode("utf-8", "replace")
    code, message = error.get("code"), error.get("message")
    return (code if isinstance(code, str) else None, message if isinstance(message, str) else "")


def parse_or_raise(model: type[_M], raw: bytes) -> _M:
    """Validate a response body, turning a mismatch into :class:`ControlApiError`."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise ControlApiError(f"unexpected {model.__name__} from the server: {exc}") from exc
