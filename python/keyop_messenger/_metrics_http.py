"""The HTTP side of the metrics listener (imported only when it is served):
``/metrics`` and the health endpoints ``/healthz``, ``/readyz``, ``/status``."""

from __future__ import annotations

import json
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ._prometheus import CONTENT_TYPE, log, render
from .health import Health

__all__ = ["Handler", "Server", "Server6"]

_TEXT = "text/plain; charset=utf-8"


class Server(ThreadingHTTPServer):
    daemon_threads = True
    health: Health


class Server6(Server):
    address_family = socket.AF_INET6


class Handler(BaseHTTPRequestHandler):
    server: Server
    server_version = "keyop-messenger"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        health = self.server.health
        if path == "/healthz":
            self._reply(200, b"ok\n", _TEXT)
        elif path == "/readyz":
            ready, reason = health.readiness()
            self._reply(200 if ready else 503, f"{reason}\n".encode(), _TEXT)
        elif path == "/status":
            try:
                doc = health.status()
            except Exception as exc:
                log.warning("status: cannot collect stats: %s", exc)
                self._reply(503, f"cannot collect stats: {exc}\n".encode(), _TEXT)
                return
            self._reply(200, (json.dumps(doc) + "\n").encode(), "application/json")
        elif path == "/metrics":
            self._metrics(health)
        else:
            self._reply(
                404, b"not found; try /metrics, /healthz, /readyz or /status\n", _TEXT
            )

    def _metrics(self, health: Health) -> None:
        source = health.source
        if source is None:
            self._reply(503, f"{health.state}\n".encode(), _TEXT)
            return
        try:
            body = render(source.stats()).encode()
        except Exception as exc:
            log.warning("metrics: cannot collect stats: %s", exc)
            self._reply(503, f"cannot collect stats: {exc}\n".encode(), _TEXT)
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
