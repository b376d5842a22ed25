"""Shared helpers and fixtures of the federation tests (tests/test_federation.py).

* ``pki`` (session fixture): a CA with certificates for the hub ``hub1`` (DNS
  SANs ``hub1`` and ``localhost``, IP SAN ``127.0.0.1``), the clients
  ``node1`` and ``node2``, an ``intruder`` signed by the same CA but never
  allow-listed, and ``foreign``: a certificate with CN ``node1`` issued by a
  second, unrelated CA.
* ``start`` (fixture): opens messengers and closes every one of them after
  the test, whatever happens.
* Configuration builders for hubs and clients, bounded polling waits,
  readers of channel files, cursor files and the audit log.
* :class:`RawPeer`: a minimal WebSocket-over-mutual-TLS client speaking the
  federation protocol by hand, for wire-level checks.

A test module uses the fixtures by binding them to module names
(``pki = fed_helpers.pki``), which pytest collects like its own fixtures.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import socket
import ssl
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from keyop_messenger import Config, Message, Messenger, read_channel
from keyop_messenger.cli import main as cli_main

T = TypeVar("T")

#: Bound on every wait for a delivery or a state change.
WAIT_S = 15.0
#: Fast, jitter-free reconnects, so tests never wait for a long back-off.
FAST_RECONNECT: dict[str, Any] = {
    "reconnect_base_ms": 50,
    "reconnect_max_ms": 300,
    "reconnect_jitter": 0.0,
}
#: RFC 3339 UTC with trailing fraction zeros trimmed (disk-format.md §9).
TS_RE = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{0,8}[1-9])?Z$"
#: Audit record keys in the order they must be written (disk-format.md §9).
AUDIT_KEYS = (
    "ts",
    "event",
    "message_id",
    "channel",
    "direction",
    "peer",
    "peer_addr",
    "detail",
)


# ---------------------------------------------------------------------------
# Certificates
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CertPair:
    """A PEM certificate and its private key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class PKI:
    """The test certificate authority and the instance certificates it issued."""

    ca: Path
    ca_key: Path
    foreign_ca: Path
    certs: dict[str, CertPair]

    def __getitem__(self, name: str) -> CertPair:
        return self.certs[name]


