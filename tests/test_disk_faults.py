"""Disk faults (issue 7, part 3): ENOSPC and EIO on write and on fsync, a
failing segment roll, a failing dead-letter write and failing offset writes.

Faults on a channel's writer come from the engine's test hook
``Messenger._engine._inject_fault(channel, "write"|"sync"|"roll", count,
partial)``: a failing write really writes ``partial`` bytes and then returns
ENOSPC; a failing fdatasync returns EIO; a failing roll cannot create the next
segment (ENOSPC). The hook refuses ``.dead-letter`` channels (it goes through
the publish-side name check), so the dead-letter write fault is a real one
instead: a child process lowers its own RLIMIT_FSIZE so that the dead letter
(but nothing else) is too large to be written (EFBIG), then raises it again.
Offset writes are made to fail honestly even for root: a directory is put
where the offset file's temporary replacement ``<id>.offset.tmp`` must be
created (EISDIR).

Pass criteria, durable mode (``sync_interval_ms: 0``):

* a publish hit by a fault raises ``StorageError`` (also an ``OSError``);
* nothing acknowledged is lost: every id a publish returned is on disk;
* nothing unacknowledged or partial remains: the ids on disk are exactly the
  acknowledged ones, each line is whole JSON, each segment ends with a line
  feed, and the channel's length is the sum of the acknowledged lines;
* the writer recovers: once the fault is used up, publishes succeed;
* a subscriber's offset does not pass a message until its dead letter is
  written, and does once it is; a failed offset write loses nothing (the
  message is delivered again), and the offset catches up once writes work.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import make_config
from keyop_messenger import KeyopError, Message, Messenger, StorageError

WAIT_S = 20.0
MIB = 1024 * 1024


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def wait_until(pred: Any, what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


def channel_dir(m: Messenger, channel: str) -> Path:
    return Path(m.config.storage.data_dir) / "channels" / channel


def disk_lines(m: Messenger, channel: str) -> list[bytes]:
    """Every line of every segment of ``channel``, checked to be whole: each
    segment ends with a line feed and each line is one JSON object."""
    lines: list[bytes] = []
    for seg in sorted(channel_dir(m, channel).glob("*.jsonl")):
        content = seg.read_bytes()
        assert content == b"" or content.endswith(b"\n"), f"{seg.name}: partial record at the end"
        for line in content.split(b"\n")[:-1]:
            doc = json.loads(line)  # raises on a torn or garbled line
            assert isinstance(doc, dict) and doc.get("channel") == channel, line[:80]
        lines += content.split(b"\n")[:-1]
    return lines


def check_exactly_acknowledged(m: Messenger, channel: str, acked: list[str]) -> None:
    """The channel holds exactly the acknowledged records, whole, in order of
    their offsets, and its length is the sum of their lines."""
    lines = disk_lines(m, channel)
    ids = [json.loads(line)["id"] for line in lines]
    lost = set(acked) - set(ids)
    extra = set(ids) - set(acked)
    assert not lost, f"{len(lost)} acknowledged records lost"
    assert not extra, f"{len(extra)} records on disk were never acknowledged"
    assert len(ids) == len(set(ids)) == len(acked), "duplicates on disk"
    total = sum(len(line) + 1 for line in lines)
    segs = sorted(channel_dir(m, channel).glob("*.jsonl"))
    assert m.stream_end(channel) == int(segs[-1].stem) + segs[-1].stat().st_size
    assert sum(s.stat().st_size for s in segs) == total
    # The reader API agrees with the files.
    assert [e.message.id for e in m.read_channel(channel)] == ids


def publish_fails(m: Messenger, channel: str, *, batch: int = 0) -> None:
    with pytest.raises(StorageError) as info:
        if batch:
            m.publish_batch(channel, [("t", {"i": i, "pad": "b" * 64}) for i in range(batch)])
        else:
            m.publish(channel, "t", {"doomed": True, "pad": "d" * 300})
    assert isinstance(info.value, OSError) and isinstance(info.value, KeyopError)
    assert "not committed" in str(info.value), str(info.value)


@pytest.fixture
def m(tmp_path: Path) -> Iterator[Messenger]:
    with Messenger(make_config(tmp_path)) as messenger:
        yield messenger


# ---------------------------------------------------------------------------
# Write and fsync faults on a channel
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("partial", [0, 1, 57, 299, 100_000])
def test_enospc_on_write_commits_nothing_and_recovers(m: Messenger, partial: int) -> None:
    acked = [m.publish("ch", "t", {"i": i}) for i in range(3)]
    before = m.stream_end("ch")
    m._engine._inject_fault("ch", "write", 1, partial)
    publish_fails(m, "ch")
    assert m.stream_end("ch") == before
    check_exactly_acknowledged(m, "ch", acked)
    # Recovery: the next publishes (single and batch) are committed.
    acked.append(m.publish("ch", "t", {"after": 1}))
    acked += m.publish_batch("ch", [("t", {"after": 2}), ("t", {"after": 3})])
    check_exactly_acknowledged(m, "ch", acked)


@pytest.mark.parametrize("kind", ["write", "sync"])
def test_repeated_faults_then_recovery(m: Messenger, kind: str) -> None:
    acked = [m.publish("ch", "t", {"i": 0})]
    m._engine._inject_fault("ch", kind, 4, 40)
    publish_fails(m, "ch")
    publish_fails(m, "ch", batch=10)
    publish_fails(m, "ch")
    publish_fails(m, "ch", batch=3)
    check_exactly_acknowledged(m, "ch", acked)
    acked += m.publish_batch("ch", [("t", {"i": i}) for i in range(1, 6)])
    acked.append(m.publish("ch", "t", {"i": 6}))
    check_exactly_acknowledged(m, "ch", acked)
    counters = m._engine._counters("ch")
    assert counters["failures"] == 4 and counters["records"] == len(acked)


def test_eio_on_fsync_removes_the_written_bytes(m: Messenger) -> None:
    acked = [m.publish("ch", "t", {"i": 0})]
    m._engine._inject_fault("ch", "sync", 1)
    publish_fails(m, "ch")
    content = b"".join(p.read_bytes() for p in channel_dir(m, "ch").glob("*.jsonl"))
    assert b"doomed" not in content, "an unsynced record stayed in the file"
    check_exactly_acknowledged(m, "ch", acked)
    acked.append(m.publish("ch", "t", {"i": 1}))
    check_exactly_acknowledged(m, "ch", acked)


def test_faults_under_concurrent_publishers(tmp_path: Path) -> None:
    """Eight threads publish (single and batch, group commit, segment rolls)
    while write, fsync and roll faults keep being injected: every publish
    either returns (acknowledged) or raises StorageError; afterwards, and
    after a reopen, the channel holds exactly the acknowledged records, whole
    and in each thread's order."""
    cfg = make_config(tmp_path, segment_size_mb=1)
    threads_n, rounds = 8, 40
    acked: list[list[str]] = [[] for _ in range(threads_n)]
    failed = [0] * threads_n
    unexpected: list[BaseException] = []
    stop = threading.Event()

    with Messenger(cfg) as m:
        extra = [m.publish("ch", "t", {"warm": True})]

        def worker(k: int) -> None:
            try:
                for r in range(rounds):
                    pad = "p" * (4000 + 97 * k)
                    try:
                        if r % 3 == 0:
                            acked[k] += m.publish_batch(
                                "ch",
                                [("t", {"k": k, "r": r, "j": j, "pad": pad}) for j in range(4)],
                            )
                        else:
                            acked[k].append(m.publish("ch", "t", {"k": k, "r": r, "pad": pad}))
                    except StorageError:
                        failed[k] += 1
            except BaseException as exc:  # reported below
                unexpected.append(exc)

        def injector() -> None:
            # One fault per three commits (so faults never pile up), cycling
            # through the kinds; one roll fault, used at the next roll.
            kinds = [("write", 0), ("sync", 0), ("write", 777), ("write", 5000)]
            m._engine._inject_fault("ch", "roll", 1, 0)
            last, i = -3, 0
            while not stop.is_set():
                batches = m._engine._counters("ch")["batches"]
                if batches >= last + 3:
                    kind, partial = kinds[i % len(kinds)]
                    m._engine._inject_fault("ch", kind, 1, partial)
                    last, i = batches, i + 1
                stop.wait(0.005)

        workers = [threading.Thread(target=worker, args=(k,)) for k in range(threads_n)]
        inj = threading.Thread(target=injector)
        inj.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join(timeout=120)
        stop.set()
        inj.join(timeout=10)
        assert not any(t.is_alive() for t in workers)
        assert unexpected == [], unexpected
        assert sum(failed) > 0, "no fault hit a publish; the test proved nothing"
        assert sum(len(a) for a in acked) > 0
        # At most a write/sync fault (and the roll fault) may still be queued.
        for _ in range(3):
            try:
                extra.append(m.publish("ch", "t", {"drain": True}))
            except StorageError:
                continue
        m._engine._inject_fault("ch", "write", 1, 10)  # one more, known
        publish_fails(m, "ch")
        extra.append(m.publish("ch", "t", {"final": True}))

        every = [*extra, *(i for a in acked for i in a)]
        check_exactly_acknowledged(m, "ch", every)
        ids_on_disk = [e.message.id for e in m.read_channel("ch")]
        for k in range(threads_n):
            mine = set(acked[k])
            assert [i for i in ids_on_disk if i in mine] == acked[k], f"thread {k}: order"
        assert m._engine._counters("ch")["rolls"] >= 1, "no segment rolled under faults"

    with Messenger(cfg) as again:  # reopening finds nothing torn to cut
        assert [e.message.id for e in again.read_channel("ch")] == ids_on_disk
        check_exactly_acknowledged(again, "ch", every)


