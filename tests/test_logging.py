"""Logging: one ``keyop_messenger.*`` hierarchy (the engine's Rust events
included), a NullHandler, no print() in the library, and ``run``'s options
``-v``/``-q``/``--log-format``; ``--version`` on the main command."""

from __future__ import annotations

import ast
import json
import logging
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import fed_helpers
import keyop_messenger
from fed_helpers import PKI, Starter, client_config, free_port
from run_helpers import WAIT_S, hub_doc, poll, run_once, running, write_config

pki = fed_helpers.pki
start = fed_helpers.start

PACKAGE = Path(keyop_messenger.__file__).parent


def test_package_logger_has_a_null_handler() -> None:
    handlers = logging.getLogger("keyop_messenger").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def test_engine_log_events_land_under_the_package_logger(
    tmp_path: Path, pki: PKI, start: Starter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="keyop_messenger")
    start(client_config(pki, tmp_path / "node1", "node1", free_port()))
    poll(
        lambda: any("cannot connect to hub" in r.getMessage() for r in caplog.records),
        "the engine's warning about the closed port",
    )
    (record,) = [r for r in caplog.records if "cannot connect to hub" in r.getMessage()][:1]
    assert record.name == "keyop_messenger.keyop_core.federation.client"
    assert record.levelno == logging.WARNING


def _prints(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
    ]


def test_no_print_in_library_code() -> None:
    # The CLI's own output is print()ed: the cli/ package, the benchmark and the
    # demo (both commands of the CLI) may print; nothing else may.
    allowed = {PACKAGE / "bench.py", PACKAGE / "demo.py"}
    offenders = {
        str(path.relative_to(PACKAGE)): lines
        for path in PACKAGE.rglob("*.py")
        if "cli" not in path.relative_to(PACKAGE).parts[:1] and path not in allowed
        for lines in [_prints(path)]
        if lines
    }
    assert offenders == {}


def test_version_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "keyop_messenger", "--version"],
        capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert result.returncode == 0
    assert result.stdout == f"keyop-messenger {keyop_messenger.__version__}\n"


def _notify(tmp_path: Path) -> tuple[socket.socket, dict[str, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "n.sock"))
    sock.settimeout(WAIT_S)
    return sock, {"NOTIFY_SOCKET": str(tmp_path / "n.sock")}


def _ready(sock: socket.socket) -> None:
    while b"READY=1" not in sock.recv(4096).split(b"\n"):
        pass


def test_run_json_logs(tmp_path: Path, pki: PKI) -> None:
    cfg = write_config(tmp_path / "hub.yaml", hub_doc(pki, tmp_path / "hub"))
    with running(["--config", str(cfg), "--log-format", "json"]) as hub:
        hub.wait_line('"message": ".*ready')
        assert hub.stop() == 0
    docs = [json.loads(line) for line in hub.lines]
    assert docs and all(set(d) == {"ts", "level", "logger", "message"} for d in docs)
    assert all(d["logger"].startswith("keyop_messenger") for d in docs)
    assert {"INFO"} <= {d["level"] for d in docs}
    assert all(d["ts"].endswith("Z") and "T" in d["ts"] for d in docs)


def test_run_json_logs_say_why_the_configuration_was_refused(
    tmp_path: Path, pki: PKI
) -> None:
    doc = hub_doc(pki, tmp_path / "hub")
    doc["subscribers"] = {"max_retries": -1}
    cfg = write_config(tmp_path / "hub.yaml", doc)
    for extra in ([], ["--check"]):
        result = run_once(["--config", str(cfg), "--log-format", "json", *extra])
        assert result.returncode == 2, result.stderr
        docs = [json.loads(line) for line in result.stderr.splitlines()]
        assert [d["level"] for d in docs] == ["ERROR"], docs
        assert docs[0]["message"] == (
            f"configuration: {cfg}: subscribers.max_retries: must be >= 0, got -1"
        )


def test_run_verbose_shows_dependency_debug_lines_only_at_vv(
    tmp_path: Path, pki: PKI, start: Starter
) -> None:
    """``-v``: DEBUG of keyop-messenger; ``-vv``: of every library (the TLS and
    WebSocket crates' lines, which a client's connection makes)."""
    port = free_port()
    doc = hub_doc(pki, tmp_path / "hub")
    doc["hub"]["listen_addr"] = f"127.0.0.1:{port}"
    cfg = write_config(tmp_path / "hub.yaml", doc)
    for flag, dependencies_shown in (("-v", False), ("-vv", True)):
        with running(["--config", str(cfg), flag]) as hub:
            hub.wait_ready()
            client = start(client_config(pki, tmp_path / f"node1{flag}", "node1", port))
            hub.wait_line('peer "node1" connected')
            client.close()
            assert hub.stop() == 0
        ours = [x for x in hub.lines if " DEBUG keyop_messenger.service" in x]
        deps = [x for x in hub.lines if " DEBUG keyop_messenger.rustls" in x]
        assert ours, flag
        assert bool(deps) == dependencies_shown, (flag, deps[:3])


def test_run_quiet_and_verbose(tmp_path: Path, pki: PKI) -> None:
    cfg = write_config(tmp_path / "hub.yaml", hub_doc(pki, tmp_path / "hub"))
    sock, env = _notify(tmp_path)
    with sock, running(["--config", str(cfg), "-q"], env=env) as quiet:
        _ready(sock)
        assert quiet.stop(signal.SIGTERM) == 0
    assert quiet.lines == []
    with running(["--config", str(cfg), "-v"]) as verbose:
        verbose.wait_ready()
        assert verbose.stop() == 0
    assert any(" DEBUG keyop_messenger.service: configuration " in x for x in verbose.lines)
    text = [x for x in verbose.lines if " INFO " in x]
    assert text and all(x.split(" ", 1)[0].endswith("Z") for x in text)
