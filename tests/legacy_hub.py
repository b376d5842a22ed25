"""A stand-in for a keyop-messenger 1.4 hub (shared/spec/federation.md), for
tests of what this library sends to one: TLS 1.3 with client certificates, a
WebSocket on any path, the client's handshake first, then the hub's 1.4
handshake (no ``features`` unless given), binary batches acknowledged with
``{"last_id": ...}``. It records each batch's records and stores nothing.

Listening starts at construction; connections are taken only after
:meth:`LegacyHub.start`, so a test can queue records on a client first. One
connection is served at a time, on one thread, ended by :meth:`close` (or the
context manager).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import socket
import ssl
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from fed_helpers import OP_BINARY, OP_CLOSE, OP_CONT, OP_PING, OP_PONG, OP_TEXT, PKI, split_batch

_WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class _Closed(Exception):
    pass


class _Conn:
    """The server side of one WebSocket over TLS: unmasked frames out,
    masked frames in (RFC 6455 §5.1)."""

    def __init__(self, sock: ssl.SSLSocket, stop: threading.Event) -> None:
        self.sock = sock
        self.stop = stop
        self.buf = b""

    def _fill(self) -> None:
        while not self.stop.is_set():
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                raise _Closed("EOF")
            self.buf += chunk
            return
        raise _Closed("stopping")

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def upgrade(self) -> None:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        headers = {}
        for line in head.decode("latin-1").split("\r\n")[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        digest = hashlib.sha1((headers["sec-websocket-key"] + _WS_GUID).encode()).digest()
        accept = base64.b64encode(digest).decode()
        self.sock.sendall(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            + f"Sec-WebSocket-Accept: {accept}\r\n\r\n".encode()
        )

    def send(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        if n < 126:
            head = struct.pack(">BB", 0x80 | opcode, n)
        elif n < 65536:
            head = struct.pack(">BBH", 0x80 | opcode, 126, n)
        else:
            head = struct.pack(">BBQ", 0x80 | opcode, 127, n)
        self.sock.sendall(head + payload)

    def recv(self) -> tuple[int, bytes]:
        """The next data message (pings answered, fragments joined)."""
        opcode, parts = OP_CONT, []
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack(">H", self._exact(2))
            elif n == 127:
                (n,) = struct.unpack(">Q", self._exact(8))
            mask = self._exact(4) if b1 & 0x80 else b""
            data = self._exact(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            op = b0 & 0x0F
            if op == OP_PING:
                self.send(OP_PONG, data)
                continue
            if op == OP_PONG:
                continue
            if op == OP_CLOSE:
                raise _Closed("close frame")
            if op != OP_CONT:
                opcode = op
            parts.append(data)
            if b0 & 0x80:
                return opcode, b"".join(parts)


class LegacyHub:
    """A 1.4-style hub on 127.0.0.1 (see the module docstring).

    ``features``: announced in its handshake (none, as 1.4 does, by default).
    ``first_ack_delay``: seconds it waits before acknowledging the first batch
    of a connection (a hub busy storing), so that a client's publishes queue.
    """

    def __init__(
        self, pki: PKI, *, features: Sequence[str] = (), first_ack_delay: float = 0.0
    ) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        self.ctx.load_cert_chain(str(pki["hub1"].cert), str(pki["hub1"].key))
        self.ctx.load_verify_locations(str(pki.ca))
        self.ctx.verify_mode = ssl.CERT_REQUIRED
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        handshake: dict[str, Any] = {"instance_name": "hub1", "role": "hub", "version": "1"}
        if features:
            handshake["features"] = list(features)
        self.handshake = json.dumps(handshake).encode()
        self.first_ack_delay = first_ack_delay
        self.hellos: list[dict[str, Any]] = []
        self.batches: list[list[bytes]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> LegacyHub:
        self.thread.start()
        return self

    def records(self) -> int:
        with self.lock:
            return sum(len(b) for b in self.batches)

    def batch_sizes(self) -> list[int]:
        with self.lock:
            return [len(b) for b in self.batches]

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                raw, _ = self.sock.accept()
            except TimeoutError:
                continue
            raw.settimeout(0.2)
            with contextlib.suppress(_Closed, OSError, ssl.SSLError):
                with self.ctx.wrap_socket(raw, server_side=True) as tls:
                    self._link(_Conn(tls, self.stopping))
            raw.close()

    def _link(self, conn: _Conn) -> None:
        conn.upgrade()
        op, hello = conn.recv()
        assert op == OP_TEXT, f"the client's first message is not text: {hello[:80]!r}"
        with self.lock:
            self.hellos.append(json.loads(hello))
        conn.send(OP_TEXT, self.handshake)
        first = True
        while True:
            op, body = conn.recv()
            if op != OP_BINARY:
                continue
            records = split_batch(body)
            with self.lock:
                self.batches.append(records)
            if first and self.first_ack_delay:
                deadline = time.monotonic() + self.first_ack_delay
                while time.monotonic() < deadline and not self.stopping.is_set():
                    time.sleep(0.02)
            first = False
            last = json.loads(records[-1])["id"] if records else ""
            conn.send(OP_TEXT, json.dumps({"last_id": last}).encode())

    def close(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> LegacyHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
