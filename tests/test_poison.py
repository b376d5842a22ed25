"""Records already on disk that cannot be read never wedge a reader.

A record nested 100,000 deep, a line that is not JSON, a wrong envelope, and
a torn fragment glued to a valid record are written straight into a segment
file (the disk format is plain JSONL). Every reader (``read_channel``, a
subscriber, a dead-letter subscriber, the CLI's ``tail`` and ``dead-letters``)
goes on past them; each is quarantined once; a subscriber dead-letters each
with its reason, and never a valid neighbour.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import make_config
from keyop_messenger import Message, Messenger, read_channel
from keyop_messenger.config import Config

CH = "orders"
DL = "orders.dead-letter"
TS = "2026-03-31T14:22:01Z"
DEPTH = 100_000
WAIT_S = 15.0


def envelope(id_: str, payload: str, *, channel: str = CH, v: int = 1) -> str:
    return (
        f'{{"v":{v},"id":"{id_}","ts":"{TS}","channel":"{channel}","origin":"peer",'
        f'"payload_type":"t","payload":{payload}}}'
    )


DEEP = envelope("deep", "[" * DEPTH + "]" * DEPTH)
GARBAGE = "this is not json {"
WRONG = envelope("wrong-version", '{"n":0}', v=2)
TORN = '{"v":1,"id":"torn","ts":"2026-03'  # a fragment, glued to the next record
GLUED = envelope("glued", '{"n":3}')


def active_segment(data_dir: Path, channel: str) -> Path:
    return sorted((data_dir / "channels" / channel).glob("*.jsonl"))[-1]


def append_raw(data_dir: Path, channel: str, lines: list[str]) -> None:
    with active_segment(data_dir, channel).open("ab") as f:
        for line in lines:
            f.write(line.encode() + b"\n")


def set_offset(data_dir: Path, channel: str, subscriber_id: str, offset: int) -> None:
    d = data_dir / "subscribers" / channel
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{subscriber_id}.offset").write_text(f"{offset}\n")


def wait_until(what: str, cond: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def poisoned(tmp_path: Path) -> Config:
    """``orders`` holds n=1, the four bad records, n=3 (glued to the torn
    fragment), then n=4 published after reopening; subscribers ``s`` and
    ``dl`` are registered at offset 0 of ``orders`` and ``orders.dead-letter``."""
    config = make_config(tmp_path)
    data_dir = Path(config.storage.data_dir)
    with Messenger(config) as m:
        m.publish(CH, "t", {"n": 1})
    append_raw(data_dir, CH, [DEEP, GARBAGE, WRONG, TORN + GLUED])
    with Messenger(config) as m:
        m.publish(CH, "t", {"n": 4})
    set_offset(data_dir, CH, "s", 0)
    return config


def payloads(entries: Any) -> list[Any]:
    return [e.message.payload for e in entries]


def test_read_channel_returns_the_neighbours_of_unreadable_records(poisoned: Config) -> None:
    data_dir = Path(poisoned.storage.data_dir)
    assert payloads(read_channel(data_dir, CH)) == [{"n": 1}, {"n": 3}, {"n": 4}]
    quarantined = sorted(p.name for p in (data_dir / "quarantine" / CH).iterdir())
    assert len(quarantined) == 4, quarantined
    copies = [(data_dir / "quarantine" / CH / q).read_bytes() for q in quarantined]
    assert copies == [x.encode() + b"\n" for x in (DEEP, GARBAGE, WRONG, TORN)]
    with Messenger(poisoned) as m:
        assert payloads(m.read_channel(CH)) == [{"n": 1}, {"n": 3}, {"n": 4}]


def test_each_unreadable_record_is_counted_and_logged_once(
    poisoned: Config, caplog: pytest.LogCaptureFixture
) -> None:
    data_dir = Path(poisoned.storage.data_dir)
    with Messenger(poisoned) as m:
        before = m.stats().data_loss.quarantined
        for _ in range(3):
            assert len(list(read_channel(data_dir, CH))) == 3
        assert m.stats().data_loss.quarantined == before + 4
    warnings = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
    assert len(warnings) == 4, warnings
    assert all(f'channel "{CH}"' in w and "offset" in w for w in warnings)


def test_subscriber_gets_neighbours_and_bad_records_are_dead_lettered(poisoned: Config) -> None:
    data_dir = Path(poisoned.storage.data_dir)
    poisoned.subscribers.max_retries = 0
    got: list[Any] = []
    letters: list[Message] = []
    with Messenger(poisoned) as m:
        set_offset(data_dir, DL, "dl", m.stream_end(DL))
        m.subscribe(CH, "s", lambda msg: got.append(msg.payload))
        m.subscribe(DL, "dl", letters.append)
        wait_until("four dead letters delivered", lambda: len(letters) >= 4)
        wait_until("three neighbours delivered", lambda: len(got) >= 3)
    assert got == [{"n": 1}, {"n": 3}, {"n": 4}]
    reasons = [msg.payload["last_error"] for msg in letters]
    assert "nested deeper than 100 levels" in reasons[0], reasons
    assert all("unreadable record" in r for r in reasons[1:]), reasons
    for msg in letters:
        assert msg.payload_type == "com.keyop.messenger.DeadLetterPayload"
        assert msg.payload["original"] is None
        assert (data_dir / msg.payload["quarantine_file"]).is_file()
    assert letters[2].payload["unreadable"] == WRONG


def test_valid_record_next_to_a_deep_one_reaches_its_handler_with_max_retries_0(
    tmp_path: Path,
) -> None:
    config = make_config(tmp_path)
    config.subscribers.max_retries = 0
    data_dir = Path(config.storage.data_dir)
    with Messenger(config) as m:
        m.publish(CH, "t", {"n": 0})
    # The valid record and the deep one arrive in one batch.
    append_raw(data_dir, CH, [envelope("ok-1", '{"n":1}'), DEEP, envelope("ok-2", '{"n":2}')])
    set_offset(data_dir, CH, "s", 0)
    got: list[Any] = []
    done = threading.Event()

    def handler(msg: Message) -> None:
        got.append(msg.payload)
        if msg.payload == {"n": 2}:
            done.set()

    with Messenger(config) as m:
        m.subscribe(CH, "s", handler)
        assert done.wait(WAIT_S)
    letters = [e.message for e in read_channel(data_dir, DL)]
    assert got == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert len(letters) == 1
    assert "nested" in letters[0].payload["last_error"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keyop_messenger.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_tail_and_dead_letters_go_past_unreadable_records(poisoned: Config) -> None:
    data_dir = Path(poisoned.storage.data_dir)
    poisoned.subscribers.max_retries = 0
    got: list[Any] = []
    with Messenger(poisoned) as m:
        m.subscribe(CH, "s", lambda msg: got.append(msg.payload))
        wait_until("three neighbours delivered", lambda: len(got) >= 3)
        wait_until("four dead letters", lambda: len(list(m.read_channel(DL))) >= 4)
    # An unreadable record in the dead-letter channel itself.
    append_raw(data_dir, DL, [envelope("deep-dl", "[" * DEPTH + "]" * DEPTH, channel=DL)])

    tail = run_cli("tail", "--data-dir", str(data_dir), "-n", "10", CH)
    assert tail.returncode == 0, tail.stderr
    docs = [json.loads(line) for line in tail.stdout.splitlines()]
    assert [d["payload"] for d in docs] == [{"n": 1}, {"n": 3}, {"n": 4}]

    listed = run_cli("dead-letters", "list", "--data-dir", str(data_dir), "--json", CH)
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert len(rows) == 4
    assert "nested" in rows[0]["last_error"]


def test_spark_partition_read_goes_past_unreadable_records(poisoned: Config) -> None:
    from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

    from keyop_messenger.spark.reader import KeyopPartition, _read_partition, stream_end

    data_dir = str(poisoned.storage.data_dir)
    text = StringType()
    columns = [
        ("id", text),
        ("ts", TimestampType()),
        ("channel", text),
        ("origin", text),
        ("payload_type", text),
        ("service_name", text),
        ("correlation_id", text),
        ("payload", text),
        ("segment", LongType()),
        ("offset", LongType()),
    ]
    schema = StructType([StructField(name, kind) for name, kind in columns])
    partition = KeyopPartition(0, 0, 0, stream_end(data_dir, CH))
    batches = list(_read_partition(data_dir, CH, partition, schema))
    payloads = [json.loads(p) for b in batches for p in b.column("payload").to_pylist()]
    assert payloads == [{"n": 1}, {"n": 3}, {"n": 4}]


def test_a_line_over_the_record_limit_is_quarantined_and_dead_lettered(tmp_path: Path) -> None:
    # 1.4 writers do not bound what they append; a line over 10 MiB is never
    # read whole: it is copied aside (streamed), readers go past it, and a
    # subscriber dead-letters it naming the copy (it was only logged).
    config = make_config(tmp_path)
    data_dir = Path(config.storage.data_dir)
    with Messenger(config) as m:
        m.publish(CH, "t", {"n": 1})
    huge = envelope("huge", json.dumps("x" * (10 * 1024 * 1024 + 100)))
    append_raw(data_dir, CH, [huge, envelope("after", '{"n":2}')])
    at = len(active_segment(data_dir, CH).read_bytes().split(b"\n")[0]) + 1
    assert payloads(read_channel(data_dir, CH)) == [{"n": 1}, {"n": 2}]
    copy = data_dir / "quarantine" / CH / f"{at:020d}.jsonl"
    assert copy.read_bytes() == huge.encode() + b"\n"
    got: list[Any] = []
    with Messenger(config) as m:
        m.subscribe(CH, "s", lambda msg: got.append(msg.payload), start="earliest")
        wait_until("the neighbours", lambda: len(got) == 2)
        wait_until("the dead letter", lambda: DL in [c.name for c in m.stats().channels])
        wait_until("the dead letter", lambda: list(m.read_channel(DL)))
        (letter,) = [e.message.payload for e in m.read_channel(DL)]
    assert got == [{"n": 1}, {"n": 2}]
    assert letter["original"] is None
    assert (letter["offset"], letter["original_bytes"]) == (at, len(huge))
    assert letter["quarantine_file"] == f"quarantine/{CH}/{at:020d}.jsonl"
    assert "over the record limit" in letter["last_error"]
