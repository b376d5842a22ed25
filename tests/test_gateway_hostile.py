"""The gateway against hostile clients: floods of connections that never
finish opening, bad tokens by the thousand, one client taking every stream,
failed TLS handshakes, WebSocket upgrades and frames that break RFC 6455, and
start times beyond the engine's clock."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
from fed_helpers import OP_TEXT, PeerClosed
from gateway_helpers import (
    TIMEOUT_S,
    TOKEN,
    Client,
    WsClient,
    context,
    gateway_doc,
    gateway_stats,
    wait_for,
)
from keyop_messenger import Config, Messenger

pki = fed_helpers.pki



def _port(m: Messenger) -> int:
    addr = m.gateway_address
    assert addr is not None
    return addr[1]


def _bare(port: int, source: str) -> socket.socket:
    """A TCP connection from ``source`` that never sends a byte."""
    s = socket.socket()
    s.settimeout(TIMEOUT_S)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def test_a_flood_of_unfinished_connections_does_not_keep_clients_out(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    """8 connection slots; 18 bare TCP connections from six addresses, held
    open with a header timeout of a minute. Each address keeps at most two
    opening (a quarter of the slots), and a newcomer on a full gateway
    drops the oldest connection that has not sent a request: a client
    connecting afterwards is served, and a client already past its first
    request keeps its connection."""
    doc = gateway_doc(pki, tmp_path / "data", max_connections=8, header_timeout="60s")
    with Messenger(Config.from_dict(doc)) as m:
        c = Client(pki, m)
        kept = c.connection()
        flood: list[socket.socket] = []
        try:
            kept.request("GET", "/v1/channels/sensors/messages?limit=1", headers=c.headers())
            first = kept.getresponse()
            assert first.status == 200
            first.read()
            for i in range(18):
                flood.append(_bare(_port(m), f"127.0.0.{2 + i % 6}"))
            status, _, body = c.request("GET", "/v1/channels/sensors/messages?limit=1")
            assert status == 200, body
            # The same connection, its second request.
            kept.request("GET", "/v1/channels/sensors/messages?limit=1", headers=c.headers())
            assert kept.getresponse().status == 200
            refused = gateway_stats(m).refused["too_many_connections"]
            assert refused >= 18 - 7, refused  # 7 slots for the flood, the kept one aside
            # The dropped ones were closed by the gateway.
            closed = 0
            for s in flood:
                s.settimeout(0.01)
                try:
                    closed += s.recv(1) == b""
                except (TimeoutError, ConnectionResetError):
                    pass
            assert closed >= 1
        finally:
            kept.close()
            for s in flood:
                s.close()


def test_bad_tokens_are_limited_per_address(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    """After 10 bad tokens an address gets 429 without its token being
    checked (a right guess too), and the connection is closed; a certificate
    client from the same address is still served."""
    with Messenger(Config.from_dict(gateway_doc(pki, tmp_path / "data"))) as m:
        guesser = Client(pki, m, token="guess")
        statuses = []
        for _ in range(30):
            status, headers, body = guesser.request("GET", "/v1/channels/sensors/messages")
            statuses.append(status)
            if status == 429:
                assert body["error"] == "too_many_auth_failures", body
                assert int(headers["retry-after"]) >= 1
                assert headers["connection"] == "close"
        assert statuses[:10] == [401] * 10, statuses
        assert 429 in statuses and statuses.count(401) < 30, statuses
        status, _, body = Client(pki, m).request("GET", "/v1/channels/sensors/messages")
        assert status == 429 and body["error"] == "too_many_auth_failures", body
        node1 = Client(pki, m, cert="node1", token=None)
        assert node1.request("GET", "/v1/channels/sensors/messages")[0] == 200
        refused = gateway_stats(m).refused
        assert refused["too_many_auth_failures"] >= 2, refused
        assert refused["unauthenticated"] == statuses.count(401), refused


def _open_sse(c: Client) -> Any:
    conn = c.connection()
    conn.request("GET", "/v1/channels/sensors/messages",
                 headers=c.headers({"Accept": "text/event-stream"}))  # fmt: skip
    return conn, conn.getresponse()


def test_one_client_holds_a_quarter_of_the_streams(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    doc = gateway_doc(pki, tmp_path / "data", max_streams=4)
    with Messenger(Config.from_dict(doc)) as m:
        app, node1 = Client(pki, m), Client(pki, m, cert="node1", token=None)
        first, resp = _open_sse(app)
        try:
            assert resp.status == 200
            wait_for(lambda: gateway_stats(m).streams_open == 1, "the first stream is open")
            second, resp = _open_sse(app)
            try:
                # Status first: a stream that did open would never end.
                assert resp.status == 429
                assert resp.getheader("Retry-After") == "1"
                body = json.loads(resp.read())
            finally:
                second.close()
            assert body["error"] == "too_many_streams", body
            assert "token:app" in body["message"], body
            assert "gateway.max_streams" in body["message"], body
            # A long poll is a stream too.
            status, _, body = app.request("GET", "/v1/channels/sensors/messages?wait=1")
            assert status == 429, body
            other, resp2 = _open_sse(node1)
            assert resp2.status == 200
            other.close()
        finally:
            first.close()
        wait_for(lambda: gateway_stats(m).streams_open == 0, "the streams are closed")
        status, _, body = app.request("GET", "/v1/channels/sensors/messages?wait=0")
        assert status == 200, body
        assert gateway_stats(m).refused["too_many_streams"] == 2


def test_failed_tls_handshakes_are_counted(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    with Messenger(Config.from_dict(gateway_doc(pki, tmp_path / "data"))) as m:
        s = _bare(_port(m), "127.0.0.1")
        try:
            s.sendall(b"GET /v1/openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
        finally:
            s.close()
        wait_for(lambda: gateway_stats(m).refused["tls"] == 1, "the failed handshake is counted")


def _upgrade(pki: fed_helpers.PKI, m: Messenger, version: str, key: str) -> str:
    """The head of the answer to a WebSocket upgrade."""
    raw = socket.create_connection(("127.0.0.1", _port(m)), timeout=TIMEOUT_S)
    with context(pki).wrap_socket(raw, server_hostname="localhost") as s:
        s.sendall(
            (
                "GET /v1/channels/sensors/ws HTTP/1.1\r\nHost: localhost\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: {version}\r\n"
                f"Authorization: Bearer {TOKEN}\r\n\r\n"
            ).encode()
        )
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(4096)
            assert chunk, buf
            buf += chunk
        return buf.partition(b"\r\n\r\n")[0].decode("latin-1").lower()


def test_websocket_upgrades_follow_rfc_6455(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    good_key = base64.b64encode(os.urandom(16)).decode()
    with Messenger(Config.from_dict(gateway_doc(pki, tmp_path / "data"))) as m:
        for version in ("8", "garbage", ""):
            head = _upgrade(pki, m, version, good_key)
            assert head.startswith("http/1.1 426"), head
            assert "sec-websocket-version: 13" in head, head
        for key in ("dGhlIHNhbXBsZSBub25jZQ", "abc", base64.b64encode(b"x" * 17).decode()):
            head = _upgrade(pki, m, "13", key)
            assert head.startswith("http/1.1 400"), head
        assert _upgrade(pki, m, "13", good_key).startswith("http/1.1 101")
        assert gateway_stats(m).refused["bad_request"] == 6


@pytest.mark.parametrize("frame", [
    # unmasked text frame
    struct.pack(">BB", 0x80 | OP_TEXT, 2) + b"{}",
    # RSV1 set (no extension was negotiated)
    struct.pack(">BB", 0xC0 | OP_TEXT, 0x80 | 2) + b"\0\0\0\0{}",
    # a ping of 200 bytes (control frames hold 125 at most)
    struct.pack(">BBH", 0x89, 0x80 | 126, 200) + b"\0\0\0\0" + b"p" * 200,
], ids=["unmasked", "rsv1", "ping-200"])  # fmt: skip
def test_websocket_protocol_errors_close_with_1002_and_are_counted(
    pki: fed_helpers.PKI, tmp_path: Path, frame: bytes
) -> None:
    with Messenger(Config.from_dict(gateway_doc(pki, tmp_path / "data"))) as m:
        ws = WsClient(pki, m, "/v1/channels/sensors/ws")
        try:
            ws.sock.sendall(frame)
            with pytest.raises(PeerClosed) as closed:
                for _ in range(10):
                    ws.recv(TIMEOUT_S)
            assert closed.value.code == 1002
        finally:
            ws.close()
        wait_for(
            lambda: gateway_stats(m).refused["bad_request"] == 1, "the protocol error is counted"
        )


def test_start_times_beyond_the_engines_clock_are_the_ends(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    """Times are nanoseconds in 64 bits (1677 to 2262): a later time is
    after every record (the end), an earlier one before every record."""
    with Messenger(Config.from_dict(gateway_doc(pki, tmp_path / "data"))) as m:
        m.publish("sensors", "t", {"n": 1})
        c = Client(pki, m)
        path = "/v1/channels/sensors/messages"
        status, _, body = c.request("GET", f"{path}?from=9999-12-31T23:59:59Z&wait=0")
        assert status == 200, body
        assert body["messages"] == [] and body["next"] == m.stream_end("sensors")
        status, _, body = c.request("GET", f"{path}?from=0001-01-01T00:00:00Z")
        assert status == 200, body
        assert [x["message"]["payload"] for x in body["messages"]] == [{"n": 1}]
        status, _, body = c.request("GET", f"{path}?from=tomorrow")
        assert status == 400 and "ISO 8601" in body["message"], body