def _cli(*argv: str | Path) -> None:
    """Runs ``keyop-messenger`` in-process, failing loudly on a non-zero status."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli_main([str(a) for a in argv])
    assert status == 0, f"keyop-messenger {argv}: {err.getvalue()}"


def _instance(ca: Path, ca_key: Path, out: Path, cn: str, file_stem: str, *sans: str) -> CertPair:
    pair = CertPair(out / f"{file_stem}.crt", out / f"{file_stem}.key")
    san_args: list[str] = []
    for san in sans:
        san_args += ["--san", san]
    _cli(
        "keygen", "instance", "--ca", ca, "--ca-key", ca_key, "--name", cn,
        "--out-cert", pair.cert, "--out-key", pair.key, *san_args,
    )  # fmt: skip
    return pair


def make_pki(out: Path) -> PKI:
    """Creates the CA, the foreign CA and every test certificate under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    ca, ca_key = out / "ca.crt", out / "ca.key"
    _cli("keygen", "ca", "--out-cert", ca, "--out-key", ca_key)
    foreign_ca, foreign_key = out / "foreign-ca.crt", out / "foreign-ca.key"
    _cli("keygen", "ca", "--out-cert", foreign_ca, "--out-key", foreign_key)
    certs = {
        "hub1": _instance(ca, ca_key, out, "hub1", "hub1", "localhost", "127.0.0.1"),
        "node1": _instance(ca, ca_key, out, "node1", "node1"),
        "node2": _instance(ca, ca_key, out, "node2", "node2"),
        "intruder": _instance(ca, ca_key, out, "intruder", "intruder"),
        # Same CN as an allowed peer, but issued by a CA the hub does not trust.
        "foreign": _instance(foreign_ca, foreign_key, out, "node1", "foreign"),
    }
    return PKI(ca=ca, ca_key=ca_key, foreign_ca=foreign_ca, certs=certs)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    """The session's certificates (generated once)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


# ---------------------------------------------------------------------------
# Configurations and messengers
# ---------------------------------------------------------------------------


def tls_section(pki: PKI, cert_name: str, *, ca: Path | None = None) -> dict[str, str]:
    pair = pki[cert_name]
    return {"cert": str(pair.cert), "key": str(pair.key), "ca": str(ca or pki.ca)}


def peer(
    name: str, *, subscribe: Sequence[str] = (), publish: Sequence[str] = ()
) -> dict[str, Any]:
    """One ``hub.allowed_peers`` entry."""
    return {"name": name, "subscribe": list(subscribe), "publish": list(publish)}


def hub_config(
    pki: PKI,
    data_dir: Path,
    allowed_peers: Sequence[dict[str, Any]],
    *,
    port: int = 0,
    name: str = "hub1",
    tls: dict[str, str] | None = None,
) -> Config:
    """A hub listening on ``127.0.0.1:<port>`` with the ``hub1`` certificate."""
    return Config.from_dict(
        {
            "name": name,
            "storage": {"data_dir": str(data_dir)},
            "hub": {
                "enabled": True,
                "listen_addr": f"127.0.0.1:{port}",
                "allowed_peers": list(allowed_peers),
            },
            "tls": tls if tls is not None else tls_section(pki, "hub1"),
            "federation": FAST_RECONNECT,
        }
    )


def client_config(
    pki: PKI,
    data_dir: Path,
    name: str,
    hub_port: int,
    *,
    subscribe: Sequence[str] = (),
    publish: Sequence[str] = (),
    cert_name: str | None = None,
    ca: Path | None = None,
    host: str = "127.0.0.1",
) -> Config:
    """A client named ``name`` dialing ``<host>:<hub_port>`` with certificate
    ``cert_name`` (default: its own name)."""
    return Config.from_dict(
        {
            "name": name,
            "storage": {"data_dir": str(data_dir)},
            "client": {
                "enabled": True,
                "hubs": [
                    {
                        "addr": f"{host}:{hub_port}",
                        "subscribe": list(subscribe),
                        "publish": list(publish),
                    }
                ],
            },
            "tls": tls_section(pki, cert_name or name, ca=ca),
            "federation": FAST_RECONNECT,
        }
    )


Starter = Callable[[Config], Messenger]


@pytest.fixture
def start() -> Iterator[Starter]:
    """``start(config)`` opens a messenger that is closed after the test
    (closing it earlier in the test is fine)."""
    opened: list[Messenger] = []

    def _start(config: Config) -> Messenger:
        m = Messenger(config)
        opened.append(m)
        return m

    try:
        yield _start
    finally:
        for m in reversed(opened):
            m.close()


def hub_port(hub: Messenger) -> int:
    addr = hub.hub_address
    assert addr is not None, "the hub is not listening"
    return addr[1]


def free_port() -> int:
    """A TCP port that was free a moment ago (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def client_status(m: Messenger, index: int = 0) -> dict[str, Any]:
    return dataclasses.asdict(m.federation_status().clients[index])


def hub_status(m: Messenger) -> dict[str, Any]:
    status = m.federation_status().hub
    assert status is not None, "not a hub"
    return dataclasses.asdict(status)


def wait_peers(hub: Messenger, *names: str) -> None:
    """Waits until exactly ``names`` are connected to ``hub``."""
    wanted = sorted(names)
    wait_until(lambda: sorted(hub_status(hub)["peers"]) == wanted, f"hub peers == {wanted}")


def wait_connected(client: Messenger, index: int = 0) -> None:
    wait_until(lambda: client_status(client, index)["connected"], "client link connected")


# ---------------------------------------------------------------------------
# Waiting
# ---------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], T], what: str, timeout: float = WAIT_S, interval: float = 0.02
) -> T:
    """Polls ``predicate`` until it returns something truthy (returned), or
    fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def wait_stable(
    sample: Callable[[], T], what: str, quiet: float = 1.0, timeout: float = WAIT_S
) -> T:
    """Polls ``sample`` until its value stayed the same for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    last = sample()
    since = time.monotonic()
    while True:
        time.sleep(0.05)
        now = time.monotonic()
        value = sample()
        if value != last:
            last, since = value, now
        elif now - since >= quiet:
            return value
        if now >= deadline:
            raise AssertionError(f"{what} did not settle within {timeout:.0f}s (last {last!r})")


