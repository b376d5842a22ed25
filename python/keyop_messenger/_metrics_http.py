"""The HTTP side of the metrics listener (imported only when it is served):
``/metrics``, the health endpoints ``/healthz``, ``/readyz``, ``/status`` and
the status page at ``/`` (``static/status.html``, which polls ``/status``)."""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.resources
import json
import re
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ._prometheus import CONTENT_TYPE, log, render
from .health import Health

__all__ = ["STATUS_PAGE", "Handler", "Server", "Server6", "status_page"]

_TEXT = "text/plain; charset=utf-8"
_HTML = "text/html; charset=utf-8"

STATUS_PAGE = "static/status.html"
"""The status page, relative to the package."""


@functools.lru_cache(maxsize=1)
def status_page() -> tuple[bytes, str]:
    """The status page's bytes and its Content-Security-Policy: nothing but
    its own inline script and style (allowed by their hashes) and requests to
    this origin (``/status``)."""
    body = importlib.resources.files("keyop_messenger").joinpath(STATUS_PAGE).read_bytes()
    text = body.decode("utf-8")

    def hashes(tag: str) -> str:
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
        digests = (hashlib.sha256(f.encode()).digest() for f in found)
        return " ".join(f"'sha256-{base64.b64encode(d).decode()}'" for d in digests)

    policy = (
        "default-src 'none'; "
        f"script-src {hashes('script')}; "
        f"style-src {hashes('style')}; "
        "connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return body, policy


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
        if path in ("/", "/index.html"):
            self._page()
        elif path == "/healthz":
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
            self._reply(
                200,
                (json.dumps(doc) + "\n").encode(),
                "application/json",
                {"Cache-Control": "no-store"},
            )
        elif path == "/metrics":
            self._metrics(health)
        else:
            self._reply(
                404, b"not found; try /, /metrics, /healthz, /readyz or /status\n", _TEXT
            )

    def _page(self) -> None:
        try:
            body, policy = status_page()
        except OSError as exc:  # a broken install: the package data is missing
            log.warning("status page: cannot read %s: %s", STATUS_PAGE, exc)
            self._reply(500, f"status page missing: {exc}\n".encode(), _TEXT)
            return
        self._reply(
            200,
            body,
            _HTML,
            {
                "Content-Security-Policy": policy,
                "X-Content-Type-Options": "nosniff",
                "X-Frame-Options": "DENY",
                "Referrer-Policy": "no-referrer",
                "Cache-Control": "no-cache",
            },
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

    def _reply(
        self,
        status: int,
        body: bytes,
        content_type: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("metrics: %s " + format, self.address_string(), *args)