def test_relaxed_mode_write_fault_and_failing_timer_fsync(tmp_path: Path) -> None:
    """sync_interval_ms > 0: a failing write still raises and leaves nothing;
    a failing periodic fdatasync loses nothing written and is retried."""
    cfg = make_config(tmp_path, sync_interval_ms=20)
    with Messenger(cfg) as m:
        acked = [m.publish("ch", "t", {"i": i}) for i in range(5)]
        m._engine._inject_fault("ch", "write", 1, 33)
        publish_fails(m, "ch")
        check_exactly_acknowledged(m, "ch", acked)
        fsyncs = m._engine._counters("ch")["fsyncs"]
        m._engine._inject_fault("ch", "sync", 3)
        acked += [m.publish("ch", "t", {"i": i}) for i in range(5, 10)]  # not affected
        # The timer's three failing fsyncs, then a good one (it keeps retrying).
        wait_until(lambda: m._engine._counters("ch")["fsyncs"] >= fsyncs + 4, "fsync retries")
        check_exactly_acknowledged(m, "ch", acked)
    with Messenger(cfg) as m:
        check_exactly_acknowledged(m, "ch", acked)


# ---------------------------------------------------------------------------
# Dead-letter write failure (child process with a file-size limit)
# ---------------------------------------------------------------------------

