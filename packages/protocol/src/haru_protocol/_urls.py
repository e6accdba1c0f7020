"""URL joining that can never leave the base URL's origin or path prefix."""

from __future__ import annotations

import functools
from urllib.parse import unquote, urlsplit, urlunsplit

from haru_protocol._errors import HaruProtocolError


class UrlJoinError(HaruProtocolError, ValueError):
    """The requested join would change the origin or escape the base path."""


# Pure in its arguments, and a reconcile tick joins the same few per domain each time.
@functools.lru_cache(maxsize=4096)
def join_url(base: str, path: str) -> str:
    """Append ``path`` to ``base``, keeping the base's path prefix and query string.

    ``join_url("http://h:8000/prefix?k=v", "/v1/chat/completions")`` gives
    ``"http://h:8000/prefix/v1/chat/completions?k=v"``. Unlike :func:`urllib.parse.urljoin`,
    a path with a scheme, an authority, a query, a fragment or a ``..`` segment is refused, so a
    caller can never be steered to another host or to a path outside the prefix.

    Raises:
        UrlJoinError: ``path`` is absolute (has a scheme or host), carries a query or fragment,
            or contains a ``.``/``..`` segment (also percent-encoded, e.g. ``%2e%2e``), or
            ``base`` is not an http(s) URL.
    """
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UrlJoinError(f"base URL {base!r} is not an absolute http(s) URL")
    extra = urlsplit(path)
    if extra.scheme or extra.netloc or path.startswith("//"):
        raise UrlJoinError(f"path {path!r} would change the origin")
    if extra.query or extra.fragment or "?" in path or "#" in path:
        raise UrlJoinError(f"path {path!r} must not carry a query or fragment")
    segments = [s for s in extra.path.split("/") if s]
    # Percent-encoded dot segments count too: HTTP clients (yarl) decode and resolve them.
    if any(unquote(s) in (".", "..") for s in segments):
        raise UrlJoinError(f"path {path!r} must not contain '.' or '..' segments")
    prefix = parts.path.rstrip("/")
    joined = prefix + "/" + "/".join(segments)
    if extra.path.endswith("/") and segments:
        joined += "/"
    return urlunsplit((parts.scheme, parts.netloc, joined, parts.query, ""))
