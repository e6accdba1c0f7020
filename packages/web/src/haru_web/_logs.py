"""One logging setup for both services, and a request id in every line about a request.

Human-readable lines by default, JSON lines (python-json-logger) with ``HARU_LOG_FORMAT=json``.
A request id is accepted from ``X-Request-Id`` when it is sane (bounded, safe characters) or
made up; it is echoed on the answer, kept in a context variable for the duration of the
request (so every log line written while serving it carries it, and every call the service
makes on its behalf can forward it) and written by the access logger.

What is never logged: a token, a prompt or an answer. Log calls name fleets, domains, models,
statuses and durations; bodies stay out.

Both formats escape control characters (CR, LF, ESC, DEL, C1 controls, Unicode line separators
and bidi overrides, lone surrogates) in the message and every extra field, whatever a log call
passed: a client's path, model name or header cannot forge a line or drive the reader's
terminal. Only a traceback keeps its line breaks, each of its lines indented.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, Final, Literal, TextIO

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.typedefs import Handler
from haru_protocol import REQUEST_ID_HEADER, is_request_id
from pythonjsonlogger.json import JsonFormatter

from haru_web._handler import client_address

LogFormat = Literal["text", "json"]
"""``HARU_LOG_FORMAT``: ``text`` (default) or ``json`` (one JSON object per line)."""

LOG_FORMATS: Final[tuple[LogFormat, ...]] = ("text", "json")
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""``HARU_LOG_LEVEL`` values (case-insensitive; default ``INFO``)."""

request_id_key: Final = web.RequestKey("haru_request_id", str)
access_logged_key: Final = web.RequestKey("haru_access_logged", bool)
"""Set by a handler or middleware that wrote a richer access line of its own (the proxy's):
:class:`AccessLogger` then writes none, so a request is logged once."""
"""The request's id (as echoed in ``X-Request-Id``)."""

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "haru_request_id", default=None
)

_TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_JSON_FIELDS: Final = "%(asctime)s %(levelname)s %(name)s %(message)s"
_ACCESS_LOGGER: Final = "aiohttp.access"


_CONTROL: Final = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
"""What never reaches a log line raw: C0/C1 controls and DEL, Unicode line and paragraph
separators, bidirectional overrides (which reorder what a terminal shows), lone surrogates
(undecodable bytes of a header)."""
_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_STANDARD_ATTRS: Final = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
}
_TRACE_INDENT: Final = "    "
_TEXT_FIELDS: Final = ("fleet", "domain", "domain_id", "operation_id", "step")
"""Extra fields the text format appends as ``key=value`` (JSON lines carry every extra)."""


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_control(text: str) -> str:
    r"""``text`` with every control character escaped (``\n``, ``\x1b``, ``\u2028``...)."""
    return _CONTROL.sub(_escape_char, text)


def _escaped_copy(record: logging.LogRecord) -> logging.LogRecord:
    """A copy of ``record`` whose message and extra fields are free of control characters.

    A copy: the other handlers (pytest's included) see the record as it was logged.
    """
    copy = logging.makeLogRecord(record.__dict__)
    copy.msg = escape_control(record.getMessage())
    copy.args = None
    for key, value in record.__dict__.items():
        if key not in _STANDARD_ATTRS and isinstance(value, str):
            setattr(copy, key, escape_control(value))
    copy.exc_text = None  # formatted again by this formatter (another may have cached it raw)
    return copy


def _rfc3339(record: logging.LogRecord) -> str:
    # UTC with milliseconds and a "Z": one unambiguous, sortable time across hosts and zones.
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{stamp}.{int(record.msecs):03d}Z"


def _indented(trace: str) -> str:
    # A traceback keeps its lines, each indented: an exception's text cannot start a line.
    return "\n".join(_TRACE_INDENT + escape_control(line) for line in trace.split("\n"))


def current_request_id() -> str | None:
    """The id of the request being served (or of the reconcile tick running), if any."""
    return _current.get()


def new_request_id() -> str:
    """A fresh request id (32 random hex digits)."""
    return os.urandom(16).hex()  # a quarter of uuid4().hex's cost, on every request


def accept_request_id(value: str | None) -> str:
    """The caller's id when it is sane (see :func:`haru_protocol.is_request_id`), else a new one."""
    if value is not None:
        value = value.strip()
        if is_request_id(value):
            return value
    return new_request_id()


@contextlib.contextmanager
def request_id_scope(request_id: str | None = None) -> Iterator[str]:
    """Run a block under ``request_id`` (given), the current one, or a new one.

    Background work (a reconcile tick of the loop) uses it so its log lines and its calls to
    supervisors share one id; work already under a request keeps that request's id.
    """
    rid = request_id or _current.get() or new_request_id()
    token = _current.set(rid)
    try:
        yield rid
    finally:
        _current.reset(token)


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give the request an id (``X-Request-Id`` when sane, else a new one) for its duration.

    Put it first (outermost) so every other middleware's log lines carry it. The echo on the
    answer is :func:`echo_request_id`'s job (it also reaches streamed answers).
    """
    rid = accept_request_id(request.headers.get(REQUEST_ID_HEADER))
    request[request_id_key] = rid
    token = _current.set(rid)
    try:
        return await handler(request)
    finally:
        _current.reset(token)


async def echo_request_id(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``on_response_prepare`` signal: echo the request's id on its answer."""
    rid = request.get(request_id_key)
    if rid is not None:
        response.headers[REQUEST_ID_HEADER] = rid


