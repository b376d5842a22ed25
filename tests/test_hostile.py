# why this file is long: 25 hostile-peer cases against one hub fixture, sharing a raw
# TLS/WebSocket peer.
"""Hostile peers and bad input against a hub (issue 7, part 5).

Every case states its expected outcome (federation.md §3, §4, §6, §7, §12
and the README): nothing stored, the audit record the protocol defines for
it where one exists (``client_rejected``, ``policy_violation``,
``peer_disconnected``; TLS-level refusals happen before any application code
and leave none), the hub keeps serving a well-behaved peer afterwards, and
nothing is written outside the hub's data directory (nor, inside it,
anywhere but the expected channel, cursor and audit files).

Peers are hand-written (fed_helpers.RawPeer and raw sockets), so each fault
is exactly the bytes the test sends. Configuration files are covered end to
end through ``Messenger(path)``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import json
import logging
import os
import socket
import ssl
import struct
import threading
import time
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

import fed_helpers
from fed_helpers import (
    OP_BINARY,
    OP_CONT,
    OP_TEXT,
    PKI,
    CertPair,
    PeerClosed,
    RawPeer,
    Starter,
    audit_events,
    audit_records,
    batch,
    cursor_path,
    envelope,
    hub_config,
    hub_port,
    hub_status,
    peer,
    raw_records,
    split_batch,
    stored_ids,
    tls_section,
    wait_peers,
    wait_until,
)
from keyop_messenger import AllowedPeer, Config, ConfigError, KeyopError, Messenger
from keyop_messenger.metrics import render
from keyop_messenger.stats import HubListenerStats

pki = fed_helpers.pki
start = fed_helpers.start

HUB_HANDSHAKE = '{"instance_name":"hub1","role":"hub","version":"1"}'
#: The hub's handshake timeout (federation.md §2) and the slack we allow on top.
HANDSHAKE_TIMEOUT_S = 10.0
SLACK_S = 8.0
#: The CN ``keyop-messenger keygen ca`` gives a CA.
CA_CN = "keyop-ca"


# ---------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------


def allowlist() -> list[dict[str, Any]]:
    return [
        peer("node1", subscribe=["cmds"], publish=["temps"]),
        peer("node2"),  # no restrictions: refusals seen with it come from the name rules
        peer(CA_CN),  # so that a CA certificate is refused for being a CA, not for its CN
    ]


def tree(root: Path) -> set[str]:
    """Every path (files and directories) under ``root``, relative."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


class Hub:
    """A hub ``hub1`` on 127.0.0.1 with :func:`allowlist`, and a snapshot of
    the test's directory taken before the hostile part starts."""

    def __init__(self, pki: PKI, tmp_path: Path, start: Starter, **federation: Any) -> None:
        self.pki = pki
        self.root = tmp_path
        self.dir = tmp_path / "hub"
        cfg = hub_config(pki, self.dir, allowlist())
        if federation:
            d = cfg.to_dict()
            d["federation"].update(federation)
            cfg = Config.from_dict(d)
        self.m = start(cfg)
        self.port = hub_port(self.m)
        self.before = tree(tmp_path)

    def status(self) -> dict[str, Any]:
        return hub_status(self.m)

    def listener(self) -> HubListenerStats:
        listener = self.m.stats().federation.listener
        assert listener is not None, "not a hub"
        return listener

    def wait_failed(self, **stages: int) -> None:
        """Waits until the hub has counted exactly ``stages`` connections as
        failed before their handshake (the others at zero): a connection is
        counted once the hub is done with it, which may be after the peer
        sees it closed."""
        want = {stage: stages.get(stage, 0) for stage in FAILED_STAGES}
        wait_until(lambda: self.listener().connections_failed == want, f"failed {want}")

    def assert_confined(
        self, channels: Collection[str] = (), cursors: Collection[str] = ()
    ) -> None:
        """Nothing new outside the hub's data directory; inside it only the
        ``channels`` directories (and their segments), ``cursors`` (as
        ``<channel>/<id>``) with their subscriber directories, and the audit log."""
        new = tree(self.root) - self.before
        outside = sorted(p for p in new if not p.startswith("hub/") and p != "hub")
        assert outside == [], f"written outside the data directory: {outside}"
        allowed = {"hub/audit/audit.jsonl"}
        for ch in channels:
            allowed |= {f"hub/channels/{ch}", f"hub/subscribers/{ch}"}
        for c in cursors:
            ch = c.split("/")[0]
            # (.tmp: the atomic replacement of a cursor may be under way)
            allowed |= {
                f"hub/subscribers/{ch}",
                f"hub/subscribers/{c}.offset",
                f"hub/subscribers/{c}.offset.tmp",
            }
        unexpected = []
        for p in sorted(new):
            if p in allowed:
                continue
            parts = p.split("/")
            if len(parts) == 4 and parts[1] == "channels" and f"hub/channels/{parts[2]}" in allowed:
                if parts[3].endswith(".jsonl"):
                    continue
            unexpected.append(p)
        assert unexpected == [], f"unexpected files in the data directory: {unexpected}"

    def assert_serves_good_peer(self) -> str:
        """A genuine, allow-listed peer still gets through: handshake, a batch,
        its acknowledgement, the record stored. Returns the record's id."""
        with RawPeer(self.port, self.pki["node1"], self.pki.ca) as good:
            assert good.handshake("node1") == HUB_HANDSHAKE
            rec = envelope("temps", "node1", {"good": True})
            rid = json.loads(rec)["id"]
            good.send_binary(batch(rec))
            assert good.recv_text() == json.dumps({"last_id": rid}, separators=(",", ":"))
        assert rid in stored_ids(self.dir, "temps")
        return rid


