"""The server's access log: a line per failed answer, not per request.

aiohttp's default access logger formats a full line (remote, time, request line, status,
size, referer, user agent) for every request at INFO: on the inference proxy's hot path that
was about a sixth of the CPU a proxied request costs (``bench/proxy_overhead.py``). This one
logs, on the ``aiohttp.access`` logger, every answer with a status of 400 or more at INFO and
every other answer only when that logger is set to DEBUG, formatting nothing otherwise.
"""

from __future__ import annotations

import logging

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse


class AccessLog(AbstractAccessLogger):
    """``access_log_class`` of the server's ``AppRunner``."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        status = response.status
        if status >= 400:
            level = logging.INFO
        elif self.logger.isEnabledFor(logging.DEBUG):
            level = logging.DEBUG
        else:
            return
        # The path only: a query string may carry a credential.
        self.logger.log(
            level,
            '%s "%s %s" %d %.1f ms',
            request.remote,
            request.method,
            request.path,
            status,
            time * 1000,
        )
