"""Container health check: ``python healthcheck.py PATH DEFAULT_PORT`` (``/healthz``, ``8700``).

Calls the service in this container on the address and port it was configured with
(``HARU_HOST``, ``PORT``; the wildcard addresses are reached over loopback) and exits 0 on a
200 answer, 1 otherwise. Standard library only: the images have no curl.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

_WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def url(path: str, environ: dict[str, str], default_port: str) -> str:
    """The URL of ``path`` on this container's service."""
    host = environ.get("HARU_HOST", "").strip()
    host = _WILDCARDS.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = environ.get("PORT", "").strip() or default_port
    return f"http://{host}:{port}{path}"


def main(argv: list[str]) -> int:
    """Exit status 0 when the route answers 200 within 3 s."""
    path = argv[1] if len(argv) > 1 else "/healthz"
    default_port = argv[2] if len(argv) > 2 else "8700"
    target = url(path, dict(os.environ), default_port)
    try:
        with urllib.request.urlopen(target, timeout=3) as response:  # noqa: S310  (http, local)
            return 0 if response.status == 200 else 1
    except (OSError, urllib.error.URLError) as exc:
        sys.stderr.write(f"healthcheck {target}: {exc}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
