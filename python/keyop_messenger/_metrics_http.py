"""The HTTP side of the ``/metrics`` endpoint (imported only when it is served)."""

from __future__ import annotations

import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ._prometheus import CONTENT_TYPE, StatsSource, log, render

__all__ = ["Handler", "Server", "Server6"]


class Server(ThreadingHTTPServer):
    daemon_threads = True
    source: StatsSource


class Server6(Server):
    address_family = socket.AF_INET6


class Handler(BaseHTTPRequestHandler):
    server: Server
    server_version = "keyop-messenger"

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self._reply(404, b"not found; metrics are at /metrics\n", "text/plain; charset=utf-8")
            return
        try:
            body = render(self.server.source.stats()).encode()
        except Exception as exc:
            log.warning("metrics: cannot collect stats: %s", exc)
            self._reply(503, f"cannot collect stats: {exc}\n".encode(), "text/plain")
            return
        self._reply(200, body, CONTENT_TYPE)

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("metrics: %s " + format, self.address_string(), *args)