class Inbox:
    """A subscription handler that collects the messages it is given."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._messages: list[Message] = []

    def __call__(self, msg: Message) -> None:
        with self._lock:
            self._messages.append(msg)

    @property
    def messages(self) -> list[Message]:
        with self._lock:
            return list(self._messages)

    def ids(self) -> list[str]:
        return [m.id for m in self.messages]

    def wait_count(self, n: int, what: str = "messages") -> list[Message]:
        """Waits until at least ``n`` messages arrived; returns them all."""
        wait_until(lambda: len(self.messages) >= n, f"{n} {what} (have {len(self.messages)})")
        return self.messages


# ---------------------------------------------------------------------------
# Files: channels, cursors, audit
# ---------------------------------------------------------------------------


def data_dir_of(m: Messenger) -> Path:
    return Path(m.config.storage.data_dir)


def stored(data_dir: Path, channel: str) -> list[Message]:
    """The messages stored in ``channel`` of ``data_dir`` (empty if it does not exist)."""
    if not (data_dir / "channels" / channel).is_dir():
        return []
    return [entry.message for entry in read_channel(data_dir, channel)]


def stored_ids(data_dir: Path, channel: str) -> list[str]:
    return [m.id for m in stored(data_dir, channel)]


def raw_records(data_dir: Path, channel: str) -> list[bytes]:
    """The record lines (without newline) of every segment of ``channel``."""
    folder = data_dir / "channels" / channel
    if not folder.is_dir():
        return []
    lines: list[bytes] = []
    for seg in sorted(folder.glob("*.jsonl")):
        lines += [line for line in seg.read_bytes().split(b"\n") if line]
    return lines


def stream_end(data_dir: Path, channel: str) -> int:
    """The stream end of a channel that never rolled a segment past the first."""
    folder = data_dir / "channels" / channel
    segments = sorted(folder.glob("*.jsonl"))
    if not segments:
        return 0
    last = segments[-1]
    return int(last.stem) + last.stat().st_size


def cursor_path(data_dir: Path, channel: str, cursor_id: str) -> Path:
    return data_dir / "subscribers" / channel / f"{cursor_id}.offset"


def read_cursor(path: Path) -> int | None:
    """The value of an offset file, or None if it does not exist."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    assert text.endswith("\n") and text.strip().isdigit(), f"bad offset file {path}: {text!r}"
    return int(text)


def audit_records(data_dir: Path) -> list[dict[str, Any]]:
    """Every complete line of ``audit/audit.jsonl``, parsed (key order kept)."""
    path = data_dir / "audit" / "audit.jsonl"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines()]


def audit_events(data_dir: Path, event: str, **fields: str) -> list[dict[str, Any]]:
    """Audit records of type ``event`` whose fields equal ``fields``."""
    return [
        r
        for r in audit_records(data_dir)
        if r.get("event") == event and all(r.get(k) == v for k, v in fields.items())
    ]


# ---------------------------------------------------------------------------
# A raw federation peer (WebSocket over mutual TLS, RFC 6455)
# ---------------------------------------------------------------------------

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def envelope(channel: str, origin: str, payload: Any, *, msg_id: str | None = None) -> bytes:
    """One envelope as a peer would send it (disk-format.md §3.1 key order)."""
    doc = {
        "v": 1,
        "id": str(uuid.uuid4()) if msg_id is None else msg_id,
        "ts": "2026-03-31T14:22:01.1234567Z",
        "channel": channel,
        "origin": origin,
        "payload_type": "test.Raw",
        "payload": payload,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def batch(*records: bytes) -> bytes:
    """A binary batch body: ``(uint32 big-endian length, JSON)*``."""
    return b"".join(struct.pack(">I", len(r)) + r for r in records)


def split_batch(body: bytes) -> list[bytes]:
    records: list[bytes] = []
    while body:
        assert len(body) >= 4, "truncated length prefix"
        (n,) = struct.unpack(">I", body[:4])
        assert len(body) >= 4 + n, "truncated record"
        records.append(body[4 : 4 + n])
        body = body[4 + n :]
    return records


class PeerClosed(Exception):
    """The connection ended; ``code``/``reason`` come from a Close frame, if any."""

    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"closed: code={code} reason={reason!r}")
        self.code = code
        self.reason = reason


