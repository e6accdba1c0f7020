"""Helper run on a provisioned domain's machine (standard library only; copied by ``run``).

``python3 haru_node.py gateway --listen PORT --route MODEL=PORT ...``
    The serving gateway: ``/m/<model>/<path>`` is forwarded to ``127.0.0.1:<port>/<path>`` for
    the inference paths only (``/v1/chat/completions``, ``/v1/completions``,
    ``/v1/embeddings``, ``/v1/models``), streaming the answer, so vLLM's dev-mode admin routes
    (``/sleep``, ``/wake_up``, ...) are never reachable from outside the machine.
    ``GET /health`` answers 200 once every routed server answers its ``/health`` (503 and
    the names of the others before): a SkyServe replica's readiness probe.

A standby's servers start awake: the reconciler puts them to sleep through the supervisor.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FORWARDED = {
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("GET", "/v1/models"),
}
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "host"}


def _handler(routes: dict[str, int]) -> type[BaseHTTPRequestHandler]:
    class Gateway(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _refuse(self, status: int, message: str) -> None:
            body = (f'{{"error": {{"code": "not_found", "message": "{message}"}}}}').encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _health(self) -> None:
            # Every model's server answers /health: what a SkyServe readiness probe asks.
            down = sorted(name for name, port in routes.items() if not _healthy(port))
            status = 503 if down else 200
            body = json.dumps({"ok": not down, "notHealthy": down}).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _forward(self) -> None:
            if self.command == "GET" and self.path.split("?", 1)[0] == "/health":
                self._health()
                return
            parts = self.path.split("?", 1)[0].split("/", 3)
            if len(parts) < 4 or parts[1] != "m" or parts[2] not in routes:
                self._refuse(404, "unknown model")
                return
            path = "/" + parts[3]
            if (self.command, path) not in FORWARDED:
                self._refuse(404, "not an inference route")
                return
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            upstream = http.client.HTTPConnection("127.0.0.1", routes[parts[2]], timeout=3600)
            try:
                upstream.request(self.command, path, body=body, headers=headers)
                answer = upstream.getresponse()
            except OSError:
                self._refuse(502, "model server unreachable")
                return
            self.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in HOP_HEADERS and key.lower() != "content-length":
                    self.send_header(key, value)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            while chunk := answer.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            upstream.close()

        do_GET = _forward  # noqa: N815
        do_POST = _forward  # noqa: N815

        def log_message(self, format: str, *args: object) -> None:
            return None

    return Gateway


def _healthy(port: int) -> bool:
    try:
        url = f"http://127.0.0.1:{port}/health"
        with urllib.request.urlopen(url, timeout=5) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="haru_node.py")
    sub = parser.add_subparsers(dest="command", required=True)
    gateway = sub.add_parser("gateway")
    gateway.add_argument("--host", default="0.0.0.0")
    gateway.add_argument("--listen", type=int, required=True)
    gateway.add_argument("--route", action="append", default=[], metavar="MODEL=PORT")
    args = parser.parse_args(argv)
    routes = {}
    for item in args.route:
        name, _, port = item.rpartition("=")
        routes[name] = int(port)
    server = ThreadingHTTPServer((args.host, args.listen), _handler(routes))
    sys.stdout.write(f"haru-node gateway listening on {args.host}:{server.server_address[1]}\n")
    sys.stdout.flush()
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
