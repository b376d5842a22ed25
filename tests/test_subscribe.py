# why this file is long: 35 tests of subscriptions (one file per public operation), sharing
# helpers.
"""Tests of Messenger subscriptions: delivered fields, start and resume positions,
offset files, crash resume, retries and backoff, dead letters, payload decoding,
independence of subscribers, closing, names, compaction and offset TTL.

Spec: shared/spec/semantics.md section 3, disk-format.md sections 6-8, with the
deliberate differences listed in messenger.py / subscription.py (offsets move
only after a dead letter is committed, stopping during backoff keeps the
failing message, undecodable payloads are dead-lettered with ``retries`` 0,
unregistered payload types arrive as plain JSON data, compaction honours offset
files of subscribers not subscribed right now, ``fed-`` ids are refused).

Waits poll with a bounded deadline; no test relies on a sleep being long
enough. "Nothing more was delivered" is checked with a barrier: a later
message is published and awaited, and delivery is in order, so anything
delivered in between would show up before it.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import NODE_NAME
from keyop_messenger import (
    ClosedError,
    Config,
    InvalidNameError,
    LogEntry,
    Message,
    Messenger,
    Subscription,
    SubscriptionError,
    read_channel,
)

UTC = datetime.timezone.utc
MIB = 1024 * 1024
UUID7_RE = r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$"
#: RFC 3339 UTC as written by keyop-messenger: up to 9 fraction digits, no trailing zeros.
TS_RE = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{0,8}[1-9])?Z$"
DEAD_LETTER_TYPE = "com.keyop.messenger.DeadLetterPayload"
#: Bound on every wait for a delivery or a state change.
WAIT_S = 10.0
HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def make_cfg(
    tmp_path: Path,
    *,
    name: str = NODE_NAME,
    subscribers: dict[str, Any] | None = None,
    **storage: Any,
) -> Config:
    """A configuration rooted at ``tmp_path/data`` with the given overrides."""
    doc: dict[str, Any] = {
        "name": name,
        "storage": {"data_dir": str(tmp_path / "data"), **storage},
    }
    if subscribers is not None:
        doc["subscribers"] = subscribers
    return Config.from_dict(doc)


@pytest.fixture
def open_messenger(tmp_path: Path) -> Iterator[Callable[..., Messenger]]:
    """Opens messengers with :func:`make_cfg` arguments; all are closed after the test."""
    opened: list[Messenger] = []

    def factory(**kwargs: Any) -> Messenger:
        m = Messenger(make_cfg(tmp_path, **kwargs))
        opened.append(m)
        return m

    yield factory
    for m in opened:
        m.close()


def wait_until(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Polls ``cond`` until it is true; fails the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class Recorder:
    """A handler recording every message it acknowledges, in order."""

    def __init__(self, on_message: Callable[[Message], None] | None = None) -> None:
        self.messages: list[Message] = []
        self._on_message = on_message

    def __call__(self, msg: Message) -> None:
        if self._on_message is not None:
            self._on_message(msg)
        self.messages.append(msg)

    @property
    def ids(self) -> list[str]:
        return [m.id for m in list(self.messages)]

    @property
    def payloads(self) -> list[Any]:
        return [m.payload for m in list(self.messages)]

    def wait_for(self, mid: str, timeout: float = WAIT_S) -> None:
        wait_until(lambda: mid in self.ids, f"delivery of {mid}", timeout)

    def wait_count(self, n: int, timeout: float = WAIT_S) -> None:
        wait_until(lambda: len(self.messages) >= n, f"{n} deliveries", timeout)


def data_dir(m: Messenger) -> Path:
    return Path(m.config.storage.data_dir)


def offset_file(m: Messenger, channel: str, sub_id: str) -> Path:
    return data_dir(m) / "subscribers" / channel / f"{sub_id}.offset"


def read_offset(path: Path) -> int:
    text = path.read_text()
    assert re.fullmatch(r"\d+\n", text), f"offset file {path} holds {text!r}"
    return int(text)


def stored(m_or_dir: Messenger | Path, channel: str) -> list[LogEntry]:
    root = data_dir(m_or_dir) if isinstance(m_or_dir, Messenger) else m_or_dir
    return list(read_channel(root, channel))


def segments(m_or_dir: Messenger | Path, channel: str) -> list[int]:
    root = data_dir(m_or_dir) if isinstance(m_or_dir, Messenger) else m_or_dir
    return sorted(
        int(p.name[: -len(".jsonl")]) for p in (root / "channels" / channel).glob("*.jsonl")
    )


def stream_end_on_disk(m_or_dir: Messenger | Path, channel: str) -> int:
    """Start of the last segment plus its size: the byte offset after the last record."""
    root = data_dir(m_or_dir) if isinstance(m_or_dir, Messenger) else m_or_dir
    last = segments(root, channel)[-1]
    return last + (root / "channels" / channel / f"{last:020d}.jsonl").stat().st_size


def raw_lines(m: Messenger, channel: str) -> list[bytes]:
    """Every line (without ``\\n``) of every segment of ``channel``, in order."""
    out: list[bytes] = []
    for start in segments(m, channel):
        path = data_dir(m) / "channels" / channel / f"{start:020d}.jsonl"
        out.extend(path.read_bytes().splitlines())
    return out


def publish_n(m: Messenger, channel: str, n: int, start: int = 0) -> list[str]:
    return [m.publish(channel, "test.N", {"n": i}) for i in range(start, start + n)]


def wait_offset(m: Messenger, channel: str, sub_id: str, value: int) -> None:
    path = offset_file(m, channel, sub_id)
    wait_until(
        lambda: path.exists() and path.read_text() == f"{value}\n",
        f"{path} to hold {value}",
    )


@dataclasses.dataclass
class Reading:
    sensor: str
    value: float


# ---------------------------------------------------------------------------
# Delivered message
# ---------------------------------------------------------------------------


@pytest.mark.arm
def test_message_fields_are_delivered(messenger: Messenger) -> None:
    messenger.register_payload_type("com.example.Reading", Reading)
    rec = Recorder()
    messenger.subscribe("sensors", "reader", rec)

    before = datetime.datetime.now(UTC) - datetime.timedelta(milliseconds=1)
    mid = messenger.publish(
        "sensors",
        "com.example.Reading",
        Reading("t1", 21.5),
        service_name="thermostat",
        correlation_id="corr-42",
    )
    after = datetime.datetime.now(UTC) + datetime.timedelta(milliseconds=1)
    plain = messenger.publish("sensors", "com.example.Other", {"k": [1, 2]})
    rec.wait_for(plain)

    first, second = rec.messages
    assert first.id == mid and re.match(UUID7_RE, mid)
    assert first.channel == "sensors"
    assert first.origin == NODE_NAME
    assert first.payload_type == "com.example.Reading"
    assert type(first.payload) is Reading
    assert first.payload == Reading("t1", 21.5)
    assert first.service_name == "thermostat"
    assert first.correlation_id == "corr-42"
    assert first.timestamp.tzinfo is not None
    assert first.timestamp.utcoffset() == datetime.timedelta(0)
    assert before <= first.timestamp <= after
    # Identical to what a reader of the log sees.
    assert [e.message for e in messenger.read_channel("sensors")] == [first, second]

    assert second.payload == {"k": [1, 2]}
    assert (second.service_name, second.correlation_id) == (None, None)


# ---------------------------------------------------------------------------
# Start position, resume, offset files
# ---------------------------------------------------------------------------


def test_new_subscriber_starts_at_current_end(messenger: Messenger) -> None:
    publish_n(messenger, "ch", 3)
    end = messenger.stream_end("ch")
    rec = Recorder()
    messenger.subscribe("ch", "late", rec)
    # The offset file is written at once with the current end.
    assert read_offset(offset_file(messenger, "ch", "late")) == end

    new = publish_n(messenger, "ch", 2, start=3)
    rec.wait_for(new[-1])
    assert rec.ids == new
    assert [p["n"] for p in rec.payloads] == [3, 4]


@pytest.mark.arm
def test_returning_subscriber_resumes_where_it_left_off(messenger: Messenger) -> None:
    first = Recorder()
    sub = messenger.subscribe("ch", "s1", first)
    a = publish_n(messenger, "ch", 3)
    first.wait_for(a[-1])
    sub.close()

    missed = publish_n(messenger, "ch", 4, start=3)
    second = Recorder()
    messenger.subscribe("ch", "s1", second)
    second.wait_for(missed[-1])
    barrier = publish_n(messenger, "ch", 1, start=7)
    second.wait_for(barrier[0])

    assert first.ids == a
    assert second.ids == missed + barrier  # no duplicates, no gaps


@pytest.mark.arm
def test_resume_after_reopening_the_messenger(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, offset_flush_interval_ms=0)
    with Messenger(cfg) as m1:
        rec1 = Recorder()
        sub = m1.subscribe("ch", "durable", rec1)
        a = publish_n(m1, "ch", 5)
        rec1.wait_for(a[-1])
        sub.close()
        missed = publish_n(m1, "ch", 3, start=5)

    with Messenger(cfg) as m2:
        rec2 = Recorder()
        m2.subscribe("ch", "durable", rec2)
        rec2.wait_for(missed[-1])
        later = publish_n(m2, "ch", 2, start=8)
        rec2.wait_for(later[-1])

    assert rec1.ids == a
    assert rec2.ids == missed + later
    assert [p["n"] for p in rec1.payloads + rec2.payloads] == list(range(10))


@pytest.mark.arm
def test_offset_file_holds_offset_after_last_acknowledged_record(messenger: Messenger) -> None:
    rec = Recorder()
    messenger.subscribe("ch", "off", rec)
    path = offset_file(messenger, "ch", "off")
    assert path.read_text() == "0\n"

    ids = publish_n(messenger, "ch", 3)
    rec.wait_for(ids[-1])
    seg = data_dir(messenger) / "channels" / "ch" / f"{0:020d}.jsonl"
    size = seg.stat().st_size
    assert size == messenger.stream_end("ch")
    wait_offset(messenger, "ch", "off", size)
    assert path.read_text() == f"{size}\n"
    assert read_offset(path) == sum(len(line) + 1 for line in raw_lines(messenger, "ch"))
    assert [p.name for p in path.parent.iterdir()] == ["off.offset"]  # no .tmp left


# ---------------------------------------------------------------------------
# Crash (SIGKILL) resume
# ---------------------------------------------------------------------------


def _child(tmp_path: Path, out: Path, mode: str, count: int = 0) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            str(HERE / "subscribe_child.py"),
            str(tmp_path / "data"),
            str(out),
            mode,
            str(count),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _delivered(path: Path) -> list[str]:
    """Complete lines written by the child (a torn last line is ignored)."""
    if not path.exists():
        return []
    text = path.read_text(encoding="ascii")
    lines = text.split("\n")
    return [line for line in lines[:-1] if line]


def _end_child(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=WAIT_S)


def test_sigkill_mid_delivery_resumes_from_persisted_offset(tmp_path: Path) -> None:
    count = 400
    root = tmp_path / "data"
    out1, out2 = tmp_path / "run1.txt", tmp_path / "run2.txt"
    offsets = root / "subscribers" / "killed" / "victim.offset"

    proc = _child(tmp_path, out1, "run", count)
    try:
        # Kill once some messages were delivered and some progress was persisted.
        wait_until(
            lambda: (
                len(_delivered(out1)) >= 50
                and offsets.exists()
                and offsets.read_text().strip() not in ("", "0")
            ),
            "the child to deliver messages and persist an offset",
            timeout=30,
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=WAIT_S)
    finally:
        _end_child(proc)
    assert proc.returncode == -signal.SIGKILL

    run1 = _delivered(out1)
    persisted = read_offset(offsets)
    entries = stored(root, "killed")
    published = [e.message.id for e in entries]
    assert len(run1) < len(published), "everything was delivered before the kill"
    assert len(set(published)) == len(published)
    # In order, no gaps, no duplicates within one run.
    assert run1 == published[: len(run1)]
    # The persisted offset is a record boundary the handler had already passed.
    boundaries = [e.offset for e in entries]
    assert persisted in boundaries
    k = boundaries.index(persisted)
    assert 0 < k <= len(run1)

    proc = _child(tmp_path, out2, "resume")
    try:
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        _end_child(proc)
    assert proc.returncode == 0, stderr.decode(errors="replace")
    assert stdout.decode().strip() == "done"

    run2 = _delivered(out2)
    final = [e.message.id for e in stored(root, "killed")]
    assert final[: len(published)] == published and len(final) == len(published) + 1
    # The restart begins exactly at the persisted offset and continues without gaps
    # up to the sentinel the second child published.
    assert run2 == final[k:]
    assert set(run1) | set(run2) == set(final)
    # Only messages delivered after the last persisted offset were delivered twice.
    again = set(run2)
    assert [mid for mid in run1 if mid in again] == published[k : len(run1)]
    assert read_offset(offsets) == stream_end_on_disk(root, "killed")
    assert not list(offsets.parent.glob("*.tmp"))


# ---------------------------------------------------------------------------
# Retries, backoff, dead letters
# ---------------------------------------------------------------------------


def test_handler_failing_twice_then_succeeding(messenger: Messenger) -> None:
    calls: list[str] = []

    def flaky(msg: Message) -> None:
        calls.append(msg.id)
        if calls.count(msg.id) <= 2:
            raise RuntimeError("not yet")

    rec = Recorder(flaky)
    messenger.subscribe("ch", "flaky", rec)
    first = messenger.publish("ch", "t", 1)
    second = messenger.publish("ch", "t", 2)
    rec.wait_for(second)

    assert calls.count(first) == 3
    assert rec.ids == [first, second]
    assert stored(messenger, "ch.dead-letter") == []


def test_backoff_delays_double(open_messenger: Callable[..., Messenger]) -> None:
    m = open_messenger(subscribers={"max_retries": 3})
    times: list[float] = []

    def always_fails(msg: Message) -> None:
        times.append(time.monotonic())
        raise RuntimeError("nope")

    m.subscribe("ch", "backoff", always_fails)
    m.publish("ch", "t", 0)
    wait_until(lambda: len(stored(m, "ch.dead-letter")) == 1, "the dead letter")

    assert len(times) == 4  # the first call and max_retries retries
    gaps = [b - a for a, b in itertools.pairwise(times)]
    for gap, minimum in zip(gaps, (0.09, 0.18, 0.36), strict=True):
        assert gap >= minimum, gaps
    assert gaps[0] < gaps[1] < gaps[2], gaps


def test_dead_letter_record_format(tmp_path: Path) -> None:
    # The original is published by another instance, so the dead letter's origin
    # shows it is copied from the original, not the local name.
    with Messenger(make_cfg(tmp_path, name="origin-host")) as m0:
        m0.subscribe("orders", "billing", lambda msg: None).close()
        poison = m0.publish(
            "orders", "com.example.Order", {"order": 42}, service_name="shop", correlation_id="c-1"
        )
        good = m0.publish("orders", "com.example.Order", {"order": 43})

    with Messenger(make_cfg(tmp_path, subscribers={"max_retries": 1})) as m:
        dl_rec = Recorder()
        m.subscribe("orders.dead-letter", "dl-watch", dl_rec)
        calls: list[str] = []

        def handler(msg: Message) -> None:
            calls.append(msg.id)
            if msg.id == poison:
                raise ValueError(f"bad order, attempt {calls.count(poison)}")

        rec = Recorder(handler)
        m.subscribe("orders", "billing", rec)
        rec.wait_for(good)
        dl_rec.wait_count(1)

        assert calls == [poison, poison, good]
        assert rec.ids == [good]
        [original_line] = [line for line in raw_lines(m, "orders") if poison.encode() in line]
        [dl_line] = raw_lines(m, "orders.dead-letter")

        dl = json.loads(dl_line)
        assert list(dl) == ["v", "id", "ts", "channel", "origin", "payload_type", "payload"]
        assert dl["v"] == 1
        assert re.match(UUID7_RE, dl["id"]) and dl["id"] != poison
        assert re.match(TS_RE, dl["ts"])
        assert dl["channel"] == "orders.dead-letter"
        assert dl["origin"] == "origin-host"
        assert dl["payload_type"] == DEAD_LETTER_TYPE
        payload = dl["payload"]
        # The 1.4 fields first, in order; then reason, attempts, channel, offset.
        assert list(payload) == [
            "original", "retries", "last_error", "failed_at",
            "reason", "attempts", "channel", "offset",
        ]  # fmt: skip
        assert payload["original"] == json.loads(original_line)
        assert payload["original"]["service_name"] == "shop"
        assert payload["original"]["correlation_id"] == "c-1"
        assert b'"original":' + original_line + b',"retries":' in dl_line  # verbatim copy
        assert payload["retries"] == 1
        assert isinstance(payload["last_error"], str)
        assert "bad order, attempt 2" in payload["last_error"]
        assert re.match(TS_RE, payload["failed_at"])
        assert payload["failed_at"] == dl["ts"]

        # The offset moved past the poison message (and the good one).
        wait_offset(m, "orders", "billing", m.stream_end("orders"))

        # A subscriber of the dead-letter channel receives it as plain data.
        [dmsg] = dl_rec.messages
        assert dmsg.id == dl["id"]
        assert dmsg.channel == "orders.dead-letter"
        assert dmsg.origin == "origin-host"
        assert dmsg.payload_type == DEAD_LETTER_TYPE
        assert dmsg.payload == payload
        assert (dmsg.service_name, dmsg.correlation_id) == (None, None)


def test_failing_dead_letter_subscriber_skips_without_dead_lettering_again(
    open_messenger: Callable[..., Messenger],
) -> None:
    m = open_messenger(subscribers={"max_retries": 0})
    dl_calls: list[str] = []

    def dl_fails(msg: Message) -> None:
        dl_calls.append(msg.id)
        raise RuntimeError("cannot handle dead letters either")

    m.subscribe("ch.dead-letter", "dl", dl_fails)

    def fails(msg: Message) -> None:
        raise RuntimeError("nope")

    m.subscribe("ch", "main", fails)
    m.publish("ch", "t", 1)
    wait_until(lambda: m.stream_end("ch.dead-letter") > 0, "the dead letter to be committed")
    dl_end = m.stream_end("ch.dead-letter")
    wait_offset(m, "ch.dead-letter", "dl", dl_end)
    assert len(dl_calls) == 1
    assert not (data_dir(m) / "channels" / "ch.dead-letter.dead-letter").exists()
    assert len(stored(m, "ch.dead-letter")) == 1


def test_undecodable_payload_is_dead_lettered_at_once(tmp_path: Path) -> None:
    # Records written before the types were registered (wrong shapes for them).
    with Messenger(make_cfg(tmp_path)) as m0:
        m0.subscribe("ch", "typed", lambda msg: None).close()
        bad_shape = m0.publish("ch", "com.example.Reading", {"sensor": "t1"})
        bad_kind = m0.publish("ch", "com.example.Map", [1, 2, 3])
        good = m0.publish("ch", "com.example.Reading", {"sensor": "t2", "value": 1.5})

    with Messenger(make_cfg(tmp_path, subscribers={"max_retries": 5})) as m:
        m.register_payload_type("com.example.Reading", Reading)
        m.register_payload_type("com.example.Map", dict)
        calls: list[Message] = []
        rec = Recorder(calls.append)
        m.subscribe("ch", "typed", rec)
        rec.wait_for(good)
        wait_until(lambda: len(stored(m, "ch.dead-letter")) == 2, "two dead letters")

        assert [c.id for c in calls] == [good]  # the handler never saw the bad ones
        assert rec.messages[0].payload == Reading("t2", 1.5)
        letters = [json.loads(line)["payload"] for line in raw_lines(m, "ch.dead-letter")]
        assert [dl["original"]["id"] for dl in letters] == [bad_shape, bad_kind]
        assert [dl["retries"] for dl in letters] == [0, 0]
        assert all(dl["last_error"] for dl in letters)
        wait_offset(m, "ch", "typed", m.stream_end("ch"))


@pytest.mark.parametrize(
    "payload",
    [
        [1, "two", None],
        "just a string",
        42,
        -3.25,
        True,
        None,
        {"nested": {"list": [{"a": 1}, [2, 3]], "none": None}},
        {},
    ],
    ids=["list", "str", "int", "float", "bool", "none", "nested", "empty"],
)
def test_unregistered_payload_types_arrive_as_plain_data(
    messenger: Messenger, payload: Any
) -> None:
    rec = Recorder()
    messenger.subscribe("ch", "plain", rec)
    mid = messenger.publish("ch", "com.example.Unregistered", payload)
    rec.wait_for(mid)
    [msg] = rec.messages
    assert msg.payload == payload
    assert type(msg.payload) is type(payload)
    assert stored(messenger, "ch.dead-letter") == []


# ---------------------------------------------------------------------------
# Independence and publish not blocked
# ---------------------------------------------------------------------------


def test_failing_subscriber_does_not_hold_back_another(
    open_messenger: Callable[..., Messenger],
) -> None:
    m = open_messenger(subscribers={"max_retries": 50})
    bad_calls: list[str] = []

    def bad(msg: Message) -> None:
        bad_calls.append(msg.id)
        raise RuntimeError("always")

    good = Recorder()
    m.subscribe("ch", "bad", bad)
    m.subscribe("ch", "good", good)
    ids = publish_n(m, "ch", 20)
    good.wait_for(ids[-1])

    assert good.ids == ids
    # The bad one is still retrying its first message.
    assert bad_calls and set(bad_calls) == {ids[0]}
    assert len(bad_calls) < 10
    assert read_offset(offset_file(m, "ch", "bad")) == 0
    assert stored(m, "ch.dead-letter") == []


def test_slow_subscriber_does_not_block_publish(messenger: Messenger) -> None:
    hurry = threading.Event()

    def slow(msg: Message) -> None:
        if not hurry.is_set():
            time.sleep(0.2)

    rec = Recorder(slow)
    messenger.subscribe("ch", "slow", rec)
    try:
        ids = publish_n(messenger, "ch", 50)
        handled = len(rec.messages)
        assert handled < 50
        assert len(stored(messenger, "ch")) == 50
    finally:
        hurry.set()
    rec.wait_for(ids[-1])
    assert rec.ids == ids


# ---------------------------------------------------------------------------
# Closing
# ---------------------------------------------------------------------------


def test_close_during_backoff_keeps_the_failing_message(
    open_messenger: Callable[..., Messenger],
) -> None:
    m = open_messenger(subscribers={"max_retries": 10})
    calls: list[str] = []
    first_failure = threading.Event()

    def fails(msg: Message) -> None:
        calls.append(msg.id)
        first_failure.set()
        raise RuntimeError("down")

    sub = m.subscribe("ch", "retry", fails)
    failing = m.publish("ch", "t", 1)
    after = m.publish("ch", "t", 2)
    assert first_failure.wait(WAIT_S)
    sub.close()
    calls_at_close = len(calls)

    assert read_offset(offset_file(m, "ch", "retry")) == 0
    rec = Recorder()
    m.subscribe("ch", "retry", rec)
    rec.wait_for(after)
    assert rec.ids == [failing, after]
    assert len(calls) == calls_at_close  # the old handler was not called again
    assert stored(m, "ch.dead-letter") == []


def test_messenger_close_waits_for_running_handler(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    m = Messenger(cfg)
    entered, release = threading.Event(), threading.Event()
    finished: list[str] = []

    def blocking(msg: Message) -> None:
        entered.set()
        release.wait(5)
        finished.append(msg.id)

    try:
        m.subscribe("ch", "blocked", blocking)
        mid = m.publish("ch", "t", 1)
        assert entered.wait(WAIT_S)
        closer = threading.Thread(target=m.close, daemon=True)
        closer.start()
        closer.join(0.2)
        assert closer.is_alive(), "close() returned while a handler was still running"
        release.set()
        closer.join(WAIT_S)
        assert not closer.is_alive(), "close() did not return"
        assert finished == [mid]
        assert m.closed
    finally:
        release.set()
        m.close()

    # The message whose handler completed during close was acknowledged.
    with Messenger(cfg) as m2:
        rec = Recorder()
        m2.subscribe("ch", "blocked", rec)
        barrier = m2.publish("ch", "t", 2)
        rec.wait_for(barrier)
        assert rec.ids == [barrier]


def test_subscription_close_from_inside_handler(messenger: Messenger) -> None:
    holder: dict[str, Subscription] = {}
    closed = threading.Event()
    seen: list[str] = []

    def closes_itself(msg: Message) -> None:
        seen.append(msg.id)
        holder["sub"].close()
        closed.set()

    holder["sub"] = messenger.subscribe("ch", "selfclose", closes_itself)
    first = messenger.publish("ch", "t", 1)
    assert closed.wait(WAIT_S), "close() from the handler did not return"
    assert seen == [first]

    # The subscription is gone (the id can subscribe again) and the message that
    # closed it was acknowledged.
    wait_offset(messenger, "ch", "selfclose", messenger.stream_end("ch"))
    rec = Recorder()
    messenger.subscribe("ch", "selfclose", rec)
    second = messenger.publish("ch", "t", 2)
    rec.wait_for(second)
    assert rec.ids == [second]
    assert seen == [first]


def test_messenger_close_from_inside_handler(tmp_path: Path) -> None:
    m = Messenger(make_cfg(tmp_path))
    returned = threading.Event()

    def closes_messenger(msg: Message) -> None:
        m.close()
        returned.set()

    try:
        m.subscribe("ch", "closer", closes_messenger)
        m.publish("ch", "t", 1)
        assert returned.wait(WAIT_S), "Messenger.close() from the handler did not return"
        assert m.closed
        with pytest.raises(ClosedError):
            m.publish("ch", "t", 2)
    finally:
        m.close()
    # The data directory is released.
    with Messenger(make_cfg(tmp_path)) as m2:
        assert m2.stream_end("ch") > 0


def test_close_is_idempotent_and_subscribe_after_close_fails(tmp_path: Path) -> None:
    m = Messenger(make_cfg(tmp_path))
    sub = m.subscribe("ch", "s", lambda msg: None)
    m.close()
    m.close()
    sub.close()
    sub.close()
    assert m.closed
    with pytest.raises(ClosedError):
        m.subscribe("ch", "s", lambda msg: None)
    with pytest.raises(ClosedError):
        m.subscribe("ch", "other", lambda msg: None)


def test_close_from_handler_stops_the_rest_of_the_batch(messenger: Messenger) -> None:
    holder: dict[str, Subscription] = {}
    seen: list[int] = []

    def closes_on_first(msg: Message) -> None:
        seen.append(msg.payload)
        if msg.payload == 0:
            holder["sub"].close()

    holder["sub"] = messenger.subscribe("ch", "batch", closes_on_first)
    # One append: the subscriber reads all five records as one batch.
    messenger.publish_batch("ch", [("t", i) for i in range(5)])
    wait_until(lambda: bool(seen), "the first delivery")
    rec = Recorder()
    wait_until(lambda: _try_subscribe(messenger, "ch", "batch", rec), "the old subscription to end")
    barrier = messenger.publish("ch", "t", 5)
    rec.wait_for(barrier)
    assert seen == [0]
    assert rec.payloads == [1, 2, 3, 4, 5]


def test_close_waits_only_for_the_handler_call_in_progress(messenger: Messenger) -> None:
    def slow(msg: Message) -> None:
        time.sleep(0.1)

    rec = Recorder(slow)
    sub = messenger.subscribe("ch", "slowclose", rec)
    messenger.publish_batch("ch", [("t", i) for i in range(30)])
    rec.wait_count(1)
    started = time.monotonic()
    sub.close()
    took = time.monotonic() - started
    assert len(rec.messages) <= 3
    assert took < 1.5
    # The rest is delivered on resubscribe, nothing lost or repeated.
    rec2 = Recorder()
    messenger.subscribe("ch", "slowclose", rec2)
    wait_until(lambda: len(rec.messages) + len(rec2.messages) >= 30, "the rest")
    assert rec.payloads + rec2.payloads == list(range(30))


def test_close_of_idle_subscription_is_prompt(messenger: Messenger) -> None:
    rec = Recorder()
    sub = messenger.subscribe("ch", "idle", rec)
    mid = messenger.publish("ch", "t", 1)
    rec.wait_for(mid)
    wait_offset(messenger, "ch", "idle", messenger.stream_end("ch"))
    # Give the worker time to finish the offset write (directory fsync) and start
    # waiting for more: this only makes the bug show; a correct close is fast anyway.
    time.sleep(0.1)
    started = time.monotonic()
    sub.close()
    assert time.monotonic() - started < 0.25


def _try_subscribe(m: Messenger, channel: str, sub_id: str, handler: Recorder) -> bool:
    try:
        m.subscribe(channel, sub_id, handler)
    except SubscriptionError:
        return False
    return True


def test_closing_a_stale_subscription_does_not_stop_its_successor(messenger: Messenger) -> None:
    old = messenger.subscribe("ch", "dup", lambda msg: None)
    old.close()
    rec = Recorder()
    messenger.subscribe("ch", "dup", rec)
    old.close()  # idempotent: must not affect the new subscription
    with pytest.raises(SubscriptionError):
        messenger.subscribe("ch", "dup", lambda msg: None)
    mid = messenger.publish("ch", "t", 1)
    rec.wait_for(mid, timeout=3)


# ---------------------------------------------------------------------------
# Names, duplicates, unsubscribe
# ---------------------------------------------------------------------------


def test_same_id_twice_on_a_channel_is_refused(messenger: Messenger) -> None:
    rec = Recorder()
    messenger.subscribe("ch", "dup", rec)
    with pytest.raises(SubscriptionError):
        messenger.subscribe("ch", "dup", lambda msg: None)
    other = Recorder()
    messenger.subscribe("other", "dup", other)  # same id, other channel: fine
    a = messenger.publish("ch", "t", 1)
    b = messenger.publish("other", "t", 2)
    rec.wait_for(a)
    other.wait_for(b)
    assert rec.ids == [a] and other.ids == [b]


@pytest.mark.parametrize(
    "sub_id",
    ["", ".", "..", "a/b", "../x", "a b", "fed-x", "hub-x", "x" * 245, "x" * 256, "caf\u00e9"],
)
def test_invalid_subscriber_ids_are_refused(messenger: Messenger, sub_id: str) -> None:
    with pytest.raises(InvalidNameError):
        messenger.subscribe("ch", sub_id, lambda msg: None)
    with pytest.raises(InvalidNameError):
        messenger.unsubscribe("ch", sub_id)
    assert not (data_dir(messenger) / "subscribers" / "ch").exists() or not any(
        (data_dir(messenger) / "subscribers" / "ch").iterdir()
    )


@pytest.mark.parametrize("channel", ["", "..", "a/b", "x" * 256])
def test_invalid_channel_names_are_refused(messenger: Messenger, channel: str) -> None:
    with pytest.raises(InvalidNameError):
        messenger.subscribe(channel, "s", lambda msg: None)


@pytest.mark.parametrize("length", [1, 200, 244])
def test_subscriber_ids_up_to_244_bytes_work(messenger: Messenger, length: int) -> None:
    # 244 bytes: the longest id whose '<id>.offset.tmp' still fits a 255-byte file name.
    sub_id = "x" * length
    rec = Recorder()
    messenger.subscribe("ch", sub_id, rec)
    assert offset_file(messenger, "ch", sub_id).exists()
    mid = messenger.publish("ch", "t", 1)
    rec.wait_for(mid)
    wait_offset(messenger, "ch", sub_id, messenger.stream_end("ch"))
    messenger.unsubscribe("ch", sub_id)
    assert not offset_file(messenger, "ch", sub_id).exists()


def assert_restarts_at_end(messenger: Messenger, channel: str, sub_id: str) -> None:
    """An unsubscribed id has no offset file and, subscribed again, gets only
    what is published after (not the history published meanwhile)."""
    assert not offset_file(messenger, channel, sub_id).exists()
    publish_n(messenger, channel, 3)  # history the returning id must not see
    rec = Recorder()
    messenger.subscribe(channel, sub_id, rec)
    new = messenger.publish(channel, "t", 9)
    rec.wait_for(new)
    assert rec.ids == [new]


def test_unsubscribe_deletes_offset_and_restarts_at_end(messenger: Messenger) -> None:
    rec = Recorder()
    messenger.subscribe("ch", "u", rec)
    a = messenger.publish("ch", "t", 1)
    rec.wait_for(a)
    messenger.unsubscribe("ch", "u")
    assert_restarts_at_end(messenger, "ch", "u")
    assert rec.ids == [a]


def test_unsubscribe_from_its_own_handler_leaves_no_offset(messenger: Messenger) -> None:
    """The handler's thread writes no offset after the unsubscribe (the
    file would come back, and a new subscription would resume from it instead
    of the end), and hands no further message of its batch to the handler."""
    seen: list[Any] = []
    done = threading.Event()

    def leave(msg: Message) -> None:
        seen.append(msg.payload)
        messenger.unsubscribe("ch", "self")
        done.set()

    messenger.subscribe("ch", "self", leave)
    publish_n(messenger, "ch", 3)
    assert done.wait(10)
    time.sleep(0.3)  # the thread has ended and written what it would write
    assert seen == [{"n": 0}]
    assert_restarts_at_end(messenger, "ch", "self")


def test_unsubscribe_of_closed_subscription_deletes_its_offset(messenger: Messenger) -> None:
    messenger.subscribe("ch", "gone", lambda msg: None).close()
    path = offset_file(messenger, "ch", "gone")
    assert path.exists()
    messenger.unsubscribe("ch", "gone")
    assert not path.exists()
    with pytest.raises(SubscriptionError):
        messenger.unsubscribe("ch", "gone")


def test_unsubscribe_unknown_id_fails(messenger: Messenger) -> None:
    with pytest.raises(SubscriptionError):
        messenger.unsubscribe("ch", "nobody")
    messenger.subscribe("ch", "somebody", lambda msg: None)
    with pytest.raises(SubscriptionError):
        messenger.unsubscribe("ch", "nobody")
    with pytest.raises(SubscriptionError):
        messenger.unsubscribe("other", "somebody")


# ---------------------------------------------------------------------------
# Compaction and offset TTL
# ---------------------------------------------------------------------------

BLOB = "b" * 4000  # ~4.2 KB records: 1 MiB segments hold ~250


def _publish_bytes(m: Messenger, channel: str, nbytes: int, start: int) -> list[str]:
    """Publishes batches of 25 records until ``nbytes`` more bytes are stored."""
    ids: list[str] = []
    target = m.stream_end(channel) + nbytes
    n = start
    while m.stream_end(channel) < target:
        ids += m.publish_batch(channel, [("test.Blob", {"n": n + i, "b": BLOB}) for i in range(25)])
        n += 25
    return ids


def test_compaction_respects_offsets_of_unsubscribed_ids(
    open_messenger: Callable[..., Messenger],
) -> None:
    m = open_messenger(segment_size_mb=1)
    ch = "bulk"
    fast = Recorder()
    fast_sub = m.subscribe(ch, "fast", fast)
    ids = _publish_bytes(m, ch, 3 * MIB // 2, 0)
    m.subscribe(ch, "slow", lambda msg: None).close()  # offset stays on disk
    slow_at = read_offset(offset_file(m, ch, "slow"))
    assert slow_at == m.stream_end(ch)
    ids += _publish_bytes(m, ch, 3 * MIB // 2, len(ids))
    fast.wait_for(ids[-1], timeout=30)
    wait_offset(m, ch, "fast", m.stream_end(ch))

    before = segments(m, ch)
    assert len(before) >= 4
    holding = max(s for s in before if s <= slow_at)  # the segment slow reads next
    assert holding > 0

    report = m.compact()
    after = segments(m, ch)
    assert after == [s for s in before if s >= holding]
    assert report[ch][0] == len(before) - len(after)
    assert report[ch][1] > 0
    # The slow subscriber still finds everything it has not read.
    assert [e.message.id for e in read_channel(data_dir(m), ch, start_offset=slow_at)] == [
        e.message.id for e in stored(m, ch) if e.offset >= slow_at
    ]

    m.unsubscribe(ch, "slow")
    m.compact()
    remaining = segments(m, ch)
    assert remaining == [before[-1]]  # every sealed segment gone, the active one kept
    tail = [e.message.id for e in read_channel(data_dir(m), ch, start_offset=remaining[0])]
    assert tail and tail == ids[-len(tail) :]
    assert [e.message.id for e in read_channel(data_dir(m), ch)] == tail  # gap skipped
    m.compact()
    assert segments(m, ch) == remaining

    # A subscriber whose offset points into the deleted region resumes at the
    # first remaining segment.
    fast_sub.close()
    offset_file(m, ch, "fast").write_text("100\n")
    again = Recorder()
    m.subscribe(ch, "fast", again)
    new = publish_n(m, ch, 3, start=10_000)
    again.wait_for(new[-1])
    assert again.ids == tail + new
    wait_offset(m, ch, "fast", m.stream_end(ch))


def test_compaction_with_no_offsets_keeps_every_segment(
    open_messenger: Callable[..., Messenger],
) -> None:
    # keyop-messenger 1.4 deleted every sealed segment of a channel nobody
    # subscribed to; here unread data goes only by a retention limit.
    m = open_messenger(segment_size_mb=1)
    ids = _publish_bytes(m, "ch", 2 * MIB + MIB // 2, 0)
    before = segments(m, "ch")
    assert len(before) >= 3
    m.compact()
    assert segments(m, "ch") == before
    assert [e.message.id for e in stored(m, "ch")] == ids


def test_compaction_covers_channels_not_touched_since_open(
    open_messenger: Callable[..., Messenger],
) -> None:
    first = open_messenger(segment_size_mb=1)
    ids = _publish_bytes(first, "old", 2 * MIB + MIB // 2, 0)
    before = segments(first, "old")
    assert len(before) >= 3
    # A subscriber of an earlier run has read everything.
    cursors = Path(first.config.storage.data_dir) / "subscribers" / "old"
    cursors.mkdir(parents=True)
    (cursors / "done.offset").write_text(f"{first.stream_end('old')}\n")
    first.close()

    m = open_messenger(segment_size_mb=1)  # nothing publishes to or reads "old"
    report = m.compact()
    assert segments(m, "old") == [before[-1]], (
        "a channel on disk is compacted even if this process never touched it"
    )
    assert report["old"][0] == len(before) - 1
    tail = [e.message.id for e in stored(m, "old")]
    assert tail and tail == ids[-len(tail) :]


def test_offset_ttl_removes_stale_offsets_of_unsubscribed_ids(
    open_messenger: Callable[..., Messenger],
) -> None:
    m = open_messenger(subscribers={"offset_ttl": "1h"})
    m.subscribe("ch", "old", lambda msg: None).close()
    m.subscribe("ch", "recent", lambda msg: None).close()
    live = Recorder()
    m.subscribe("ch", "live", live)
    two_hours_ago = time.time() - 2 * 3600
    for sub_id in ("old", "live"):
        os.utime(offset_file(m, "ch", sub_id), (two_hours_ago, two_hours_ago))

    report = m.compact()
    assert report["ch"][2] == ["old"]
    assert not offset_file(m, "ch", "old").exists()
    assert offset_file(m, "ch", "recent").exists()
    assert offset_file(m, "ch", "live").exists()
    mid = m.publish("ch", "t", 1)
    live.wait_for(mid)
    # "old" is now unknown: subscribing again starts at the end.
    with pytest.raises(SubscriptionError):
        m.unsubscribe("ch", "old")


def test_offset_ttl_zero_keeps_offsets(open_messenger: Callable[..., Messenger]) -> None:
    m = open_messenger()
    m.subscribe("ch", "old", lambda msg: None).close()
    long_ago = time.time() - 365 * 24 * 3600
    os.utime(offset_file(m, "ch", "old"), (long_ago, long_ago))
    report = m.compact()
    assert "ch" not in report or report["ch"][2] == []
    assert offset_file(m, "ch", "old").exists()


@pytest.mark.parametrize("legacy", ["with space", "a:b", "zähler"])
def test_a_1_4_subscriber_id_this_version_refuses_can_be_unsubscribed(
    messenger: Messenger, legacy: str
) -> None:
    # 1.4 took any string as a subscriber id; such an offset file holds back
    # retention, and it could not be removed: unsubscribe removes it now. It
    # still cannot be subscribed, and an id with no offset file stays refused.
    messenger.publish("ch", "t", 1)
    offsets = Path(messenger.config.storage.data_dir) / "subscribers" / "ch"
    offsets.mkdir(parents=True, exist_ok=True)
    (offsets / f"{legacy}.offset").write_text("0\n")
    with pytest.raises(InvalidNameError):
        messenger.subscribe("ch", legacy, Recorder())
    messenger.unsubscribe("ch", legacy)
    assert not (offsets / f"{legacy}.offset").exists()
    with pytest.raises(InvalidNameError):
        messenger.unsubscribe("ch", legacy)
    (offsets / "fed-x y.offset").write_text("0\n")
    with pytest.raises(InvalidNameError):
        messenger.unsubscribe("ch", "fed-x y")  # a federation cursor's name
    assert (offsets / "fed-x y.offset").exists()