class RawPeer:
    """A hand-written federation client: TLS 1.3 with a client certificate,
    ``GET /`` WebSocket upgrade, then text and binary messages."""

    def __init__(
        self, port: int, cert: CertPair, ca: Path, *, host: str = "127.0.0.1", timeout: float = 10
    ) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_verify_locations(str(ca))
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
        raw = socket.create_connection((host, port), timeout=timeout)
        self.sock = ctx.wrap_socket(raw, server_hostname=host)
        self._buf = b""
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = self._read_until(b"\r\n\r\n").decode("latin-1")
        status, *header_lines = head.split("\r\n")
        assert status.startswith("HTTP/1.1 101"), head
        headers = {
            k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines if h)
        }
        accept = base64.b64encode(hashlib.sha1((key + _WS_GUID).encode()).digest()).decode()
        assert headers.get("sec-websocket-accept") == accept, head

    # -- bytes ---------------------------------------------------------------

    def _fill(self) -> None:
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            raise PeerClosed(None, "connection reset") from None
        if not chunk:
            raise PeerClosed(None, "EOF")
        self._buf += chunk

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self._buf:
            self._fill()
        head, _, self._buf = self._buf.partition(marker)
        return head

    def _read_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            self._fill()
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    # -- frames --------------------------------------------------------------

    def send_frame(self, opcode: int, payload: bytes) -> None:
        """Sends one final, masked frame (clients must mask)."""
        n = len(payload)
        if n < 126:
            head = struct.pack(">BB", 0x80 | opcode, 0x80 | n)
        elif n < 1 << 16:
            head = struct.pack(">BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            head = struct.pack(">BBQ", 0x80 | opcode, 0x80 | 127, n)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(head + mask + masked)

    def _read_frame(self) -> tuple[bool, int, bytes]:
        b0, b1 = self._read_exact(2)
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack(">H", self._read_exact(2))
        elif n == 127:
            (n,) = struct.unpack(">Q", self._read_exact(8))
        mask = self._read_exact(4) if b1 & 0x80 else b""
        data = self._read_exact(n)
        if mask:
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        return bool(b0 & 0x80), b0 & 0x0F, data

    def recv(self, timeout: float = WAIT_S) -> tuple[int, bytes]:
        """The next complete text or binary message as ``(opcode, body)``, within
        ``timeout`` s in all; pings are answered, a Close raises :class:`PeerClosed`."""
        deadline = time.monotonic() + timeout
        opcode, parts = None, []
        while True:
            self.sock.settimeout(max(deadline - time.monotonic(), 0.001))  # pings don't extend it
            fin, op, data = self._read_frame()
            if op == OP_PING:
                self.send_frame(OP_PONG, data)
                continue
            if op == OP_PONG:
                continue
            if op == OP_CLOSE:
                code = struct.unpack(">H", data[:2])[0] if len(data) >= 2 else None
                raise PeerClosed(code, data[2:].decode("utf-8", "replace"))
            if op != OP_CONT:
                opcode = op
            parts.append(data)
            if fin:
                assert opcode is not None, "continuation without a first frame"
                return opcode, b"".join(parts)

    def send_text(self, text: str) -> None:
        self.send_frame(OP_TEXT, text.encode())

    def send_binary(self, body: bytes) -> None:
        self.send_frame(OP_BINARY, body)

    def recv_text(self, timeout: float = WAIT_S) -> str:
        op, body = self.recv(timeout)
        assert op == OP_TEXT, f"expected a text message, got opcode {op}: {body[:80]!r}"
        return body.decode()

    def recv_binary(self, timeout: float = WAIT_S) -> bytes:
        op, body = self.recv(timeout)
        assert op == OP_BINARY, f"expected a binary message, got opcode {op}: {body[:80]!r}"
        return body

    def handshake(
        self, name: str, subscribe: Sequence[str] = (), ephemeral: bool = False,
        features: Sequence[str] = (),
    ) -> str:  # fmt: skip
        """Sends the client handshake (federation.md §4.2; ``features`` makes
        it this implementation's, not 1.4's); returns the hub's reply."""
        hello: dict[str, Any] = {"instance_name": name, "role": "client", "version": "1"}
        if subscribe:
            hello["subscribe"] = list(subscribe)
        if ephemeral:
            hello["ephemeral"] = True
        if features:
            hello["features"] = list(features)
        self.send_text(json.dumps(hello, separators=(",", ":")))
        return self.recv_text()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
