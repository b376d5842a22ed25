"""Federation with the hub in another process, possibly another build.

The hub is tests/spark_hub.py (it records every message it receives) started
with the interpreter named by ``KEYOP_HUB_PYTHON``, or this one when unset.
.ci/arm-wheels runs this file under qemu-user with an aarch64 or armv7 wheel
and points ``KEYOP_HUB_PYTHON`` at the x86_64 build of the same source: the
client publishes over loopback mutual TLS across builds and CPU types, and
reads back the hub's channel files (written natively) with its own reader.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
from fed_helpers import PKI, WAIT_S, client_config
from keyop_messenger import Messenger, read_channel

pki = fed_helpers.pki

HERE = Path(__file__).resolve().parent
#: Interpreter of the hub process: another build of keyop-messenger, or this one.
HUB_PYTHON = os.environ.get("KEYOP_HUB_PYTHON") or sys.executable


class HubProcess:
    """tests/spark_hub.py in a child process, allowing ``node1``, recording ``temps``."""

    def __init__(self, pki: PKI, work: Path) -> None:
        self.data_dir = work / "hub-data"
        self.out = work / "received.jsonl"
        self.out.touch()
        pair = pki["hub1"]
        cmd = [
            HUB_PYTHON, str(HERE / "spark_hub.py"), "--data-dir", str(self.data_dir),
            "--cert", str(pair.cert), "--key", str(pair.key), "--ca", str(pki.ca),
            "--peer", "node1", "--channel", "temps", "--out", str(self.out),
        ]  # fmt: skip
        # Another interpreter must not see this one's PYTHONHOME/PYTHONPATH
        # (under emulation they point at the ARM interpreter and wheel).
        env = None
        if os.environ.get("KEYOP_HUB_PYTHON"):
            drop = ("PYTHONHOME", "PYTHONPATH")
            env = {k: v for k, v in os.environ.items() if k not in drop}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, env=env
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("PORT "):
            self.stop()
            raise AssertionError(f"the hub ({HUB_PYTHON}) did not start (said {line!r})")
        self.port = int(line.split()[1])

    def received(self) -> list[dict[str, Any]]:
        text = self.out.read_text(encoding="utf-8")
        return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]

    def stop(self) -> int:
        """Closes the hub's stdin (its signal to close) and waits for it, killing it if late."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired as late:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("the hub did not stop within 30 s of its stdin closing") from late
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@pytest.fixture
def hub(pki: PKI, tmp_path: Path) -> Iterator[HubProcess]:
    h = HubProcess(pki, tmp_path)
    try:
        yield h
    finally:
        if h.proc.poll() is None:
            h.stop()


@pytest.mark.arm
def test_client_publishes_to_a_hub_in_another_process(
    pki: PKI, tmp_path: Path, hub: HubProcess
) -> None:
    config = client_config(pki, tmp_path / "client-data", "node1", hub.port, publish=["temps"])
    n = 300
    with Messenger(config) as client:
        ids = [client.publish("temps", "test.Reading", {"n": i, "x": i / 4}) for i in range(n)]
        deadline = time.monotonic() + 4 * WAIT_S
        while len(hub.received()) < n and time.monotonic() < deadline:
            time.sleep(0.05)
    got = hub.received()
    assert [r["id"] for r in got] == ids, f"the hub received {len(got)} of {n}"
    assert all(r["origin"] == "node1" and r["payload_type"] == "test.Reading" for r in got)
    assert [r["payload"] for r in got] == [{"n": i, "x": i / 4} for i in range(n)]
    assert hub.stop() == 0
    # The hub's channel files, written by the other build, read here.
    entries = list(read_channel(hub.data_dir, "temps"))
    assert [e.message.id for e in entries] == ids
    assert [e.message.payload for e in entries] == [{"n": i, "x": i / 4} for i in range(n)]