@pytest.fixture
def hub(pki: PKI, tmp_path: Path, start: Starter) -> Hub:
    return Hub(pki, tmp_path, start)


def ack_of(rid: str) -> str:
    return json.dumps({"last_id": rid}, separators=(",", ":"))


def rid_of(record: bytes) -> str:
    return str(json.loads(record)["id"])


def expect_refused_at_tls(make: Any) -> None:
    """``make()`` opens a connection that the hub must refuse during TLS: the
    handshake or the first read fails, and no HTTP 101 is ever seen."""
    with pytest.raises((OSError, PeerClosed, AssertionError)) as info:
        conn = make()
        with contextlib.suppress(Exception):
            conn.close()
    assert "HTTP/1.1 101" not in str(info.value), f"upgraded: {info.value}"


def assert_no_app_level_trace(hub: Hub) -> None:
    """A refusal before the application: no audit record at all, no counters."""
    assert audit_records(hub.dir) == []
    status = hub.status()
    assert (status["accepted"], status["rejected"], status["peers"]) == (0, 0, [])


def mask(payload: bytes, key: bytes) -> bytes:
    n = len(payload)
    if n == 0:
        return b""
    stream = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(stream, "big")).to_bytes(n, "big")


def send_frame(
    raw: RawPeer, opcode: int, payload: bytes, *, fin: bool = True, declared: int | None = None
) -> None:
    """One masked client frame; ``declared`` overrides the length in the header
    (the payload sent may then be shorter than announced)."""
    n = len(payload) if declared is None else declared
    b0 = (0x80 if fin else 0) | opcode
    if n < 126:
        head = struct.pack(">BB", b0, 0x80 | n)
    elif n < 1 << 16:
        head = struct.pack(">BBH", b0, 0x80 | 126, n)
    else:
        head = struct.pack(">BBQ", b0, 0x80 | 127, n)
    key = os.urandom(4)
    raw.sock.sendall(head + key + mask(payload, key))


def expect_closed_without_ack(raw: RawPeer, timeout: float = 15.0) -> None:
    """The hub drops the connection (Close frame, EOF, reset or TLS error);
    it never acknowledges the bad message."""
    try:
        while True:
            op, body = raw.recv(timeout=timeout)
            assert op != OP_TEXT, f"the hub acknowledged a bad message: {body!r}"
    except TimeoutError:
        pytest.fail(f"the hub neither answered nor closed within {timeout:.0f}s")
    except (PeerClosed, OSError):
        pass


def upgrade(sock: ssl.SSLSocket | socket.socket, host: str, port: int) -> bytes:
    """Sends the WebSocket upgrade request; returns the response head."""
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise PeerClosed(None, f"EOF after {head!r}")
        head += chunk
    accept = base64.b64encode(
        hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()
    ).decode()
    assert head.startswith(b"HTTP/1.1 101") and accept.encode() in head, head
    return head


def tls_context(cert: CertPair | None, ca: Path, *, tls12_only: bool = False) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    if tls12_only:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    else:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def ws_peer(port: int, ctx: ssl.SSLContext, host: str = "127.0.0.1") -> RawPeer:
    """A RawPeer over a TLS context of our choosing (upgraded). The socket is
    closed if any step fails."""
    raw = socket.create_connection((host, port), timeout=10)
    try:
        sock = ctx.wrap_socket(raw, server_hostname=host)
    except BaseException:
        raw.close()
        raise
    try:
        upgrade(sock, host, port)
    except BaseException:
        sock.close()
        raise
    peer_ = RawPeer.__new__(RawPeer)
    peer_.sock = sock
    peer_._buf = b""
    return peer_


def client_ctx(cert: CertPair, pki: PKI) -> ssl.SSLContext:
    """What RawPeer uses: TLS 1.3, the test CA, a client certificate."""
    return tls_context(cert, pki.ca)


def wait_eof(sock: socket.socket | ssl.SSLSocket, timeout: float) -> float:
    """Reads until the peer closes; returns the seconds it took."""
    t0 = time.monotonic()
    sock.settimeout(timeout)
    with contextlib.suppress(ssl.SSLError, ConnectionResetError, BrokenPipeError):
        while sock.recv(65536):
            pass
    return time.monotonic() - t0


# -- certificates ------------------------------------------------------------