DEAD_LETTER_CHILD = r"""
import json, resource, signal, sys, time
from keyop_messenger import Config, Messenger

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-limit writes fail with EFBIG instead
data_dir, limit, window = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
cfg = Config.from_dict({"name": "dl-child", "storage": {"data_dir": data_dir},
                        "subscribers": {"max_retries": 0}})
m = Messenger(cfg)
delivered = []
def handler(msg):
    delivered.append(msg.id)
    if isinstance(msg.payload, dict) and msg.payload.get("poison"):
        raise RuntimeError("refused: " + "e" * 6000)  # makes the dead letter > limit

def wait(pred, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit("timeout: " + what)
        time.sleep(0.01)

def dl_count():
    return len(list(m.read_channel("jobs.dead-letter")))

def offset_file():
    with open(f"{data_dir}/subscribers/jobs/worker.offset") as f:
        return int(f.read())

sub = m.subscribe("jobs", "worker", handler)
ok1 = m.publish("jobs", "t", {"n": 1})
wait(lambda: ok1 in delivered, "ok1")
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
poison_at = m.stream_end("jobs")
poison = m.publish("jobs", "t", {"poison": True})
ok2 = m.publish("jobs", "t", {"n": 2})
wait(lambda: poison in delivered, "poison delivered")
samples = violations = 0
t_end = time.monotonic() + window
while time.monotonic() < t_end:
    # Read what may move first, the dead-letter state last: if the offset had
    # moved (or ok2 been delivered) the dead letter was written before it.
    pos, got_ok2, stored_off = sub.position, ok2 in delivered, offset_file()
    written = dl_count()
    if not written:
        samples += 1
        if pos > poison_at or got_ok2 or stored_off > poison_at:
            violations += 1
    time.sleep(0.01)
dl_while_failing = dl_count()
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # the fault clears
wait(lambda: dl_count() == 1, "the dead letter after the fault cleared")
wait(lambda: ok2 in delivered, "ok2 after the dead letter")
end = m.stream_end("jobs")
wait(lambda: offset_file() == end, "offset at the end")
(dl,) = list(m.read_channel("jobs.dead-letter"))
dl_dir = __import__("pathlib").Path(data_dir, "channels", "jobs.dead-letter")
dl_files = sorted(dl_dir.glob("*.jsonl"))
raw = b"".join(p.read_bytes() for p in dl_files)
out = {
    "samples": samples, "violations": violations, "dl_while_failing": dl_while_failing,
    "poison": poison, "poison_at": poison_at, "ok2": ok2, "position": sub.position, "end": end,
    "delivered": delivered, "ok1": ok1, "dl_original_id": dl.message.payload["original"]["id"],
    "dl_retries": dl.message.payload["retries"],
    "dl_error": dl.message.payload["last_error"][:40], "dl_raw_lines": raw.count(b"\n"),
    "dl_raw_ends_with_lf": raw.endswith(b"\n"), "dl_raw_len": len(raw),
    "dl_line_len": len(raw.split(b"\n")[0]) + 1,
}
sub.close()
m.close()
print(json.dumps(out))
"""


