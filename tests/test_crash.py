"""Crash tests: a child publishes in a loop and is killed with SIGKILL; recovery
must keep every acknowledged message exactly once and leave only whole,
newline-terminated records on disk.

Four kinds of kill point (crash_child.py):

* ``single``, ``batch``: mid publish burst or mid ``publish_batch``, across
  segment rolls, after a random number of acknowledgements;
* ``compaction``, ``offset``: the child also runs two subscribers (offsets
  written after every batch) and retention passes (deleting the segments both
  have passed), and the engine's stop-point hook (``KEYOP_TEST_STOP_AT``) stops
  the child with SIGSTOP at the n-th segment deletion of a retention pass or
  the n-th offset write between its temporary file and the rename; the parent
  SIGKILLs it there. After recovery the offset files parse and point at
  record boundaries, a leftover ``.offset.tmp`` is not taken for an offset,
  compaction deleted only what every subscriber had been given, and each
  subscriber resumed gets every message it had not been given, without gaps,
  with duplicates only from its persisted offset on.
"""

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
import threading
import time
from pathlib import Path

import pytest

from conftest import make_config
from keyop_messenger import LogEntry, Message, Messenger

CHILD = Path(__file__).with_name("crash_child.py")
CHANNEL = "crash"  # as in crash_child.py
BATCH_SIZE = 50  # as in crash_child.py
SUBSCRIBERS = ("fast", "slow")  # as in crash_child.py
MIB = 1024 * 1024
ACK_WAIT_SECONDS = 60.0
UUID_RE = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
OFFSET_RE = re.compile(r"(0|[1-9][0-9]*)\n")
#: Kill points after a random number of acknowledgements (child mode = kind).
MODES = ["single", "batch"]
#: Kill points where the engine stopped itself: kind -> (stop point, range of n).
#: Offset writes 1 and 2 are the initial ones at subscribe (no offset file yet).
STOP_POINTS = {"compaction": ("compaction", (1, 6)), "offset": ("offset-tmp", (3, 80))}
KINDS = MODES + list(STOP_POINTS)
STOP_ENV = "KEYOP_TEST_STOP_AT"
#: Bound on the resumed subscribers' catching up.
RESUME_WAIT_SECONDS = 30.0


def child_stopped(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the child stopped itself (SIGSTOP); records its exit status if
    it ended instead (it is reaped here, so Popen must not wait for it)."""
    pid, status = os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)
    if pid == 0:
        return False
    if os.WIFSTOPPED(status):
        return True
    proc.returncode = os.waitstatus_to_exitcode(status)
    return False


def read_until(proc: subprocess.Popen[bytes], wanted: int, stop: bool) -> tuple[bytes, bool]:
    """Reads the child's stdout until it holds ``wanted`` lines (or, with
    ``stop``, until the child stopped itself), the child exits, or
    ACK_WAIT_SECONDS pass. Returns the output and whether the child stopped."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    output = bytearray()
    deadline = time.monotonic() + ACK_WAIT_SECONDS
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while stop or output.count(b"\n") < wanted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if stop and child_stopped(proc):
                return bytes(output), True
            if proc.returncode is not None:
                break
            if not selector.select(min(remaining, 0.01) if stop else remaining):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            output += chunk
    return bytes(output), False


def publish_and_kill(
    tmp_path: Path, data_dir: Path, mode: str, wanted: int, stop_at: str | None = None
) -> list[str]:
    """Runs the child until it acknowledged at least ``wanted`` messages, or
    with ``stop_at`` (``<point>:<n>``) until the engine stopped it there, kills
    it with SIGKILL and returns every id it acknowledged before dying."""
    stderr_path = tmp_path / "child.stderr"
    env = dict(os.environ)
    env.pop(STOP_ENV, None)
    if stop_at is not None:
        env[STOP_ENV] = stop_at
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(data_dir), mode, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
        )
    try:
        output, stopped = read_until(proc, wanted, stop_at is not None)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.stdout is not None
    output += proc.stdout.read()
    proc.stdout.close()

    complete = output.split(b"\n")[:-1]  # a final fragment without "\n" was not printed
    errors = stderr_path.read_text(errors="replace")
    assert proc.returncode == -signal.SIGKILL, f"child died on its own:\n{errors}"
    if stop_at is not None:
        assert stopped, f"the child reached stop point {stop_at} within the time limit:\n{errors}"
    assert len(complete) >= wanted, f"only {len(complete)} acks within the time limit:\n{errors}"
    assert all(UUID_RE.fullmatch(line) for line in complete)
    return [line.decode() for line in complete]


def check_segment_files(channel_dir: Path, ids_on_disk: set[str], first: int = 0) -> None:
    """Every segment starts at ``first`` or where the previous one ends, is at
    most 1 MiB, and holds only whole, valid, newline-terminated records."""
    start = first
    for path in sorted(channel_dir.glob("*.jsonl")):
        assert path.name == f"{start:020d}.jsonl", "segments are contiguous"
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
    config = make_config(tmp_path, segment_size_mb=1)
    data_dir = Path(config.storage.data_dir)
    acked = publish_and_kill(tmp_path, data_dir, mode, wanted)

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


def read_offset_file(path: Path) -> int:
    text = path.read_text()
    assert OFFSET_RE.fullmatch(text), f"{path.name} holds a whole decimal offset: {text!r}"
    return int(text)


def delivered_before(tmp_path: Path, sub: str) -> list[str]:
    """Ids the child's subscriber ``sub`` was given, in order (whole lines)."""
    data = (tmp_path / f"{sub}.delivered").read_bytes()
    return [line.decode() for line in data.split(b"\n")[:-1]]