def resign(
    pki: PKI,
    base: CertPair,
    out: Path,
    *,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
) -> CertPair:
    """A copy of ``base``'s certificate (same subject, key and extensions)
    re-issued by the test CA with another validity window."""
    ca_cert = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    cert = x509.load_pem_x509_certificate(base.cert.read_bytes())
    builder = (
        x509.CertificateBuilder()
        .subject_name(cert.subject)
        .issuer_name(ca_cert.subject)
        .public_key(cert.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
    )
    for ext in cert.extensions:
        builder = builder.add_extension(ext.value, ext.critical)
    new = builder.sign(ca_key, hashes.SHA384())  # type: ignore[arg-type]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(new.public_bytes(serialization.Encoding.PEM))
    return CertPair(out, base.key)


# ---------------------------------------------------------------------------
# Certificates and TLS
# ---------------------------------------------------------------------------

NOW = datetime.datetime.now(datetime.timezone.utc)
WINDOWS = {
    "expired": (NOW - datetime.timedelta(days=10), NOW - datetime.timedelta(days=1)),
    "not-yet-valid": (NOW + datetime.timedelta(days=1), NOW + datetime.timedelta(days=10)),
}


@pytest.mark.parametrize("case", sorted(WINDOWS))
def test_certificate_outside_its_validity_is_refused(
    pki: PKI, tmp_path: Path, start: Starter, case: str
) -> None:
    nb, na = WINDOWS[case]
    bad = resign(pki, pki["node1"], tmp_path / "certs" / f"{case}.crt", not_before=nb, not_after=na)
    # Control: the same certificate re-issued with a current window is fine,
    # so the refusal below is about the validity window alone.
    good = resign(
        pki,
        pki["node1"],
        tmp_path / "certs" / "current.crt",
        not_before=NOW - datetime.timedelta(days=1),
        not_after=NOW + datetime.timedelta(days=1),
    )
    h = Hub(pki, tmp_path, start)
    expect_refused_at_tls(lambda: ws_peer(h.port, client_ctx(bad, pki)))
    assert_no_app_level_trace(h)
    assert stored_ids(h.dir, "temps") == []

    with RawPeer(h.port, good, pki.ca) as ok:
        assert ok.handshake("node1") == HUB_HANDSHAKE
    h.assert_serves_good_peer()
    h.assert_confined(channels={"temps"}, cursors={"cmds/fed-node1"})


def test_certificate_from_another_ca_is_refused(hub: Hub, pki: PKI) -> None:
    # CN node1 (allow-listed), issued by a CA the hub does not trust.
    expect_refused_at_tls(lambda: ws_peer(hub.port, client_ctx(pki["foreign"], pki)))
    assert_no_app_level_trace(hub)
    hub.assert_serves_good_peer()
    hub.assert_confined(channels={"temps"})


def test_no_client_certificate_is_refused(hub: Hub, pki: PKI) -> None:
    expect_refused_at_tls(lambda: ws_peer(hub.port, tls_context(None, pki.ca)))
    assert_no_app_level_trace(hub)
    hub.assert_serves_good_peer()


def test_ca_certificate_used_as_client_leaf_is_refused(hub: Hub, pki: PKI) -> None:
    ca_as_leaf = CertPair(pki.ca, pki.ca_key)  # CN keyop-ca is even allow-listed
    expect_refused_at_tls(lambda: ws_peer(hub.port, client_ctx(ca_as_leaf, pki)))
    assert_no_app_level_trace(hub)
    assert not list((hub.dir / "subscribers").glob(f"*/fed-{CA_CN}.offset"))
    hub.assert_serves_good_peer()
    hub.assert_confined(channels={"temps"})


def test_cn_not_in_allowlist_gets_4403_and_an_audit_record(hub: Hub, pki: PKI) -> None:
    with RawPeer(hub.port, pki["intruder"], pki.ca) as raw:
        # It asks for a channel and claims an allow-listed name: neither helps.
        raw.send_text(
            json.dumps(
                {"instance_name": "node2", "role": "client", "version": "1", "subscribe": ["cmds"]}
            )
        )
        with pytest.raises(PeerClosed) as closed:
            raw.recv(timeout=15)
        with contextlib.suppress(OSError):  # the hub is gone; this must not be stored
            raw.send_binary(batch(envelope("temps", "intruder", {"evil": True})))
    assert (closed.value.code, closed.value.reason) == (4403, "not in allowlist")
    wait_until(lambda: audit_events(hub.dir, "client_rejected"), "client_rejected")
    (rejected,) = audit_events(hub.dir, "client_rejected")
    assert rejected["peer"] == "intruder", "the audit names the certificate CN"
    assert hub.status()["rejected"] == 1 and hub.status()["accepted"] == 0
    assert audit_events(hub.dir, "client_connected") == []
    assert stored_ids(hub.dir, "temps") == []
    hub.assert_serves_good_peer()
    hub.assert_confined(channels={"temps"})


def test_a_peer_not_in_the_allowlist_is_refused_before_its_handshake_is_read(
    hub: Hub, pki: PKI
) -> None:
    """Its handshake is never read: the first fragment of a handshake that
    would be megabytes long (its end never sent) gets 4403 at once, not a
    handshake timeout, so such peers cannot make the hub hold their data."""
    with RawPeer(hub.port, pki["intruder"], pki.ca) as raw:
        send_frame(raw, OP_TEXT, b'{"instance_name":"intruder","x":"' + b"a" * 65536, fin=False)
        with pytest.raises(PeerClosed) as closed:
            while True:
                raw.recv(timeout=HANDSHAKE_TIMEOUT_S - 2)
    assert (closed.value.code, closed.value.reason) == (4403, "not in allowlist")
    wait_until(lambda: audit_events(hub.dir, "client_rejected"), "client_rejected")
    assert hub.status()["rejected"] == 1
    hub.assert_serves_good_peer()


def test_invalid_channel_names_in_a_handshake_are_one_warning(
    hub: Hub, pki: PKI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    names = [f"../x{i}" for i in range(500)] + ["cmds"]
    with RawPeer(hub.port, pki["node2"], pki.ca) as raw:
        raw.send_text(
            json.dumps(
                {"instance_name": "node2", "role": "client", "version": "1", "subscribe": names}
            )
        )
        assert json.loads(raw.recv(timeout=15)[1])["role"] == "hub"
    invalid = [r.getMessage() for r in caplog.records if "invalid channel" in r.getMessage()]
    assert len(invalid) == 1, len(invalid)
    assert "asked for 500 invalid channel name(s)" in invalid[0], invalid[0]
    assert len(invalid[0]) < 2000


def test_a_peer_connecting_many_times_at_once_keeps_its_cursors_whole(
    hub: Hub, pki: PKI, caplog: pytest.LogCaptureFixture
) -> None:
    """Each new connection of a durable peer closes its older one and waits
    for it to end before reading the peer's cursors: connections racing
    never write one cursor file at once (errors, emptied files)."""
    caplog.set_level(logging.INFO)
    hello = json.dumps(
        {"instance_name": "node1", "role": "client", "version": "1", "subscribe": ["cmds"]}
    )
    welcomed = []
    lock = threading.Lock()

    def storm() -> None:
        for _ in range(25):
            with contextlib.suppress(OSError, PeerClosed, TimeoutError):
                with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
                    raw.send_text(hello)
                    op, _ = raw.recv(timeout=15)
                    with lock:
                        welcomed.append(op)

    threads = [threading.Thread(target=storm, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert welcomed, "some connections were served"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors[:5]
    cursor = hub.dir / "subscribers" / "cmds" / "fed-node1.offset"
    assert cursor.read_text().strip().isdigit(), repr(cursor.read_text())
    hub.assert_serves_good_peer()


def test_a_rejected_client_is_told_which_certificate_was_refused(hub: Hub, pki: PKI) -> None:
    from fed_helpers import client_config
    from keyop_messenger import ConnectionLostError, EphemeralMessenger

    cfg = client_config(pki, hub.dir.parent / "intruder", "intruder", hub.port)
    with pytest.raises(ConnectionLostError) as info:
        with EphemeralMessenger(cfg):
            pass
    text = str(info.value)
    assert "CN=intruder" in text and "hub.allowed_peers" in text, text


def test_rejected_peer_is_logged_as_a_warning(
    hub: Hub, pki: PKI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    # Each rejection is audited; the warning comes once per 10 s, so a peer
    # that keeps dialing cannot flood the log.
    for _ in range(5):
        with RawPeer(hub.port, pki["intruder"], pki.ca) as raw, pytest.raises(PeerClosed):
            raw.handshake("intruder")
    wait_until(lambda: len(audit_events(hub.dir, "client_rejected")) == 5, "5 client_rejected")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    rejected = [r for r in warnings if "rejected peer" in r.getMessage()]
    assert len(rejected) == 1 and "intruder" in rejected[0].getMessage(), [
        r.getMessage() for r in caplog.records
    ]


@pytest.mark.parametrize("claimed", ["node2", "../../escape", ""])
def test_identity_is_the_certificate_cn_not_the_claimed_name(
    hub: Hub, pki: PKI, claimed: str
) -> None:
    """node1's certificate with a handshake claiming another name: the hub
    applies node1's policy and names node1 in audit records and cursor files."""
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        hello = {
            "instance_name": claimed,
            "role": "hub",
            "version": "1",
            "subscribe": ["cmds", "secret"],
        }
        raw.send_text(json.dumps(hello))
        assert raw.recv_text() == HUB_HANDSHAKE
        wait_peers(hub.m, "node1")
        temps = envelope("temps", claimed or "x", {"t": 1})
        secret = envelope("secret", claimed or "x", {"t": 2})  # node2 may, node1 may not
        raw.send_binary(batch(temps, secret))
        assert raw.recv_text() == ack_of(rid_of(secret))
        cmd = hub.m.publish("cmds", "test.Command", {})
        got = raw.recv_binary()
        assert rid_of(got[4:]) == cmd
        raw.send_text(ack_of(""))

    (connected,) = audit_events(hub.dir, "client_connected")
    assert connected["peer"] == "node1"
    assert connected["detail"].endswith("sub=[cmds] pub=[temps]"), connected
    (fwd,) = audit_events(hub.dir, "forward", direction="inbound")
    assert (fwd["peer"], fwd["message_id"]) == ("node1", rid_of(temps))
    (violation,) = audit_events(hub.dir, "policy_violation")
    assert (violation["peer"], violation["channel"]) == ("node1", "secret")
    assert stored_ids(hub.dir, "temps") == [rid_of(temps)]
    assert stored_ids(hub.dir, "secret") == []
    assert cursor_path(hub.dir, "cmds", "fed-node1").exists()
    assert not list((hub.dir / "subscribers").glob("*/fed-node2*"))
    hub.assert_confined(channels={"temps", "cmds"}, cursors={"cmds/fed-node1"})


def test_acknowledgements_sent_before_a_batch_acknowledge_nothing(
    hub: Hub, pki: PKI, caplog: pytest.LogCaptureFixture
) -> None:
    """An acknowledgement a client sends with no batch outstanding is dropped:
    the hub's next batch still waits for its own, so a batch the client never
    acknowledged is sent again on the next connection (it was taken as the
    acknowledgement of the batch to come, and the cursor moved past it)."""
    caplog.set_level(logging.WARNING)
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        assert raw.handshake("node1", subscribe=["cmds"]) == HUB_HANDSHAKE
        wait_peers(hub.m, "node1")
        raw.send_text(ack_of(""))
        # (The protocol's acknowledgements name no batch: one arriving after a
        # batch was sent is taken as its own. So the hub reads it first.)
        wait_until(
            lambda: "dropped an acknowledgement" in caplog.text, "the unsolicited ack dropped"
        )
        cmd = hub.m.publish("cmds", "test.Command", {})
        assert rid_of(raw.recv_binary()[4:]) == cmd
    with RawPeer(hub.port, pki["node1"], pki.ca) as again:
        assert again.handshake("node1", subscribe=["cmds"]) == HUB_HANDSHAKE
        assert rid_of(again.recv_binary()[4:]) == cmd, "the unacknowledged batch is sent again"
        again.send_text(ack_of(cmd))


def test_pings_before_the_handshake_are_answered(hub: Hub, pki: PKI) -> None:
    """Control frames may come at any point (RFC 6455): a ping before the
    handshake is answered and the handshake read after it (it ended the
    connection)."""
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        raw.send_frame(fed_helpers.OP_PING, b"early")
        assert raw._read_frame() == (True, fed_helpers.OP_PONG, b"early")
        assert raw.handshake("node1") == HUB_HANDSHAKE
    hub.assert_serves_good_peer()


@pytest.mark.parametrize("text", ["[1,2,3]", "not json", '"ack"'])
def test_an_acknowledgement_that_is_not_a_json_object_ends_the_connection(
    hub: Hub, pki: PKI, text: str
) -> None:
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        assert raw.handshake("node1", subscribe=["cmds"]) == HUB_HANDSHAKE
        wait_peers(hub.m, "node1")
        cmd = hub.m.publish("cmds", "test.Command", {})
        assert rid_of(raw.recv_binary()[4:]) == cmd
        raw.send_text(text)
        with pytest.raises(PeerClosed):
            raw.recv()
    with RawPeer(hub.port, pki["node1"], pki.ca) as again:
        assert again.handshake("node1", subscribe=["cmds"]) == HUB_HANDSHAKE
        assert rid_of(again.recv_binary()[4:]) == cmd, "the batch was not acknowledged"


def test_tls12_client_is_refused_when_13_is_required(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    h = Hub(pki, tmp_path, start)
    ctx12 = tls_context(pki["node1"], pki.ca, tls12_only=True)
    expect_refused_at_tls(lambda: ws_peer(h.port, ctx12))
    assert_no_app_level_trace(h)
    h.assert_serves_good_peer()

    # Control: the same TLS 1.2 client is served by a hub with min_version 1.2.
    tls = tls_section(pki, "hub1")
    tls["min_version"] = "1.2"
    lax = start(hub_config(pki, tmp_path / "hub12", allowlist(), tls=tls))
    with ws_peer(hub_port(lax), tls_context(pki["node1"], pki.ca, tls12_only=True)) as raw:
        assert raw.sock.version() == "TLSv1.2"
        assert raw.handshake("node1") == HUB_HANDSHAKE


# ---------------------------------------------------------------------------
# Not even TLS / no handshake
# ---------------------------------------------------------------------------

FAILED_STAGES = ("tls", "websocket", "handshake", "timeout", "evicted")

GARBAGE = {
    "binary-garbage": bytes(range(256)) * 8,
    "http-request": b"GET / HTTP/1.1\r\nHost: hub1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    "tls-record-header-then-junk": b"\x16\x03\x01\xff\xff" + b"\x00" * 1000,
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_plain_tcp_garbage_and_http_are_dropped(hub: Hub, kind: str) -> None:
    with socket.create_connection(("127.0.0.1", hub.port), timeout=10) as s:
        with contextlib.suppress(OSError):
            s.sendall(GARBAGE[kind])
        reply = b""
        s.settimeout(HANDSHAKE_TIMEOUT_S + SLACK_S)
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(4096):
                reply += chunk
    assert not reply.startswith(b"HTTP/"), f"an HTTP answer on a TLS port: {reply[:80]!r}"
    assert_no_app_level_trace(hub)
    hub.assert_serves_good_peer()
    hub.assert_confined(channels={"temps"})


@pytest.mark.parametrize("first", [b"not json", b"", b"[1,2]"])
def test_bad_handshake_message_is_dropped_without_reply(hub: Hub, pki: PKI, first: bytes) -> None:
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        if first:
            raw.send_text(first.decode())
        else:
            raw.send_binary(batch(envelope("temps", "node1", {})))  # a batch instead
        expect_closed_without_ack(raw)
    assert audit_events(hub.dir, "client_connected") == []
    assert stored_ids(hub.dir, "temps") == []
    hub.assert_serves_good_peer()


def test_hub_counts_what_it_refuses_in_its_metrics(hub: Hub, pki: PKI) -> None:
    """Refusals reach an operator as counters and Prometheus samples, not only
    as log lines and audit records: connections that end before their
    handshake, per stage, and refused records, per reason."""
    with socket.create_connection(("127.0.0.1", hub.port), timeout=10) as s:
        s.sendall(GARBAGE["http-request"])  # not TLS
        s.settimeout(HANDSHAKE_TIMEOUT_S + SLACK_S)
        with contextlib.suppress(ConnectionResetError):
            while s.recv(4096):
                pass
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        raw.send_text("not json")
        expect_closed_without_ack(raw)
    hub.wait_failed(tls=1, handshake=1)
    good = envelope("temps", "node1", {"n": 1})
    too_large = envelope("temps", "node1", "x" * (10 << 20))
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        raw.handshake("node1")
        raw.send_binary(batch(envelope("cmds", "node1", {}), b"{not json", too_large, good))
        assert raw.recv_text() == ack_of(rid_of(good))
    listener = hub.listener()
    refused = {"policy": 1, "too_large": 1, "invalid": 1, "channel_limit": 0}
    assert listener.records_refused == refused
    assert listener.records_received == 1
    assert (listener.connections_accepted, listener.connections_rejected) == (1, 0)
    lines = render(hub.m.stats()).splitlines()
    for reason, n in refused.items():
        assert f'keyop_hub_records_refused_total{{reason="{reason}"}} {n}' in lines
    for stage in FAILED_STAGES:
        n = 1 if stage in ("tls", "handshake") else 0
        assert f'keyop_hub_connections_failed_total{{stage="{stage}"}} {n}' in lines


def test_handshake_that_never_comes_times_out(hub: Hub, pki: PKI) -> None:
    """Silent connections at three stages are closed by the hub after its
    10 s handshake timeout (plus slack), and do not keep it from serving."""
    bound = HANDSHAKE_TIMEOUT_S + SLACK_S
    began: dict[str, float] = {}  # before connecting: the hub's timer starts later
    began["tcp"] = time.monotonic()
    tcp_only = socket.create_connection(("127.0.0.1", hub.port), timeout=10)
    ctx = tls_context(pki["node1"], pki.ca)
    began["tls"] = time.monotonic()
    tls_only = ctx.wrap_socket(
        socket.create_connection(("127.0.0.1", hub.port), timeout=10), server_hostname="127.0.0.1"
    )
    began["ws"] = time.monotonic()
    upgraded = ws_peer(hub.port, ctx)
    socks: dict[str, Any] = {"tcp": tcp_only, "tls": tls_only, "ws": upgraded.sock}
    closed_after: dict[str, float] = {}

    def watch(name: str) -> None:
        wait_eof(socks[name], bound + 5)
        closed_after[name] = time.monotonic() - began[name]

    watchers = [threading.Thread(target=watch, args=(n,), daemon=True) for n in socks]
    try:
        for t in watchers:
            t.start()
        # While three silent connections are open, a real peer is served.
        hub.assert_serves_good_peer()
        for t in watchers:
            t.join(timeout=bound + 10)
    finally:
        for s in socks.values():
            with contextlib.suppress(OSError):
                s.close()
    assert set(closed_after) == set(socks), f"still open: {set(socks) - set(closed_after)}"
    for name, took in closed_after.items():
        # The hub allows the full 10 s, and not much more.
        assert HANDSHAKE_TIMEOUT_S - 0.5 <= took <= bound, f"{name}: closed after {took:.1f}s"
    assert hub.status()["accepted"] == 1, "only the good peer got through"
    assert len(audit_events(hub.dir, "client_connected", peer="node1")) == 1
    hub.wait_failed(timeout=3)


# ---------------------------------------------------------------------------
# Bad batches
# ---------------------------------------------------------------------------


def test_one_gib_length_prefix_drops_the_connection(hub: Hub, pki: PKI) -> None:
    valid = envelope("temps", "node1", {"before": "the bad prefix"})
    body = batch(valid) + struct.pack(">I", 1 << 30) + b'{"v":1}'
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        raw.handshake("node1")
        raw.send_binary(body)
        expect_closed_without_ack(raw)
    wait_until(lambda: audit_events(hub.dir, "peer_disconnected", peer="node1"), "disconnect")
    (gone,) = audit_events(hub.dir, "peer_disconnected", peer="node1")
    assert "err=" in gone["detail"], gone
    assert stored_ids(hub.dir, "temps") == [], "a malformed message is discarded whole"
    assert audit_events(hub.dir, "forward") == []
    hub.assert_serves_good_peer()
    hub.assert_confined(channels={"temps"}, cursors={"cmds/fed-node1"})


@pytest.mark.parametrize("cut", ["inside-record", "inside-prefix"])
def test_batch_truncated_mid_record_drops_the_connection(hub: Hub, pki: PKI, cut: str) -> None:
    valid = envelope("temps", "node1", {"n": 1})
    second = batch(envelope("temps", "node1", {"n": 2}))
    body = batch(valid) + (second[: len(second) // 2] if cut == "inside-record" else second[:3])
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        raw.handshake("node1")
        raw.send_binary(body)
        expect_closed_without_ack(raw)
    assert stored_ids(hub.dir, "temps") == []
    hub.assert_serves_good_peer()


def test_batch_split_across_websocket_frames_is_reassembled(hub: Hub, pki: PKI) -> None:
    """A fragmented message (RFC 6455 §5.4) split mid length prefix and mid
    record is one batch: stored whole and acknowledged once."""
    records = [envelope("temps", "node1", {"n": i}) for i in range(3)]
    body = batch(*records)
    cuts = [2, len(records[0]) + 4 + 10, len(body) - 5]
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        raw.handshake("node1")
        for i, piece in enumerate(pieces):
            send_frame(raw, OP_BINARY if i == 0 else OP_CONT, piece, fin=i == len(pieces) - 1)
        assert raw.recv_text() == ack_of(rid_of(records[-1]))
    assert raw_records(hub.dir, "temps") == records


def test_unreadable_records_are_skipped_and_the_rest_stored(hub: Hub, pki: PKI) -> None:
    good1 = envelope("temps", "node1", {"n": 1})
    good2 = envelope("temps", "node1", {"n": 2})
    base = json.loads(good1)
    variants = {
        "invalid-utf8": b"\xff\xfe\xfd",
        "utf8-in-string": envelope("temps", "node1", "x").replace(b'"x"', b'"\xff\xfe"'),
        "utf8-in-id": envelope("temps", "node1", {}).replace(b'"id":"', b'"id":"\xc3', 1),
        "not-json": b"{not json",
        "not-an-object": b"[1,2,3]",
        "empty": b"",
        "v2": json.dumps({**base, "id": str(uuid.uuid4()), "v": 2}).encode(),
        "v-string": json.dumps({**base, "id": str(uuid.uuid4()), "v": "1"}).encode(),
        "v-missing": json.dumps(
            {k: v for k, v in {**base, "id": str(uuid.uuid4())}.items() if k != "v"}
        ).encode(),
        "bad-ts": json.dumps({**base, "id": str(uuid.uuid4()), "ts": "yesterday"}).encode(),
        "no-id": json.dumps({**base, "id": ""}).encode(),
    }
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        raw.handshake("node1")
        raw.send_binary(batch(good1, *variants.values(), good2))
        assert raw.recv_text() == ack_of(rid_of(good2))
        # Alone, none of them qualifies: the acknowledgement names nothing.
        raw.send_binary(batch(*variants.values()))
        assert raw.recv_text() == ack_of("")
    assert raw_records(hub.dir, "temps") == [good1, good2]
    for line in (hub.dir / "channels" / "temps").glob("*.jsonl"):
        line.read_bytes().decode("utf-8")  # the log stays valid UTF-8
    inbound = [r["message_id"] for r in audit_events(hub.dir, "forward", direction="inbound")]
    assert inbound == [rid_of(good1), rid_of(good2)]
    assert audit_events(hub.dir, "policy_violation") == []
    hub.assert_confined(channels={"temps"}, cursors={"cmds/fed-node1"})


def test_records_without_an_id_are_audited_one_by_one_only_up_to_a_bound(
    hub: Hub, pki: PKI
) -> None:
    """Empty records cost the sender 4 bytes each: past the first 16 of a
    batch, their refusals are counted in one audit line (and left out of the
    acknowledgement), not written and listed one by one."""
    good = envelope("temps", "node1", {"n": 1})
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        raw.handshake("node1", features=["refusals"])
        raw.send_binary(batch(*([b""] * 10_000), good))
        doc = json.loads(raw.recv_text())
    assert doc["last_id"] == rid_of(good)
    assert doc["refused"] == [{"id": "", "channel": "", "reason": "invalid"}] * 16
    refused = audit_events(hub.dir, "record_refused")
    assert len(refused) == 17
    assert "9984 more records without an id" in refused[-1]["detail"], refused[-1]
    assert raw_records(hub.dir, "temps") == [good]


def test_subscribing_to_new_channels_spends_the_peers_channel_budget(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    """A subscription creates its channel; a handshake naming thousands of
    new channels must not create thousands of directories. New channels
    subscribed to and published to share the peer's ``max_channels``."""
    hub_dir = tmp_path / "hub"
    node1 = {**peer("node1"), "max_channels": 3}
    hub = start(hub_config(pki, hub_dir, [node1]))
    hub.publish("old", "t", {})  # exists: costs no budget
    asked = ["old", *(f"new{i}" for i in range(200))]
    with RawPeer(hub_port(hub), pki["node1"], pki.ca) as raw:
        raw.handshake("node1", subscribe=asked, features=["refusals"])
        wait_peers(hub, "node1")
        created = {p.name for p in (hub_dir / "channels").iterdir()}
        assert created == {"old", "new0", "new1", "new2"}
        # The budget is spent: a record for yet another new channel is refused.
        raw.send_binary(batch(envelope("new9", "node1", {})))
        doc = json.loads(raw.recv_text())
        assert [r["reason"] for r in doc["refused"]] == ["channel_limit"]
        # A channel it subscribed to is delivered as before.
        sent = hub.publish("new1", "t", {"n": 1})
        assert [rid_of(r) for r in split_batch(raw.recv_binary())] == [sent]
    (connected,) = audit_events(hub_dir, "client_connected", peer="node1")
    assert "sub=[old,new0,new1,new2]" in connected["detail"]


def test_a_reloaded_max_channels_applies_to_a_peer_that_connected_before(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    """The budget of a peer is kept across its connections; a reload that
    changes its ``max_channels`` changes the budget's limit (it was fixed by
    the first connection)."""
    hub_dir = tmp_path / "hub"
    hub = start(hub_config(pki, hub_dir, [{**peer("node1"), "max_channels": 0}]))

    def send(channel: str) -> list[str]:
        with RawPeer(hub_port(hub), pki["node1"], pki.ca) as raw:
            raw.handshake("node1", features=["refusals"])
            raw.send_binary(batch(envelope(channel, "node1", {})))
            return [r["reason"] for r in json.loads(raw.recv_text()).get("refused", [])]

    assert send("a") == ["channel_limit"]
    hub.set_allowed_peers([AllowedPeer(name="node1", max_channels=5)])
    assert send("a") == [], "the raised limit applies"
    hub.set_allowed_peers([AllowedPeer(name="node1", max_channels=1)])
    assert send("b") == ["channel_limit"], "the lowered limit applies (a counts)"
    assert sorted(p.name for p in (hub_dir / "channels").iterdir()) == ["a"]


def test_a_batch_of_many_chunks_is_checked_as_a_whole(hub: Hub, pki: PKI) -> None:
    """The hub decodes, checks and claims a large batch a chunk of 512 records
    at a time: a record repeated in later chunks is stored once, a refusal in
    any chunk is audited, and the acknowledgement names the batch's last
    record that counts."""
    records = [envelope("temps", "node1", {"n": i}) for i in range(1300)]
    again = records[100]  # chunk 0, sent again in chunks 1 and 2
    secret = envelope("secret", "node1", {"t": 1})  # node1 may not publish it
    sent = [*records[:700], again, secret, *records[700:1200], again, *records[1200:]]
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        raw.handshake("node1")
        raw.send_binary(batch(*sent))
        assert raw.recv_text() == ack_of(rid_of(records[-1]))
        # Last in a batch of its own chunks, the refused one is named.
        raw.send_binary(batch(*records[:600], secret))
        assert raw.recv_text() == ack_of(rid_of(secret))
    assert raw_records(hub.dir, "temps") == records
    (violation, _again) = audit_events(hub.dir, "policy_violation")
    assert (violation["channel"], violation["message_id"]) == ("secret", rid_of(secret))
    inbound = [r["message_id"] for r in audit_events(hub.dir, "forward", direction="inbound")]
    assert inbound == [rid_of(r) for r in records]


BAD_CHANNELS = [
    "../x",
    "../../escape",
    "a/b",
    "x.dead-letter",
    "temps.dead-letter",
    "..",
    ".",
    "/abs",
    "a\\b",
    "sp ace",
    "é",
    "x" * 256,
]


def test_records_for_bad_channel_names_are_policy_violations(hub: Hub, pki: PKI) -> None:
    bad = [envelope(ch, "node2", {"evil": ch}) for ch in BAD_CHANNELS]
    good = envelope("temps", "node2", {"ok": True})
    with RawPeer(hub.port, pki["node2"], pki.ca) as raw:
        # node2 has no publish allowlist: only the name rules refuse these.
        raw.handshake("node2", subscribe=["../../sub-escape", "a/b", "ok.dead-letter"])
        raw.send_binary(batch(bad[0], good, *bad[1:]))
        assert raw.recv_text() == ack_of(rid_of(bad[-1])), "refused records are acknowledged"
    assert raw_records(hub.dir, "temps") == [good]
    # Dead-letter names are valid names a peer may not publish (policy); the
    # others make the record invalid (envelope.rs), and are not echoed.
    violations = audit_events(hub.dir, "policy_violation")
    invalid = audit_events(hub.dir, "record_refused")
    dead = {"x.dead-letter", "temps.dead-letter"}
    assert [(v["channel"], v["message_id"]) for v in violations] == [
        (ch, rid_of(rec)) for ch, rec in zip(BAD_CHANNELS, bad, strict=True) if ch in dead
    ]
    assert [(v.get("channel", ""), v["message_id"]) for v in invalid] == [
        ("", rid_of(rec)) for ch, rec in zip(BAD_CHANNELS, bad, strict=True) if ch not in dead
    ]
    assert all(v["detail"].startswith("reason=invalid ") for v in invalid)
    assert all(
        (v["peer"], v["direction"]) == ("node2", "inbound") for v in violations + invalid
    )
    assert not (hub.dir / "x").exists() and not (hub.dir / "channels" / "a").exists()
    assert not (hub.dir / "channels" / "x.dead-letter").exists()
    assert not (hub.dir / "channels" / "temps.dead-letter").exists()
    # The valid dead-letter-shaped subscription gets its cursor, the others nothing.
    hub.assert_confined(channels={"temps", "ok.dead-letter"}, cursors={"ok.dead-letter/fed-node2"})


# ---------------------------------------------------------------------------
# Oversize WebSocket messages
# ---------------------------------------------------------------------------


def test_websocket_frame_announcing_one_gib_is_refused(hub: Hub, pki: PKI) -> None:
    with RawPeer(hub.port, pki["node1"], pki.ca) as raw:
        raw.handshake("node1")
        send_frame(raw, OP_BINARY, b"\x00" * 1024, declared=1 << 30)
        expect_closed_without_ack(raw)
    assert stored_ids(hub.dir, "temps") == []
    hub.assert_serves_good_peer()


def test_websocket_message_over_the_limit_is_refused(
    pki: PKI, tmp_path: Path, start: Starter
) -> None:
    # Limit: max_batch_bytes + one maximal record (10 MiB) + 64 KiB.
    h = Hub(pki, tmp_path, start, max_batch_bytes=1024)
    limit = 1024 + 10 * 1024 * 1024 + 64 * 1024
    record = envelope("temps", "node1", {"blob": "z" * 1000})
    body = batch(record) * (limit // (len(record) + 4) + 20)
    assert len(body) > limit
    half = len(body) // 2
    with RawPeer(h.port, pki["node1"], pki.ca) as raw:
        raw.handshake("node1")
        with contextlib.suppress(OSError):  # the hub may hang up while we still send
            send_frame(raw, OP_BINARY, body[:half], fin=False)
            send_frame(raw, OP_CONT, body[half:], fin=True)
        expect_closed_without_ack(raw, timeout=20)
    assert stored_ids(h.dir, "temps") == []
    h.assert_serves_good_peer()
    h.assert_confined(channels={"temps"}, cursors={"cmds/fed-node1"})


# ---------------------------------------------------------------------------
# Configuration files through Messenger(path)
# ---------------------------------------------------------------------------


@pytest.fixture
def no_data_dir(tmp_path: Path) -> Iterator[Path]:
    data = tmp_path / "data"
    yield data
    assert not data.exists(), "a refused configuration must not create the data directory"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def open_refused(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        Messenger(path)
    err = info.value
    assert isinstance(err, KeyopError) and isinstance(err, ValueError)
    assert err.problems and all(isinstance(p, str) and p for p in err.problems)
    for p in err.problems:
        assert p in str(err), "str(err) shows every problem"
    return err


def test_config_file_wrong_types_and_unknown_keys_in_one_error(
    tmp_path: Path, no_data_dir: Path
) -> None:
    cfg = write(
        tmp_path / "bad.yaml",
        f"""
name: n1
storage:
  data_dir: {no_data_dir}
  sync_interval_ms: fast        # wrong type
  max_segment_bytes: 1024       # unknown key
federation:
  reconnect_jitter: [0.2]       # wrong type
hub:
  enabled: "yes"                # wrong type (a string, not a boolean)
colour: blue                    # unknown top-level key
""",
    )
    err = open_refused(cfg)
    keys = sorted(p.split(":")[0] for p in err.problems)
    assert keys == [
        "colour",
        "federation.reconnect_jitter",
        "hub.enabled",
        "storage.max_segment_bytes",
        "storage.sync_interval_ms",
    ], err.problems


@pytest.mark.parametrize(
    "case,text,fragment",
    [
        ("missing", None, "cannot read"),
        ("directory", "", "cannot read"),
        ("empty", "", "empty"),
        ("malformed", "storage: {data_dir: [unclosed\n", "malformed YAML"),
        ("not-a-mapping", "- a\n- b\n", "mapping"),
        ("binary", "\udcff", "UTF-8"),
    ],
)
def test_unusable_config_file_is_one_clear_error(
    tmp_path: Path, no_data_dir: Path, case: str, text: str | None, fragment: str
) -> None:
    path = tmp_path / f"{case}.yaml"
    if case == "directory":
        path.mkdir()
    elif case == "binary":
        path.write_bytes(b"name: \xff\xfe\n")
    elif text is not None:
        path.write_text(text)
    err = open_refused(path)
    assert len(err.problems) == 1, err.problems
    assert fragment in err.problems[0], err.problems
    assert err.path == str(path) and f"in {path}: " in str(err), err
