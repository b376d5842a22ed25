"""systemd's notify protocol in ``keyop-messenger run``: READY=1 once the
listeners accept connections, WATCHDOG=1 pings, STOPPING=1 on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import fed_helpers
from fed_helpers import PKI
from keyop_messenger._sdnotify import Notifier
from run_helpers import WAIT_S, http_get, hub_doc, running, write_config

pki = fed_helpers.pki


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(WAIT_S)
    try:
        yield sock, str(path)
    finally:
        sock.close()


def recv_until(sock: socket.socket, wanted: str) -> list[str]:
    """Datagrams received up to and including the one with line ``wanted``."""
    got: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        lines = sock.recv(4096).decode().splitlines()
        got.append("\n".join(lines))
        if wanted in lines:
            return got
    raise AssertionError(f"no {wanted!r} within {WAIT_S} s; got {got}")


def test_ready_watchdog_and_stopping(
    tmp_path: Path, pki: PKI, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, path = notify_socket
    doc = hub_doc(pki, tmp_path / "hub", metrics={"listen_addr": "127.0.0.1:0"})
    cfg = write_config(tmp_path / "hub.yaml", doc)
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "300000"}
    with running(["--config", str(cfg)], env=env) as hub:
        before = recv_until(sock, "READY=1")
        assert not any("WATCHDOG=1" in d or "STOPPING=1" in d for d in before)
        # READY=1 means the hub and the metrics listener accept connections now.
        socket.create_connection(("127.0.0.1", hub.hub_port()), timeout=5).close()
        assert http_get(f"http://127.0.0.1:{hub.metrics_port()}/readyz")[0] == 200
        for _ in range(3):
            recv_until(sock, "WATCHDOG=1")
        hub.proc.send_signal(signal.SIGTERM)
        after = recv_until(sock, "STOPPING=1")
        assert "READY=1" not in after
        assert hub.proc.wait(timeout=10) == 0


def test_without_notify_socket_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled and notifier.notify("READY=1") is False


def test_abstract_socket_address() -> None:
    name = f"keyop-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(WAIT_S)
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.notify("READY=1", "STATUS=up")
        assert sock.recv(4096) == b"READY=1\nSTATUS=up"


def test_watchdog_interval_from_environment() -> None:
    assert Notifier({"WATCHDOG_USEC": "2000000"}).watchdog_s == 2.0
    assert Notifier({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}).watchdog_s is None
    pid = str(os.getpid())
    assert Notifier({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": pid}).watchdog_s == 0.5
    assert Notifier({"WATCHDOG_USEC": "x"}).watchdog_s is None
    assert Notifier({}).watchdog_s is None


def test_send_failure_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    assert notifier.notify("READY=1") is False
    assert "sd_notify READY=1" in caplog.text


def test_example_unit_file() -> None:
    unit = Path(__file__).parent.parent / "examples" / "systemd" / "keyop-messenger.service"
    settings: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    for key, value in {
        "Type": "notify",
        "User": "keyop",
        "Group": "keyop",
        "StateDirectory": "keyop",
        "ProtectSystem": "strict",
        "NoNewPrivileges": "yes",
        "Restart": "on-failure",
        "ExecReload": "/bin/kill -HUP $MAINPID",
        "RestartPreventExitStatus": "2",
    }.items():
        assert settings.get(key) == [value], key
    assert "WatchdogSec" in settings
    (exec_start,) = settings["ExecStart"]
    assert exec_start.split()[1:3] == ["run", "--config"]
