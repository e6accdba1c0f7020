"""TLS for Haru's listeners: a certificate and key from files, re-read when they change.

Each new handshake checks the files' modification times (two or three ``stat`` calls); when
one changed, a fresh context is built and that connection and the next ones use it, while
open connections keep theirs. A pair that does not load (a half-written file, a key that does
not match) is logged and the previous certificate stays in service.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from haru_web._errors import HaruWebError

logger = logging.getLogger("haru_web.tls")

TLS_CERT_FILE_VAR: Final = "HARU_TLS_CERT_FILE"
TLS_KEY_FILE_VAR: Final = "HARU_TLS_KEY_FILE"
TLS_CLIENT_CA_FILE_VAR: Final = "HARU_TLS_CLIENT_CA_FILE"


class TlsConfigError(HaruWebError, ValueError):
    """A certificate, key or CA file cannot be used (a boot error; names the file)."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Where a listener's TLS material lives.

    Attributes:
        cert_file: PEM certificate chain (leaf first).
        key_file: PEM private key of the leaf.
        client_ca_file: PEM CA bundle; when set, every client must present a certificate it
            issued (mutual TLS).
    """

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None


def tls_files(
    cert_file: Path | None, key_file: Path | None, client_ca_file: Path | None
) -> TlsFiles | None:
    """The listener's :class:`TlsFiles` from three optional settings; None = plain HTTP.

    Raises:
        TlsConfigError: Only one of the certificate and the key is set, or a client CA
            without them.
    """
    if cert_file is None and key_file is None:
        if client_ca_file is not None:
            raise TlsConfigError(
                f"{TLS_CLIENT_CA_FILE_VAR} needs {TLS_CERT_FILE_VAR} and {TLS_KEY_FILE_VAR}"
            )
        return None
    if cert_file is None or key_file is None:
        raise TlsConfigError(f"set both {TLS_CERT_FILE_VAR} and {TLS_KEY_FILE_VAR}, or neither")
    return TlsFiles(cert_file, key_file, client_ca_file)


def _stamp(path: Path | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """A server-side context: TLS 1.2 or newer, the defaults of :mod:`ssl` for client auth.

    Raises:
        TlsConfigError: A file is missing or unreadable, or the key does not match.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(files.cert_file, files.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsConfigError(
            f"cannot load the TLS certificate {str(files.cert_file)!r} with the key "
            f"{str(files.key_file)!r}: {exc}"
        ) from None
    if files.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=files.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise TlsConfigError(
                f"cannot load the client CA bundle {str(files.client_ca_file)!r}: {exc}"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class ReloadingServerContext:
    """The context a listener is given, swapping in a fresh one when the files change.

    Args:
        files: The certificate, key and optional client CA.

    Raises:
        TlsConfigError: The files do not load at start-up (refuse to listen).
    """

    def __init__(self, files: TlsFiles) -> None:
        self._files = files
        self._lock = threading.Lock()
        self._stamps = self._read_stamps()
        self._current = server_context(files)
        # The listener's context routes each handshake to the current one. OpenSSL keeps the
        # verify mode of the context a connection started with (the certificate, key and CA
        # store come from the swapped-in one), so it is built from the same files.
        self.context = server_context(files)
        self.context.sni_callback = self._on_hello

    def _read_stamps(self) -> tuple[tuple[int, int, int] | None, ...]:
        files = self._files
        return (_stamp(files.cert_file), _stamp(files.key_file), _stamp(files.client_ca_file))

    def current(self) -> ssl.SSLContext:
        """The context for a new connection, rebuilt first if a file changed."""
        stamps = self._read_stamps()
        with self._lock:
            if stamps == self._stamps:
                return self._current
            self._stamps = stamps
            try:
                self._current = server_context(self._files)
            except TlsConfigError as exc:
                # The reason is the message; a traceback adds nothing.
                logger.error("TLS files changed but do not load; still serving the old: %s", exc)  # noqa: TRY400
            else:
                logger.info("TLS certificate reloaded from %s", self._files.cert_file)
            return self._current

    def _on_hello(
        self, connection: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, _ctx: object
    ) -> None:
        # OpenSSL calls this for every ClientHello, with or without SNI.
        connection.context = self.current()