class Resumed:
    """Handler of a resumed subscriber: records ids until it saw ``last``."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.last: str | None = None
        self.done = threading.Event()

    def __call__(self, msg: Message) -> None:
        self.ids.append(msg.id)
        if msg.id == self.last:
            self.done.set()


def crash_subscribed_and_recover(tmp_path: Path, kind: str, seed: str) -> None:
    point, (low, high) = STOP_POINTS[kind]
    stop_at = f"{point}:{random.Random(seed).randint(low, high)}"
    config = make_config(tmp_path, segment_size_mb=1, offset_flush_interval_ms=0)
    data_dir = Path(config.storage.data_dir)
    channel_dir = data_dir / "channels" / CHANNEL
    sub_dir = data_dir / "subscribers" / CHANNEL
    acked = publish_and_kill(tmp_path, data_dir, "subscribed", 0, stop_at)

    # The state the kill left, before anything reopens the directory.
    persisted = {s: read_offset_file(sub_dir / f"{s}.offset") for s in SUBSCRIBERS}
    temps = {p.name.removesuffix(".offset.tmp"): p for p in sub_dir.glob("*.offset.tmp")}
    assert set(temps) <= set(SUBSCRIBERS)
    first = min(int(p.name.removesuffix(".jsonl")) for p in channel_dir.glob("*.jsonl"))
    if kind == "offset":
        assert temps, f"killed between an offset's temporary file and its rename ({stop_at})"
        for sub, tmp in temps.items():
            assert read_offset_file(tmp) > persisted[sub], "the temporary file holds a newer offset"
    else:
        assert first > 0, f"killed after compaction deleted a segment ({stop_at})"
    given = {s: delivered_before(tmp_path, s) for s in SUBSCRIBERS}

    resumed = {s: Resumed() for s in SUBSCRIBERS}
    with Messenger(config) as m:
        entries = list(m.read_channel(CHANNEL))
        on_disk = [e.message.id for e in entries]
        assert max(collections.Counter(on_disk).values()) == 1, "a message is stored twice"
        check_segment_files(channel_dir, set(on_disk), first)

        # Compaction deletes whole leading segments only: the acknowledged ids
        # still on disk are the tail of the acknowledgements, at its front.
        kept = len(set(acked) & set(on_disk))
        gone = acked[: len(acked) - kept]
        assert on_disk[:kept] == acked[len(gone) :], "an acknowledged message is missing"
        assert len(on_disk) - kept <= BATCH_SIZE, "more unacknowledged records than in flight"
        for sub in SUBSCRIBERS:
            assert set(gone) <= set(given[sub]), (
                f"compaction deleted only messages every subscriber had been given ({sub})"
            )
        full = gone + on_disk  # every record ever written, in order
        end = m.stream_end(CHANNEL)
        boundaries = [e.offset for e in entries] + [end]
        start_index = {}
        for sub in SUBSCRIBERS:
            assert persisted[sub] in boundaries, (
                f"{sub}.offset {persisted[sub]} is a record boundary on disk"
            )
            k = len(gone) + boundaries.index(persisted[sub])
            start_index[sub] = k
            assert given[sub] == full[: len(given[sub])], f"{sub} was given the stream in order"
            assert len(given[sub]) >= k, f"{sub} was given everything below its offset"

        # Offset files only: the temporary files are not subscribers.
        listed = {s.id for c in m.stats().channels if c.name == CHANNEL for s in c.subscribers}
        assert listed == set(SUBSCRIBERS), f"only offset files count as subscribers: {listed}"

        sentinel = m.publish(CHANNEL, "crash.Test", {"after": "recovery"})
        for sub in SUBSCRIBERS:
            resumed[sub].last = sentinel
            m.subscribe(CHANNEL, sub, resumed[sub])
        for sub in SUBSCRIBERS:
            assert resumed[sub].done.wait(RESUME_WAIT_SECONDS), f"{sub} resumed and caught up"
        final_end = m.stream_end(CHANNEL)
    for sub in SUBSCRIBERS:
        again = resumed[sub].ids
        expected = [*full[start_index[sub] :], sentinel]
        assert again == expected, (
            f"{sub} resumed exactly at its persisted offset: no gap, "
            f"duplicates only from it on (got {len(again)}, expected {len(expected)})"
        )
        assert read_offset_file(sub_dir / f"{sub}.offset") == final_end, (
            f"{sub}.offset is the stream end after a clean close"
        )
    assert not list(sub_dir.glob("*.tmp")), "no temporary offset file is left after a clean close"


def kill_point(tmp_path: Path, kind: str, seed: str) -> None:
    """One kill point of ``kind``: a publishing child, or one with subscribers."""
    if kind in MODES:
        crash_and_recover(tmp_path, kind, seed=seed)
    else:
        crash_subscribed_and_recover(tmp_path, kind, seed=seed)


@pytest.mark.parametrize("round_", range(5))
@pytest.mark.parametrize("kind", KINDS)
def test_kill_loses_no_acknowledged_message(tmp_path: Path, kind: str, round_: int) -> None:
    kill_point(tmp_path, kind, seed=f"{kind}-{round_}")


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(50))
@pytest.mark.parametrize("kind", KINDS)
def test_kill_many_rounds(tmp_path: Path, kind: str, round_: int) -> None:
    kill_point(tmp_path, kind, seed=f"slow-{kind}-{round_}")