def install_request_ids(app: web.Application) -> None:
    """Echo request ids on every answer of ``app`` (add :func:`request_id_middleware` too)."""
    app.on_response_prepare.append(echo_request_id)


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to every record (the current one unless the call passed its own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _current.get()
        return True


class TextFormatter(logging.Formatter):
    """The human format, with the line's context fields appended as ``key=value``.

    They are ``fleet``, ``domain``, ``domain_id``, ``operation_id``, ``step`` (reconciler
    lines) and ``request_id``, each when the line has it.

    Control characters are escaped and a traceback's lines are indented: one record, one
    line starting at column 0.
    """

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info is None and not record.exc_text and not record.stack_info:
            line = self._line(record)
            # The usual case, checked in C on the finished line: nothing to escape.
            if line.isprintable():
                return line
        return self._line(_escaped_copy(record))

    def _line(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        # A field the message already spells out as key=value (the proxy's access line) once.
        fields = [
            f" {key}={value}"
            for key in _TEXT_FIELDS
            if (value := getattr(record, key, None)) is not None
            and f"{key}=" not in str(record.msg)
        ]
        rid = getattr(record, "request_id", None)
        if rid is not None:
            fields.append(f" request_id={rid}")
        if not fields:
            return line
        head, newline, trace = line.partition("\n")
        return f"{head}{''.join(fields)}{newline}{trace}"

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return _rfc3339(record)

    def formatException(self, ei: Any) -> str:  # noqa: N802  (logging's name)
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802  (logging's name)
        return _indented(super().formatStack(stack_info))


class _JsonFormatter(JsonFormatter):
    """python-json-logger's format, with the message and extras escaped like the text one."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return _rfc3339(record)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        # ASCII JSON (ensure_ascii) without a backslash holds no escaped control character.
        if "\\" not in line and "\x7f" not in line:
            return line
        return super().format(_escaped_copy(record))


def _json_formatter() -> logging.Formatter:
    return _JsonFormatter(
        _JSON_FIELDS,
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        timestamp=False,
    )


class AccessLogger(AbstractAccessLogger):
    """One access line per request, with its id; successful reads (polls) only at DEBUG.

    Heartbeats, scrapes and health checks arrive every few seconds: a line each would drown
    the rest. Everything else (writes, errors) is logged at INFO. The path is logged without
    its query string; the peer is the client's address (:func:`client_address`: the direct
    peer unless it is a trusted proxy).
    """

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.get(access_logged_key):
            return
        quiet = request.method in ("GET", "HEAD") and response.status < 400
        level = logging.DEBUG if quiet else logging.INFO
        if not self.logger.isEnabledFor(level):
            return
        peer = client_address(request)
        self.logger.log(
            level,
            "%s %s %d %.3fs peer=%s",
            request.method,
            request.path,
            response.status,
            time,
            peer,
            extra={
                "request_id": request.get(request_id_key),
                "method": request.method,
                "path": request.path,
                "status": response.status,
                "duration_s": round(time, 6),
                "peer": peer,
            },
        )

    @property
    def enabled(self) -> bool:
        # INFO covers DEBUG too (a logger enabled for DEBUG is enabled for INFO).
        return self.logger.isEnabledFor(logging.INFO)


def parse_log_level(value: str | None) -> int:
    """``HARU_LOG_LEVEL`` as a :mod:`logging` level (blank: INFO).

    Raises:
        ValueError: Not one of :data:`LOG_LEVELS`.
    """
    text = (value or "").strip().upper()
    if not text:
        return logging.INFO
    if text not in LOG_LEVELS:
        raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
    level: int = logging.getLevelNamesMapping()[text]
    return level


def parse_log_format(value: str | None) -> LogFormat:
    """``HARU_LOG_FORMAT`` (blank: text).

    Raises:
        ValueError: Neither ``text`` nor ``json``.
    """
    text = (value or "").strip().lower()
    if not text:
        return "text"
    for known in LOG_FORMATS:
        if text == known:
            return known
    raise ValueError(f"must be one of {', '.join(LOG_FORMATS)}")


def configure_logging(
    *, log_format: LogFormat = "text", level: int = logging.INFO, stream: TextIO | None = None
) -> logging.Handler:
    """Install the process's one log handler on the root logger (services' entry points only).

    Replaces any handler the root logger had. Returns the handler (tests remove it again).
    """
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(_json_formatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def configure_startup_logging(env: Mapping[str, str]) -> logging.Handler:
    """Logging for a start-up error found before the settings could be read (a bad environment).

    ``HARU_LOG_FORMAT`` is honoured when it is itself valid (else text), so a JSON deployment
    gets its fatal error as one JSON line like every other.
    """
    try:
        log_format = parse_log_format(env.get("HARU_LOG_FORMAT"))
    except ValueError:
        log_format = "text"
    return configure_logging(log_format=log_format, level=logging.INFO)