def test_dead_letter_write_failure_holds_the_offset(tmp_path: Path) -> None:
    limit, window = 4096, 2.0
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            DEAD_LETTER_CHILD,
            str(tmp_path / "data"),
            str(limit),
            str(window),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-1000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["samples"] > 10, f"too few observations while the dead letter failed: {out}"
    assert out["dl_while_failing"] == 0, "the dead letter was written despite the limit"
    assert out["violations"] == 0, "the offset passed a message whose dead letter was not written"
    assert out["dl_original_id"] == out["poison"] and out["dl_retries"] == 0
    assert out["dl_error"].startswith("RuntimeError: refused")
    assert out["delivered"][-1] == out["ok2"], "delivery resumed after the dead letter"
    assert out["delivered"].count(out["ok2"]) == 1
    assert out["position"] == out["end"] > out["poison_at"]
    # Nothing partial remains of the failed attempts: one whole line.
    assert out["dl_raw_lines"] == 1 and out["dl_raw_ends_with_lf"]
    assert out["dl_raw_len"] == out["dl_line_len"] > limit


# ---------------------------------------------------------------------------
# Offset write failures (a directory where the temporary file must go)
# ---------------------------------------------------------------------------


def offset_file(m: Messenger, channel: str, sub_id: str) -> Path:
    return Path(m.config.storage.data_dir) / "subscribers" / channel / f"{sub_id}.offset"


