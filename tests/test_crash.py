"""Crash tests: a child publishes in a loop and is killed with SIGKILL at a
random point; recovery must keep every acknowledged message exactly once and
leave only whole, newline-terminated records on disk."""

from __future__ import annotations

import collections
import json
import os
import random
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import make_config
from keyop_messenger import LogEntry, Messenger

CHILD = Path(__file__).with_name("crash_child.py")
CHANNEL = "crash"  # as in crash_child.py
BATCH_SIZE = 50  # as in crash_child.py
MIB = 1024 * 1024
ACK_WAIT_SECONDS = 60.0
UUID_RE = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
MODES = ["single", "batch"]


def read_until_acks(proc: subprocess.Popen[bytes], wanted: int) -> bytes:
    """Reads the child's stdout until it holds ``wanted`` lines, the child
    exits, or ACK_WAIT_SECONDS pass."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    output = bytearray()
    deadline = time.monotonic() + ACK_WAIT_SECONDS
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while output.count(b"\n") < wanted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if not selector.select(remaining):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            output += chunk
    return bytes(output)


def publish_and_kill(data_dir: Path, mode: str, wanted: int, stderr_path: Path) -> list[str]:
    """Runs the child until it acknowledged at least ``wanted`` messages, kills
    it with SIGKILL and returns every id it acknowledged before dying."""
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(data_dir), mode],
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    try:
        output = read_until_acks(proc, wanted)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.stdout is not None
    output += proc.stdout.read()
    proc.stdout.close()

    complete = output.split(b"\n")[:-1]  # a final fragment without "\n" was not printed
    errors = stderr_path.read_text(errors="replace")
    assert proc.returncode == -signal.SIGKILL, f"child died on its own:\n{errors}"
    assert len(complete) >= wanted, f"only {len(complete)} acks within the time limit:\n{errors}"
    assert all(UUID_RE.fullmatch(line) for line in complete)
    return [line.decode() for line in complete]


def check_segment_files(channel_dir: Path, ids_on_disk: set[str]) -> None:
    """Every segment is contiguous with the previous one, at most 1 MiB, and
    holds only whole, valid, newline-terminated records."""
    start = 0
    for path in sorted(channel_dir.glob("*.jsonl")):
        assert path.name == f"{start:020d}.jsonl"
        data = path.read_bytes()
        assert len(data) <= MIB
        if data:
            assert data.endswith(b"\n"), f"{path.name} ends with a partial record"
            for line in data[:-1].split(b"\n"):
                record = json.loads(line)
                assert record["v"] == 1
                assert record["id"] in ids_on_disk
        start += len(data)


def crash_and_recover(tmp_path: Path, mode: str, seed: str) -> None:
    wanted = random.Random(seed).randint(50, 400)
    config = make_config(tmp_path, compaction_threshold_mb=1)
    data_dir = Path(config.storage.data_dir)
    acked = publish_and_kill(data_dir, mode, wanted, tmp_path / "child.stderr")

    with Messenger(config) as m:
        entries: list[LogEntry] = list(m.read_channel(CHANNEL))  # opens and recovers
        on_disk = [e.message.id for e in entries]
        counts = collections.Counter(on_disk)
        assert max(counts.values()) == 1, "a message is stored twice"
        assert on_disk[: len(acked)] == acked, "an acknowledged message is missing"
        calls = 1 if mode == "single" else BATCH_SIZE
        assert len(on_disk) - len(acked) <= calls, "more unacknowledged records than in flight"
        check_segment_files(data_dir / "channels" / CHANNEL, set(on_disk))

        end = m.stream_end(CHANNEL)
        new_id = m.publish(CHANNEL, "crash.Test", {"after": "recovery"})
        last = list(m.read_channel(CHANNEL, start_offset=end))
        assert [(e.offset, e.message.id) for e in last] == [(end, new_id)]


@pytest.mark.parametrize("round_", range(10))
@pytest.mark.parametrize("mode", MODES)
def test_kill_during_publish_loses_no_acknowledged_message(
    tmp_path: Path, mode: str, round_: int
) -> None:
    crash_and_recover(tmp_path, mode, seed=f"{mode}-{round_}")


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(100))
@pytest.mark.parametrize("mode", MODES)
def test_kill_during_publish_many_rounds(tmp_path: Path, mode: str, round_: int) -> None:
    crash_and_recover(tmp_path, mode, seed=f"slow-{mode}-{round_}")
