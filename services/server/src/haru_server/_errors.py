"""Errors of haru-server.

Hierarchy::

    HaruServerError
    ├── SettingsError(ValueError)        (_settings: the environment holds an unusable value)
    ├── FleetNotFoundError               (a fleet reference matches no fleet)
    └── SupervisorError                  (_supervisor: one call to a domain's supervisor failed)
        ├── SupervisorUnauthorizedError  (401/403: the token is missing or wrong)
        ├── SupervisorUnreachableError   (connect failure, reset, refused)
        ├── SupervisorTimeoutError       (no complete answer within the call's bound)
        ├── SupervisorRejectedError      (another non-2xx answer, e.g. 502 from a failed sleep)
        └── SupervisorBadResponseError   (2xx, but not the documented body)

A supervisor failure is never fatal to a reconcile tick: the step that made the call turns it
into a pending, failed or best-effort result.
"""

from __future__ import annotations


class HaruServerError(Exception):
    """Root of haru-server's exceptions."""


class FleetNotFoundError(HaruServerError):
    """No fleet has this id or slug."""

    def __init__(self, ref: str) -> None:
        super().__init__(f"fleet {ref!r} not found")
        self.ref = ref


class SupervisorError(HaruServerError):
    """One call to a supervisor failed.

    Attributes:
        url: The URL that was called (never carries a credential).
    """

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class SupervisorUnauthorizedError(SupervisorError):
    """The supervisor answered 401 or 403: the server's token is missing or wrong."""

    def __init__(self, message: str, *, url: str, status: int) -> None:
        super().__init__(message, url=url)
        self.status = status


class SupervisorUnreachableError(SupervisorError):
    """The supervisor could not be reached (refused, reset, DNS, TLS)."""


class SupervisorTimeoutError(SupervisorError):
    """The supervisor did not answer within the call's bound."""


class SupervisorRejectedError(SupervisorError):
    """The supervisor answered a non-2xx status other than 401/403.

    Attributes:
        status: The HTTP status.
        code: The envelope's error code, when the body carried one.
    """

    def __init__(self, message: str, *, url: str, status: int, code: str | None) -> None:
        super().__init__(message, url=url)
        self.status = status
        self.code = code


class SupervisorBadResponseError(SupervisorError):
    """The supervisor answered 2xx with a body that is not the documented one."""