def read_offset(path: Path) -> int:
    return int(path.read_text())


def test_failed_offset_writes_lose_nothing_and_catch_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="keyop_messenger")
    cfg = make_config(tmp_path)
    got: list[str] = []
    lock = threading.Lock()

    def handler(msg: Message) -> None:
        with lock:
            got.append(msg.id)

    with Messenger(cfg) as m:
        sub = m.subscribe("jobs", "worker", handler)
        first = [m.publish("jobs", "t", {"n": i}) for i in range(3)]
        path = offset_file(m, "jobs", "worker")
        wait_until(lambda: read_offset(path) == m.stream_end("jobs"), "offset after the first 3")
        persisted = read_offset(path)

        obstacle = path.with_name(path.name + ".tmp")
        obstacle.mkdir()  # EISDIR for the temporary file, even for root
        try:
            more = [m.publish("jobs", "t", {"n": i}) for i in range(3, 8)]
            wait_until(lambda: len(got) == 8, "delivery goes on while offsets cannot be written")
            assert sub.position == m.stream_end("jobs"), "in memory the offset moved"
            time.sleep(0.5)  # several flush attempts
            assert read_offset(path) == persisted, "the offset file changed despite the fault"
            # Retried with backoff and logged once, not once per attempt.
            failures = [r for r in caplog.records if "cannot write offset" in r.getMessage()]
            assert len(failures) == 1, len(failures)
            assert failures[0].levelname == "ERROR" and "retried" in failures[0].getMessage()
            # A subscriber stopped now resumes from the persisted offset: the
            # messages after it come again (at least once), none is skipped.
            sub.close()
            assert read_offset(path) == persisted
            failures = [r for r in caplog.records if "cannot write offset" in r.getMessage()]
            assert len(failures) == 2, "the failed write at close is logged too"
        finally:
            obstacle.rmdir()
        again: list[str] = []
        sub = m.subscribe("jobs", "worker", lambda msg: again.append(msg.id))
        wait_until(lambda: len(again) >= 5, "redelivery after the failed offset writes")
        assert again == more, "exactly the messages after the persisted offset come again"
        wait_until(lambda: read_offset(path) == m.stream_end("jobs"), "offset catches up")
        assert got == [*first, *more]

        # The fault clears while the subscriber runs: the offset catches up
        # without a new message.
        obstacle.mkdir()
        try:
            last = m.publish("jobs", "t", {"n": 8})
            wait_until(lambda: again[-1:] == [last], "delivery of the last message")
            time.sleep(0.3)
            assert read_offset(path) < m.stream_end("jobs")
        finally:
            obstacle.rmdir()
        wait_until(
            lambda: read_offset(path) == m.stream_end("jobs"), "offset written once possible"
        )
        wait_until(lambda: "offset written again" in caplog.text, "the recovery logged")
        sub.close()


def test_subscribe_fails_cleanly_when_its_offset_cannot_be_written(tmp_path: Path) -> None:
    with Messenger(make_config(tmp_path)) as m:
        m.publish("jobs", "t", {})
        path = offset_file(m, "jobs", "worker")
        path.parent.mkdir(parents=True, exist_ok=True)
        obstacle = path.with_name(path.name + ".tmp")
        obstacle.mkdir()
        try:
            with pytest.raises(KeyopError):
                m.subscribe("jobs", "worker", lambda msg: None)
            assert not path.exists()
        finally:
            obstacle.rmdir()
        got: list[Message] = []
        sub = m.subscribe("jobs", "worker", got.append)  # works once the fault is gone
        nxt = m.publish("jobs", "t", {"n": 1})
        wait_until(lambda: [x.id for x in got] == [nxt], "delivery after the fault")
        sub.close()
