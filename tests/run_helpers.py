"""Starting ``keyop-messenger run`` as a subprocess in tests: configuration
files, reading its log lines, waiting for it to be ready, stopping it.

Every process is started through :func:`running`, which kills it after the
test if it is still alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from fed_helpers import PKI, peer, tls_section

#: Upper bound of every wait, seconds.
WAIT_S = 20.0
#: How long ``run`` may take to stop after SIGTERM.
STOP_S = 10.0


def write_config(path: Path, doc: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(dict(doc)))
    return path


def hub_doc(pki: PKI, data_dir: Path, **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "hub1",
        "storage": {"data_dir": str(data_dir)},
        "hub": {
            "enabled": True,
            "listen_addr": "127.0.0.1:0",
            "allowed_peers": [peer("node1", publish=["temps"], subscribe=["commands"])],
        },
        "tls": tls_section(pki, "hub1"),
    }
    doc.update(extra)
    return doc


class RunProcess:
    """A ``python -m keyop_messenger run ...`` child; stderr lines are collected."""

    def __init__(
        self, args: list[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "keyop_messenger", "run", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            cwd=cwd,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_line(self, pattern: str, timeout: float = WAIT_S) -> re.Match[str]:
        """The first (new or already seen) stderr line matching ``pattern``."""
        regex = re.compile(pattern)
        for line in self.lines:
            found = regex.search(line)
            if found:
                return found
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line matching {pattern!r}; stderr: {self.lines}")
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(
                    f"run exited ({self.proc.wait()}) before {pattern!r}; stderr: {self.lines}"
                )
            self.lines.append(line)
            found = regex.search(line)
            if found:
                return found

    def wait_ready(self) -> None:
        self.wait_line(r"ready \(data_dir ")

    def hub_port(self) -> int:
        return int(self.wait_line(r"listening on 127\.0\.0\.1:(\d+)").group(1))

    def metrics_port(self) -> int:
        return int(self.wait_line(r"on http://127\.0\.0\.1:(\d+)/").group(1))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Sends ``sig``; returns the exit status (fails after :data:`STOP_S`)."""
        self.proc.send_signal(sig)
        status = self.proc.wait(timeout=STOP_S)
        self._reader.join(timeout=5)
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.lines.append(line)
        return status

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_S)


@contextlib.contextmanager
def running(
    args: list[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> Iterator[RunProcess]:
    proc = RunProcess(args, env, cwd)
    try:
        yield proc
    finally:
        proc.kill()
        for stream in (proc.proc.stdout, proc.proc.stderr):
            if stream is not None:
                stream.close()


def run_once(
    args: list[str], env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``keyop-messenger run ARGS`` to completion (it must not start serving)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "keyop_messenger", "run", *args],
        capture_output=True,
        text=True,
        timeout=WAIT_S * 3,
        env=full_env,
    )


def http_get(url: str) -> tuple[int, str, str]:
    """``(status, content type, body)`` of a GET, errors included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def http_json(url: str) -> dict[str, Any]:
    status, ctype, body = http_get(url)
    assert status == 200 and ctype == "application/json", (status, body)
    doc = json.loads(body)
    assert isinstance(doc, dict)
    return doc


def poll(predicate: Any, what: str, timeout: float = WAIT_S) -> None:
    """Polls ``predicate()`` every 50 ms until true (bounded)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


__all__ = [
    "STOP_S",
    "WAIT_S",
    "RunProcess",
    "http_get",
    "http_json",
    "hub_doc",
    "poll",
    "run_once",
    "running",
    "write_config",
]
