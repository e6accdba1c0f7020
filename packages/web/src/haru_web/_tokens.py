"""Bearer tokens from the environment or a file: one rule for both services.

A token read from a file follows it (:class:`TokenSource`): a rotation needs no restart.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from haru_protocol import bearer_matches

from haru_web._errors import HaruWebError

logger = logging.getLogger(__name__)

MIN_TOKEN_LENGTH: Final = 16
"""Shortest token a service accepts: a short one is guessable, and as a substring it is
everywhere (a token ``bin`` is inside ``PATH``)."""

FILE_SUFFIX: Final = "_FILE"


class TokenConfigError(HaruWebError, ValueError):
    """A token variable, or the file it points to, is unusable (a start-up error)."""


def check_token(value: str | None, *, name: str) -> str | None:
    """Trim ``value``; blank means no token; shorter than 16 characters is refused.

    Raises:
        TokenConfigError: The token is too short (the message never contains it).
    """
    if value is None:
        return None
    token = value.strip()
    if not token:
        return None
    if len(token) < MIN_TOKEN_LENGTH:
        raise TokenConfigError(
            f"{name} is {len(token)} characters long; use at least {MIN_TOKEN_LENGTH} "
            "(for example: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


def resolve_token(env: Mapping[str, str], name: str) -> str | None:
    """The token of variable ``name``, or of the file named by ``<name>_FILE``.

    A file keeps the token out of the process environment (which same-user processes can read
    from ``/proc/<pid>/environ``); its content is trimmed. Setting both is refused.

    Raises:
        TokenConfigError: Both are set, the file cannot be read, or the token is too short.
    """
    file_name = name + FILE_SUFFIX
    inline = env.get(name, "").strip()
    path = env.get(file_name, "").strip()
    if inline and path:
        raise TokenConfigError(f"set either {name} or {file_name}, not both")
    if not path:
        return check_token(inline, name=name)
    return _read_token(Path(path).expanduser(), name=file_name)


RECHECK_S: Final = 1.0
"""A token file is looked at (one ``stat``) at most this often."""

_Signature = tuple[int, int, int, int, int]
"""What says a file changed: device, inode, size, modification and status-change times (ns;
the latter moves on ``chmod`` too, so a file made readable again is looked at)."""


_UNKNOWN: Final[_Signature] = (-1, -1, -1, -1, -1)


def _signature(path: Path) -> _Signature | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class TokenSource:
    """A bearer token that follows its file: rotated without a restart.

    A source made from a file re-reads it when its device, inode, size, modification or
    status-change time changes, looked at (one ``stat``) at most once per ``recheck_s`` of
    ``monotonic``, so asking it on every request is cheap. A new content that cannot be read,
    is blank or is too short is not used: the previous token stays and one WARNING names the
    file (never a token); the file is read again once it changes again. A source made from a
    literal token (:meth:`constant`) never changes.

    With ``overlap_s``, :meth:`matches` also accepts the token the file held before its last
    change, for ``overlap_s`` after the change was seen: the side that checks tokens can take
    the new one first while its callers still present the old one.

    Args:
        token: The token in use now (already read and checked).
        path: The file it came from (re-read at the first look); None: a constant source.
        name: The variable naming the file (``HARU_API_TOKEN_FILE``), for log lines.
        monotonic: Seconds that only go forward (tests inject a fake).
        recheck_s: Shortest time between two looks at the file.
        overlap_s: How long the previous token keeps matching after a change (0: never).
    """

    def __init__(
        self,
        token: str,
        *,
        path: Path | None = None,
        name: str = "the token file",
        monotonic: Callable[[], float] = time.monotonic,
        recheck_s: float = RECHECK_S,
        overlap_s: float = 0.0,
    ) -> None:
        self._token = token
        self._path = path
        self._name = name
        self._mono = monotonic
        self._recheck_s = recheck_s
        self._overlap_s = overlap_s
        self._lock = threading.Lock()
        self._checked = monotonic()
        # Unknown until read here: the first look re-reads the file (``token`` may be older).
        self._signature: _Signature | None = _UNKNOWN
        self._previous: str | None = None
        self._changed_at = 0.0

    @classmethod
    def constant(cls, token: str) -> TokenSource:
        """A source that always answers ``token`` (a literal from the environment)."""
        return cls(token)

    @classmethod
    def from_file(
        cls,
        path: Path,
        *,
        name: str,
        monotonic: Callable[[], float] = time.monotonic,
        recheck_s: float = RECHECK_S,
        overlap_s: float = 0.0,
    ) -> TokenSource:
        """Read ``path`` now and follow it from then on.

        Raises:
            TokenConfigError: The file cannot be read, is empty or holds a token too short.
        """
        path = path.expanduser()
        # The signature is taken before the read: a change in between is seen at the next look.
        signature = _signature(path)
        token = _read_token(path, name=name)
        source = cls(
            token,
            path=path,
            name=name,
            monotonic=monotonic,
            recheck_s=recheck_s,
            overlap_s=overlap_s,
        )
        source._signature = signature
        return source

    @property
    def path(self) -> Path | None:
        """The file followed (None: a constant source)."""
        return self._path

    def current(self) -> str:
        """The token in use now (the file is looked at when a look is due)."""
        if self._path is not None:
            self._refresh(self._path)
        return self._token

    def matches(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header presents the token (constant time).

        Within the overlap after a change, the previous token matches too.
        """
        if bearer_matches(authorization, self.current()):
            return True
        previous = self._previous
        if previous is None or self._mono() - self._changed_at >= self._overlap_s:
            return False
        return bearer_matches(authorization, previous)

    def _refresh(self, path: Path) -> None:
        now = self._mono()
        if now - self._checked < self._recheck_s:
            return
        with self._lock:
            if now - self._checked < self._recheck_s:
                return
            self._checked = now
            signature = _signature(path)
            if signature == self._signature:
                return
            self._signature = signature
            try:
                token = _read_token(path, name=self._name)
            except TokenConfigError as exc:
                logger.warning("%s; keeping the previous token", exc)
                return
            if hmac.compare_digest(token.encode(), self._token.encode()):
                return  # rewritten with the same token
            self._previous, self._token, self._changed_at = self._token, token, now
            if self._overlap_s > 0:
                logger.info(
                    "%s changed: the new token is in use; the previous one is accepted "
                    "for %.0f s more",
                    self._name,
                    self._overlap_s,
                )
            else:
                logger.info("%s changed: the new token is in use", self._name)


def _read_token(path: Path, *, name: str) -> str:
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise TokenConfigError(f"{name}: cannot read {str(path)!r}: {reason}") from None
    token = check_token(content, name=f"the token in {name} ({str(path)!r})")
    if token is None:
        raise TokenConfigError(f"{name}: {str(path)!r} is empty")
    return token


def token_source(
    env: Mapping[str, str],
    name: str,
    *,
    monotonic: Callable[[], float] = time.monotonic,
    overlap_s: float = 0.0,
) -> TokenSource | None:
    """The source of variable ``name``: its file (``<name>_FILE``, followed) or its value.

    A literal value makes a constant source; None when neither is set. The rules of
    :func:`resolve_token` apply.

    Raises:
        TokenConfigError: Both are set, the file cannot be read, or the token is too short.
    """
    path = env.get(name + FILE_SUFFIX, "").strip()
    if path and not env.get(name, "").strip():
        return TokenSource.from_file(
            Path(path), name=name + FILE_SUFFIX, monotonic=monotonic, overlap_s=overlap_s
        )
    token = resolve_token(env, name)
    return None if token is None else TokenSource.constant(token)
