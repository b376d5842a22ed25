"""Shared pieces of the gateway tests: a messenger with the gateway on
127.0.0.1, and HTTPS requests with the standard library (token or client
certificate)."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fed_helpers import PKI, RawPeer, peer, tls_section
from keyop_messenger import Config, Messenger
from keyop_messenger.cli.token import token_hash

#: The bearer token of the ``app`` entry.
TOKEN = "test-token-0123456789"
#: Bound on every read from the gateway.
TIMEOUT_S = 15.0


def wait_for(cond: Any, what: str, timeout: float = TIMEOUT_S) -> None:
    """Polls ``cond`` until it is true; fails naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.05)


def gateway_stats(m: Messenger) -> Any:
    """The gateway's figures of ``m`` (it must run one)."""
    gw = m.stats().gateway
    assert gw is not None
    return gw


def gateway_doc(pki: PKI, data_dir: Path, **gateway: Any) -> dict[str, Any]:
    """A configuration document: hub ``hub1`` (federation off) with the gateway on."""
    section: dict[str, Any] = {
        "enabled": True,
        "listen_addr": "127.0.0.1:0",
        "tokens": [
            {
                "name": "app",
                "hash": token_hash(TOKEN),
                "publish": ["sensors", "big"],
                "subscribe": ["sensors"],
            }
        ],
    }
    section.update(gateway)
    return {
        "name": "hub1",
        "storage": {"data_dir": str(data_dir)},
        "hub": {"allowed_peers": [peer("node1", publish=["sensors"], subscribe=["sensors"])]},
        "tls": tls_section(pki, "hub1"),
        "gateway": section,
    }


def open_gateway(pki: PKI, data_dir: Path, **gateway: Any) -> Messenger:
    """A messenger with the gateway started (the caller closes it)."""
    return Messenger(Config.from_dict(gateway_doc(pki, data_dir, **gateway)))


def context(pki: PKI, cert: str | None = None) -> ssl.SSLContext:
    """Trusts the test CA; presents the certificate ``cert`` when given."""
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        ctx.load_cert_chain(str(pki[cert].cert), str(pki[cert].key))
    return ctx


class Client:
    """HTTPS requests to one gateway."""

    def __init__(self, pki: PKI, m: Messenger, *, cert: str | None = None,
                 token: str | None = TOKEN) -> None:
        addr = m.gateway_address
        assert addr is not None
        self.port = addr[1]
        self.ctx = context(pki, cert)
        self.token = token

    def connection(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(
            "localhost", self.port, context=self.ctx, timeout=TIMEOUT_S
        )

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.token is not None:
            h["Authorization"] = f"Bearer {self.token}"
        h.update(extra or {})
        return h

    def request(self, method: str, path: str, body: Any = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
        """``(status, headers, decoded JSON body or None)``."""
        conn = self.connection()
        try:
            data = None if body is None else (
                body if isinstance(body, bytes) else json.dumps(body).encode()
            )
            conn.request(method, path, body=data, headers=self.headers(headers))
            resp = conn.getresponse()
            raw = resp.read()
            hdrs = {k.lower(): v for k, v in resp.getheaders()}
            return resp.status, hdrs, json.loads(raw) if raw else None
        finally:
            conn.close()

    def publish(self, channel: str, body: Any, **kw: Any) -> tuple[int, dict[str, str], Any]:
        return self.request("POST", f"/v1/channels/{channel}/messages", body, **kw)

    def sse(self, path: str, n: int, last_event_id: str | None = None
            ) -> list[tuple[str, dict[str, Any]]]:
        """The first ``n`` data events of an SSE stream: ``(id, envelope)``."""
        conn = self.connection()
        extra = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            extra["Last-Event-ID"] = last_event_id
        try:
            conn.request("GET", path, headers=self.headers(extra))
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            assert resp.getheader("Content-Type") == "text/event-stream"
            return list(_events(resp, n))
        finally:
            conn.close()


def _events(resp: http.client.HTTPResponse, n: int) -> Iterator[tuple[str, dict[str, Any]]]:
    event_id = ""
    got = 0
    while got < n:
        line = resp.readline().decode()
        assert line, "the stream ended early"
        line = line.rstrip("\n")
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            got += 1
            yield event_id, json.loads(line[6:])


class WsClient(RawPeer):
    """A hand-written WebSocket client of the gateway (frames as
    :class:`fed_helpers.RawPeer` sends and reads them), authenticated by the
    bearer token. ``rcvbuf`` shrinks the socket's receive buffer (set before
    connecting), for clients that stop reading."""

    def __init__(self, pki: PKI, m: Messenger, path: str, *, token: str = TOKEN,
                 rcvbuf: int | None = None) -> None:
        addr = m.gateway_address
        assert addr is not None
        raw = socket.socket()
        raw.settimeout(TIMEOUT_S)
        if rcvbuf is not None:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        raw.connect(("127.0.0.1", addr[1]))
        self.sock = context(pki).wrap_socket(raw, server_hostname="localhost")
        self._buf = b""
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET {path} HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {token}\r\n\r\n"
            ).encode()
        )
        head = self._read_until(b"\r\n\r\n").decode("latin-1")
        assert head.startswith("HTTP/1.1 101"), head
        guid = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
        accept = base64.b64encode(hashlib.sha1((key + guid).encode()).digest()).decode()
        assert accept in head, head

    def recv_json(self) -> dict[str, Any]:
        """The next text message, decoded."""
        _, body = self.recv(TIMEOUT_S)
        doc: dict[str, Any] = json.loads(body)
        return doc
