"""Delivered messages: built by the engine, the payload decoded only when a
handler first reads it, with the at-least-once rules unchanged.

A payload that cannot become a Python value (an integer of more digits than
Python's int parsing allows) is written straight into a segment file: a handler
that never reads it acknowledges it; one that reads it (and so raises) sends it
to the dead letters as raw text, and delivery goes on with the next record.
"""

from __future__ import annotations

import copy
import datetime
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import make_config
from keyop_messenger import Message, Messenger

CH = "orders"
DL = "orders.dead-letter"
WAIT_S = 15.0
HUGE = "9" * 5000  # over Python's 4,300-digit limit for int("...")
UNREADABLE = (
    '{"v":1,"id":"huge","ts":"2026-03-31T14:22:01Z","channel":"orders","origin":"peer",'
    f'"payload_type":"t","payload":{{"n":{HUGE}}}}}'
)


def wait_until(what: str, cond: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_delivered_message_has_every_field(tmp_path: Path) -> None:
    got: list[Message] = []
    with Messenger(make_config(tmp_path)) as m:
        m.subscribe(CH, "s", got.append, start="earliest")
        sent = m.publish(CH, "t", {"n": [1, 2.5, "x", None, True]}, correlation_id="c-1")
        wait_until("delivery", lambda: len(got) == 1)
    msg = got[0]
    assert (msg.id, msg.channel, msg.payload_type, msg.correlation_id) == (sent, CH, "t", "c-1")
    assert msg.payload == {"n": [1, 2.5, "x", None, True]}
    assert msg.payload is msg.payload  # decoded once, then kept
    assert msg.timestamp.tzinfo == datetime.timezone.utc
    assert abs(datetime.datetime.now(datetime.timezone.utc) - msg.timestamp).total_seconds() < 60
    same = Message(msg.id, CH, msg.origin, "t", msg.payload, msg.timestamp, None, "c-1")
    assert msg == same and not (msg != same)
    assert repr(msg).startswith(f"Message(id={sent!r}, channel='orders'")
    with pytest.raises(TypeError):
        hash(msg)
    with pytest.raises(AttributeError):
        msg.payload = 1  # type: ignore[misc]
    for clone in (pickle.loads(pickle.dumps(msg)), copy.copy(msg), copy.deepcopy(msg)):
        assert type(clone) is Message and clone == msg


def test_message_built_by_hand_takes_nanoseconds_or_a_datetime() -> None:
    ts = datetime.datetime(2026, 3, 31, 14, 22, 1, 123456, tzinfo=datetime.timezone.utc)
    nanos = int(ts.timestamp()) * 10**9 + 123456 * 1000 + 789
    assert Message("i", "c", "o", "t", 1, nanos).timestamp == ts
    assert Message("i", "c", "o", "t", 1, ts).timestamp is ts
    before_epoch = Message("i", "c", "o", "t", 1, -1).timestamp
    assert before_epoch == datetime.datetime(1969, 12, 31, 23, 59, 59, 999999,
                                             tzinfo=datetime.timezone.utc)


def poisoned(tmp_path: Path) -> Messenger:
    """``orders`` holds n=1, the unreadable record, n=3; subscriber ``s`` at 0."""
    config = make_config(tmp_path)
    config.subscribers.max_retries = 0
    data_dir = Path(config.storage.data_dir)
    with Messenger(config) as m:
        m.publish(CH, "t", {"n": 1})
    segment = sorted((data_dir / "channels" / CH).glob("*.jsonl"))[-1]
    with segment.open("ab") as f:
        f.write(UNREADABLE.encode() + b"\n")
    m = Messenger(config)
    m.publish(CH, "t", {"n": 3})
    return m


def test_unread_payload_is_never_decoded(tmp_path: Path) -> None:
    ids: list[str] = []
    done = threading.Event()

    def handler(msg: Message) -> None:
        ids.append(msg.id)
        if len(ids) == 3:
            done.set()

    with poisoned(tmp_path) as m:
        sub = m.subscribe(CH, "s", handler, start="earliest")
        assert done.wait(WAIT_S)
        wait_until("offset at the end", lambda: sub.position == m.stream_end(CH))
        assert m.stream_end(DL) == 0
    assert ids[1] == "huge"


def test_payload_that_cannot_be_read_is_dead_lettered_raw(tmp_path: Path) -> None:
    got: list[Any] = []
    letters: list[Message] = []
    with poisoned(tmp_path) as m:
        m.subscribe(DL, "dl", letters.append, start="earliest")
        m.subscribe(CH, "s", lambda msg: got.append(msg.payload), start="earliest")
        wait_until("the neighbours", lambda: len(got) >= 2)
        wait_until("one dead letter", lambda: len(letters) >= 1)
    assert got == [{"n": 1}, {"n": 3}]
    assert len(letters) == 1
    letter = letters[0].payload
    assert "payload cannot be read" in letter["last_error"], letter
    assert letter["unreadable"] == UNREADABLE
