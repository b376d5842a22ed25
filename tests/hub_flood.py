"""A hub in a child process and floods of hostile connections against it
(tests/test_hostile_connections.py, tests/test_hostile_memory.py).

* :class:`HubProcess`: a hub ``hub1`` on 127.0.0.1 in its own Python process,
  so that a test can limit it (``RLIMIT_NOFILE``) and measure it (``VmRSS``)
  without touching the test process. Ended (stdin closed, then killed if it
  lingers) by ``close()`` or its context manager.
* :class:`Flood`: ``n`` hostile connections of one kind held open; while
  running it re-opens, at a bounded pace, those the hub drops.
* :func:`round_trip`: one allowed peer's handshake, batch and acknowledgement.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from fed_helpers import PKI, RawPeer, batch, envelope, hub_config, peer

HOST = "127.0.0.1"
HUB_HANDSHAKE = '{"instance_name":"hub1","role":"hub","version":"1"}'

_HUB_SCRIPT = r"""
import json, logging, os, sys
from keyop_messenger import Config, Messenger
logging.basicConfig(level=os.environ.get("KEYOP_TEST_HUB_LOG", "WARNING"))
m = Messenger(Config.from_dict(json.loads(sys.argv[1])))
print(m.hub_address[1], m.metrics_address[1], flush=True)
sys.stdin.read()  # serve until the parent closes our stdin
m.close()
"""


def allowlist() -> list[dict[str, Any]]:
    return [peer("node1", publish=["temps"]), peer("node2")]


class HubProcess:
    """A hub in a child process (see the module docstring)."""

    def __init__(self, pki: PKI, data_dir: Path, *, nofile: int | None = None) -> None:
        cfg = hub_config(pki, data_dir, allowlist()).to_dict()
        cfg["metrics"] = {"listen_addr": f"{HOST}:0"}
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _HUB_SCRIPT, json.dumps(cfg, default=str)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                preexec_fn=limit,
            )
        try:
            assert self.proc.stdout is not None
            ready, _, _ = select.select([self.proc.stdout], [], [], 60)
            line = self.proc.stdout.readline() if ready else b""
            ports = line.split()
            assert len(ports) == 2 and all(p.isdigit() for p in ports), (
                f"hub did not start: {line!r} {self.log()}"
            )
            self.port, self.metrics_port = (int(p) for p in ports)
        except BaseException:
            self.close()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def rss_kib(self) -> int:
        """The hub process's resident set size (``VmRSS``), in KiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS in /proc/PID/status")

    def metric(self, sample: str) -> float:
        """The value of one sample (``name`` or ``name{labels}``, as the hub
        writes it) from the hub's ``/metrics``."""
        url = f"http://{HOST}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name == sample:
                return float(value)
        raise AssertionError(f"no sample {sample} in /metrics: {text[-2000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> HubProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _client_hello() -> bytes:
    """A TLS 1.3 ClientHello without any certificate behind it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def _mask(payload: bytes, key: bytes) -> bytes:
    n = len(payload)
    if n == 0:
        return b""
    stream = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(stream, "big")).to_bytes(n, "big")


def _text_frame(text: str) -> bytes:
    """One masked client text frame (payload under 126 bytes)."""
    body = text.encode()
    assert len(body) < 126
    key = os.urandom(4)
    return bytes([0x81, 0x80 | len(body)]) + key + _mask(body, key)


Kind = Literal["tcp", "tls", "ws", "link"]


class Flood:
    """Hostile connections against ``port``, all of one ``kind``:

    * ``tcp``: connected, silent;
    * ``tls``: a ClientHello sent, then silent (no certificate ever comes);
    * ``ws``: TLS with ``cert`` and the WebSocket upgrade done, but no
      application handshake (an allowed peer holding half-open links);
    * ``link``: as ``ws`` plus an ephemeral application handshake, then
      silent (an allowed peer holding idle established links).

    ``open_all`` opens them (with ``workers`` threads); ``start`` runs a
    thread that re-opens those the hub dropped, at most ``per_pass`` every
    ``pass_s`` seconds; ``close`` stops it and closes everything. Every
    loop is bounded by ``deadline_s``.
    """

    def __init__(
        self,
        port: int,
        kind: Kind,
        n: int,
        *,
        pki: PKI | None = None,
        cert: str = "node1",
        per_pass: int = 200,
        pass_s: float = 0.25,
        deadline_s: float = 120.0,
        workers: int = 1,
    ) -> None:
        self.port, self.kind, self.n = port, kind, n
        self.per_pass, self.pass_s, self.workers = per_pass, pass_s, workers
        self.deadline = time.monotonic() + deadline_s
        self.socks: list[socket.socket] = []
        self.opened = 0  # connections opened in all
        self.reopened = 0
        self.failed = 0  # opening attempts that failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._hello = _client_hello() if kind == "tls" else b""
        self._ctx: ssl.SSLContext | None = None
        self._name = cert
        self._inflight = 0
        if kind in ("ws", "link"):
            assert pki is not None
            self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            self._ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            self._ctx.load_verify_locations(str(pki.ca))
            self._ctx.load_cert_chain(str(pki[cert].cert), str(pki[cert].key))

    def _open_one(self) -> socket.socket | None:
        raw: socket.socket | None = None
        try:
            raw = socket.create_connection((HOST, self.port), timeout=10)
            if self.kind == "tls":
                raw.sendall(self._hello)
            elif self.kind in ("ws", "link"):
                assert self._ctx is not None
                sock: socket.socket = self._ctx.wrap_socket(raw, server_hostname=HOST)
                raw = sock
                sock.sendall(
                    f"GET / HTTP/1.1\r\nHost: {HOST}:{self.port}\r\nUpgrade: websocket\r\n"
                    "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    "Sec-WebSocket-Version: 13\r\n\r\n".encode()
                )
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = sock.recv(4096)
                    if not chunk:
                        raise ConnectionError("EOF before the upgrade response")
                    head += chunk
                if not head.startswith(b"HTTP/1.1 101"):
                    raise ConnectionError(head[:80].decode("latin-1"))
                if self.kind == "link":
                    hello = {"instance_name": self._name, "role": "client", "version": "1"}
                    hello["ephemeral"] = True
                    sock.sendall(_text_frame(json.dumps(hello, separators=(",", ":"))))
                    if not sock.recv(4096):
                        raise ConnectionError("EOF instead of the hub handshake")
            raw.setblocking(False)
            with self._lock:
                self.opened += 1
            return raw
        except (OSError, ConnectionError):
            with self._lock:
                self.failed += 1
            if raw is not None:
                raw.close()
            return None

    def open_all(self) -> int:
        """Opens connections until ``n`` are held (or ``3 n`` attempts were
        made, or the deadline); returns how many are held now."""
        self._fill(3 * self.n)
        return len(self.socks)

    def _fill(self, budget: int) -> int:
        """Opens connections (``workers`` threads) until ``n`` are held, the
        deadline passes, or ``budget`` attempts were made; returns the
        number opened."""
        tally = {"tries": 0, "opened": 0}

        def work() -> None:
            while time.monotonic() < self.deadline:
                with self._lock:
                    full = len(self.socks) + self._inflight >= self.n
                    if full or tally["tries"] >= budget or self._stop.is_set():
                        return
                    self._inflight += 1
                    tally["tries"] += 1
                s = self._open_one()
                with self._lock:
                    self._inflight -= 1
                    if s is not None:
                        self.socks.append(s)
                        tally["opened"] += 1

        threads = [threading.Thread(target=work, daemon=True) for _ in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.0, self.deadline - time.monotonic()) + 15)
        assert not any(t.is_alive() for t in threads), "an opening thread did not stop"
        return tally["opened"]

    @staticmethod
    def _dropped(s: socket.socket) -> bool:
        try:
            while True:
                if not s.recv(65536):
                    return True
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return False
        except OSError:
            return True

    def _pass(self) -> None:
        with self._lock:
            socks = list(self.socks)
        poller = select.poll()
        by_fd = {}
        for s in socks:
            with contextlib.suppress(ValueError, OSError):
                poller.register(s, select.POLLIN | select.POLLHUP | select.POLLERR)
                by_fd[s.fileno()] = s
        dead = [by_fd[fd] for fd, _ in poller.poll(0) if fd in by_fd and self._dropped(by_fd[fd])]
        with self._lock:
            for s in dead:
                self.socks.remove(s)
                s.close()
        if not self._stop.is_set():
            self.reopened += self._fill(self.per_pass)

    def _run(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self.deadline:
            self._pass()
            self._stop.wait(self.pass_s)

    def start(self) -> Flood:
        self._thread = threading.Thread(target=self._run, name=f"flood-{self.kind}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            assert not self._thread.is_alive(), "the flood thread did not stop"
        with self._lock:
            for s in self.socks:
                s.close()
            self.socks.clear()

    def __enter__(self) -> Flood:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send_binary_fast(raw: RawPeer, body: bytes) -> None:
    """RawPeer.send_binary, with masking fast enough for megabytes."""
    n = len(body)
    head = bytes([0x82, 0xFF]) + n.to_bytes(8, "big")
    key = os.urandom(4)
    raw.sock.sendall(head + key + _mask(body, key))


def round_trip(
    pki: PKI,
    port: int,
    name: str = "node2",
    *,
    payload: Any = None,
    timeout: float = 10.0,
    ephemeral: bool = False,
    send: Callable[[RawPeer, bytes], None] | None = None,
) -> str:
    """One allowed peer connects, hands shakes, sends one record and gets its
    acknowledgement (federation.md §4, §7). Returns the record's id."""
    rec = envelope("temps", name, {"n": 1} if payload is None else payload)
    rid = str(json.loads(rec)["id"])
    with RawPeer(port, pki[name], pki.ca, timeout=timeout) as raw:
        assert raw.handshake(name, ephemeral=ephemeral) == HUB_HANDSHAKE
        (send or RawPeer.send_binary)(raw, batch(rec))
        ack = raw.recv_text(timeout=timeout)
    assert ack == json.dumps({"last_id": rid}, separators=(",", ":")), ack
    return rid
