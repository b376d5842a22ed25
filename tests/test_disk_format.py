"""Tests of the on-disk format (spec disk-format.md sections 1-5 and 8): the
exact lines we write, and reading and appending to data written by the Go
keyop-messenger 1.4."""

from __future__ import annotations

import datetime
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import NODE_NAME, make_config
from keyop_messenger import InvalidNameError, LogEntry, Message, Messenger, read_channel

UTC = datetime.timezone.utc
UUID7_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
TS_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d*[1-9])?Z$")
BASE_KEYS = ["v", "id", "ts", "channel", "origin", "payload_type"]

#: The whole file runs on the ARM wheels too (.ci/arm-wheels).
pytestmark = pytest.mark.arm


def segment_name(start: int) -> str:
    return f"{start:020d}.jsonl"


def segment_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.jsonl") if p.is_file())


def raw_lines(path: Path) -> list[str]:
    """The lines of a segment file, each checked to be newline-terminated UTF-8."""
    data = path.read_bytes()
    assert data.endswith(b"\n")
    assert b"\r" not in data
    return [line.decode("utf-8") for line in data[:-1].split(b"\n")]


def parse_utc_ts(ts: str) -> datetime.datetime:
    """A ``...Z`` timestamp with 0-9 fraction digits, truncated to microseconds."""
    match = re.fullmatch(r"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?Z", ts)
    assert match, ts
    whole = datetime.datetime.strptime(match[1], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)
    micros = int((match[2] or "0").ljust(9, "0")[:6])
    return whole + datetime.timedelta(microseconds=micros)


# ---------------------------------------------------------------------------
# Lines written by this implementation
# ---------------------------------------------------------------------------


def test_written_lines_have_the_exact_envelope_format(tmp_path: Path) -> None:
    channel = "fmt"
    expected_keys: list[list[str]] = []
    with Messenger(make_config(tmp_path)) as m:
        m.publish(channel, "com.example.A", {"text": 'line\nbreak\ttab "q" é😀', "n": 1})
        expected_keys.append([*BASE_KEYS, "payload"])
        m.publish(channel, "com.example.B", [1, None], service_name="svc", correlation_id="c1")
        expected_keys.append([*BASE_KEYS, "correlation_id", "service_name", "payload"])
        m.publish(channel, "com.example.C", "s", service_name="svc")
        expected_keys.append([*BASE_KEYS, "service_name", "payload"])
        m.publish(channel, "com.example.D", None, correlation_id="c2")
        expected_keys.append([*BASE_KEYS, "correlation_id", "payload"])
        m.publish(channel, "", {}, service_name="", correlation_id="")
        expected_keys.append([*BASE_KEYS, "payload"])
        batch = [("com.example.E", {"i": i}) for i in range(100)]
        m.publish_batch(channel, batch, correlation_id="c3")
        expected_keys += [[*BASE_KEYS, "correlation_id", "payload"]] * 100
        entries = list(m.read_channel(channel))

    [segment] = segment_files(tmp_path / "data" / "channels" / channel)
    lines = raw_lines(segment)
    assert len(lines) == len(expected_keys) == len(entries)

    ids: list[str] = []
    for line, keys, entry in zip(lines, expected_keys, entries, strict=True):
        pairs = json.loads(line, object_pairs_hook=list)
        assert [k for k, _ in pairs] == keys
        record = json.loads(line)
        assert line == json.dumps(record, separators=(",", ":"), ensure_ascii=False)
        assert line.startswith('{"v":1,')
        assert type(record["v"]) is int
        assert record["v"] == 1
        assert UUID7_RE.match(record["id"])
        assert TS_RE.match(record["ts"])
        assert (record["channel"], record["origin"]) == (channel, NODE_NAME)
        assert record["id"] == entry.message.id
        assert parse_utc_ts(record["ts"]) == entry.message.timestamp
        assert record["payload"] == entry.message.payload
        ids.append(record["id"])
    assert ids == sorted(set(ids)), "ids must strictly increase"


# ---------------------------------------------------------------------------
# Data written by keyop-messenger 1.4 (hand-written from the spec)
# ---------------------------------------------------------------------------

# Segment 0 of channel "alerts".
GO_L1 = (
    '{"v":1,"id":"01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f","ts":"2026-03-31T14:22:01.1234567Z",'
    '"channel":"alerts","origin":"sensor-1","payload_type":"com.example.Alert",'
    '"correlation_id":"01970a3c-0000-7000-8000-000000000001","service_name":"thermostat",'
    '"payload":{"message":"hot \\u003cb\\u003e"}}'
)
GO_L2 = (
    '{"v":1,"id":"01970a3c-6000-7000-8000-000000000002","ts":"2026-03-31T16:22:02.9876543+02:00",'
    '"channel":"alerts","origin":"sensor-2","payload_type":"com.example.Note",'
    '"payload":"just a string"}'
)
GO_CORRUPT = '{"v":1,"id":"01970a3c-6000-7000-8000-00000000dead","ts":"2026-03-31T14:2'
GO_L3 = (
    '{"v":1,"id":"01970a3c-7000-7000-8000-000000000003","ts":"2026-03-31T14:22:03Z",'
    '"channel":"alerts","origin":"sensor-1","payload_type":"","future_field":{"added":[1]},'
    '"payload":null}'
)
GO_FLOAT_VERSION = (
    '{"v":1.0,"id":"01970a3c-7100-7000-8000-000000000000","ts":"2026-03-31T14:22:03Z",'
    '"channel":"alerts","origin":"sensor-1","payload_type":"x","payload":{}}'
)
GO_BAD_TS = (
    '{"v":1,"id":"01970a3c-7200-7000-8000-000000000000","ts":"yesterday",'
    '"channel":"alerts","origin":"sensor-1","payload_type":"x","payload":{}}'
)
# Segment 1, named after segment 0's size.
GO_V2 = (
    '{"v":2,"id":"01970a3c-8000-7000-8000-000000000000","ts":"2026-03-31T14:22:04Z",'
    '"channel":"alerts","origin":"sensor-9","payload_type":"com.example.V2","payload":{"a":1}}'
)
GO_L4 = (
    '{"payload":[1,2,3],"origin":"sensor-3","channel":"alerts",'
    '"ts":"2026-03-31T14:22:05.123456789Z","id":"01970a3c-9000-7000-8000-000000000004",'
    '"payload_type":"com.example.List","v":1}'
)
GO_L5 = (
    '{"v":1,"id":"01970a3c-a000-7000-8000-000000000005","ts":"2026-03-31T14:22:06.5Z",'
    '"channel":"alerts","origin":"sensor-1","payload_type":"com.example.Num",'
    '"service_name":"counter","payload":42}'
)
GO_TORN = '{"v":1,"id":"01970a3c-b000-7000-8000-00000000torn","ts":"2026-03-31T14:22:0'

SEGMENT_0 = "".join(
    f"{line}\n" for line in (GO_L1, GO_L2, GO_CORRUPT, GO_L3, GO_FLOAT_VERSION, GO_BAD_TS)
).encode()
SEGMENT_1_WHOLE = "".join(f"{line}\n" for line in (GO_V2, GO_L4, GO_L5)).encode()
SEGMENT_1 = SEGMENT_1_WHOLE + GO_TORN.encode()
SEGMENT_1_START = len(SEGMENT_0)


def offset_in(segment: bytes, line: str) -> int:
    return segment.index((line + "\n").encode())


def expected_go_entries() -> list[LogEntry]:
    def entry(segment: int, data: bytes, line: str, **fields: Any) -> LogEntry:
        return LogEntry(segment + offset_in(data, line), segment, Message(**fields))

    ts = datetime.datetime
    return [
        entry(
            0,
            SEGMENT_0,
            GO_L1,
            id="01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f",
            channel="alerts",
            origin="sensor-1",
            payload_type="com.example.Alert",
            payload={"message": "hot <b>"},
            timestamp=ts(2026, 3, 31, 14, 22, 1, 123456, tzinfo=UTC),
            service_name="thermostat",
            correlation_id="01970a3c-0000-7000-8000-000000000001",
        ),
        entry(
            0,
            SEGMENT_0,
            GO_L2,
            id="01970a3c-6000-7000-8000-000000000002",
            channel="alerts",
            origin="sensor-2",
            payload_type="com.example.Note",
            payload="just a string",
            timestamp=ts(2026, 3, 31, 14, 22, 2, 987654, tzinfo=UTC),
        ),
        entry(
            0,
            SEGMENT_0,
            GO_L3,
            id="01970a3c-7000-7000-8000-000000000003",
            channel="alerts",
            origin="sensor-1",
            payload_type="",
            payload=None,
            timestamp=ts(2026, 3, 31, 14, 22, 3, tzinfo=UTC),
        ),
        entry(
            SEGMENT_1_START,
            SEGMENT_1,
            GO_L4,
            id="01970a3c-9000-7000-8000-000000000004",
            channel="alerts",
            origin="sensor-3",
            payload_type="com.example.List",
            payload=[1, 2, 3],
            timestamp=ts(2026, 3, 31, 14, 22, 5, 123456, tzinfo=UTC),
        ),
        entry(
            SEGMENT_1_START,
            SEGMENT_1,
            GO_L5,
            id="01970a3c-a000-7000-8000-000000000005",
            channel="alerts",
            origin="sensor-1",
            payload_type="com.example.Num",
            payload=42,
            timestamp=ts(2026, 3, 31, 14, 22, 6, 500000, tzinfo=UTC),
            service_name="counter",
        ),
    ]


@pytest.fixture
def go_data_dir(tmp_path: Path) -> Path:
    """A data directory as keyop-messenger 1.4 leaves it after a crash: channel
    "alerts" with two segments, unreadable lines, and a torn final record."""
    data_dir = tmp_path / "data"
    channel = data_dir / "channels" / "alerts"
    channel.mkdir(parents=True)
    for sub in ("subscribers", "audit"):
        (data_dir / sub).mkdir()
    (channel / segment_name(0)).write_bytes(SEGMENT_0)
    (channel / segment_name(SEGMENT_1_START)).write_bytes(SEGMENT_1)
    (channel / "README.txt").write_text("not a segment\n")
    (channel / (segment_name(0) + ".tmp")).write_text("not a segment either\n")
    return data_dir


def test_reads_go_segments(go_data_dir: Path) -> None:
    expected = expected_go_entries()
    assert list(read_channel(go_data_dir, "alerts")) == expected
    # Reading takes no lock and changes nothing.
    channel = go_data_dir / "channels" / "alerts"
    assert (channel / segment_name(0)).read_bytes() == SEGMENT_0
    assert (channel / segment_name(SEGMENT_1_START)).read_bytes() == SEGMENT_1


@pytest.mark.parametrize("first", range(6))
def test_reads_go_segments_from_an_offset(go_data_dir: Path, first: int) -> None:
    expected = expected_go_entries()
    start = expected[first].offset if first < len(expected) else len(SEGMENT_0 + SEGMENT_1_WHOLE)
    assert list(read_channel(go_data_dir, "alerts", start_offset=start)) == expected[first:]


def test_appending_to_go_segments_recovers_the_torn_record(go_data_dir: Path) -> None:
    config = make_config(go_data_dir.parent)
    assert config.storage.data_dir == str(go_data_dir)
    channel = go_data_dir / "channels" / "alerts"
    end_of_whole_records = SEGMENT_1_START + len(SEGMENT_1_WHOLE)

    with Messenger(config) as m:
        assert m.stream_end("alerts") == end_of_whole_records
        new_id = m.publish("alerts", "com.example.Alert", {"message": "new"})
        everything = list(m.read_channel("alerts"))

    assert [p.name for p in segment_files(channel)] == [
        segment_name(0),
        segment_name(SEGMENT_1_START),
    ]
    assert (channel / segment_name(0)).read_bytes() == SEGMENT_0
    last = (channel / segment_name(SEGMENT_1_START)).read_bytes()
    assert last.startswith(SEGMENT_1_WHOLE)
    new_line = last[len(SEGMENT_1_WHOLE) :]
    assert b"torn" not in last
    assert new_line.endswith(b"\n")
    assert new_line.count(b"\n") == 1
    assert json.loads(new_line)["id"] == new_id

    old = expected_go_entries()
    assert everything[:-1] == old
    new = everything[-1]
    assert (new.message.id, new.message.origin, new.message.payload) == (
        new_id,
        NODE_NAME,
        {"message": "new"},
    )
    assert (new.offset, new.segment) == (end_of_whole_records, SEGMENT_1_START)
    assert list(read_channel(go_data_dir, "alerts")) == everything


# Spec section 8 example.
GO_DEAD_LETTER = (
    '{"v":1,"id":"01970a40-1111-7aaa-9bbb-0123456789ab","ts":"2026-03-31T14:22:05.200131Z",'
    '"channel":"orders.dead-letter","origin":"billing-host",'
    '"payload_type":"com.keyop.messenger.DeadLetterPayload","payload":{"original":{"v":1,'
    '"id":"01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f","ts":"2026-03-31T14:22:01.1234567Z",'
    '"channel":"orders","origin":"billing-host","payload_type":"com.keyop.orders.OrderCreated",'
    '"payload":{"order":42}},"retries":5,"last_error":"invalid state transition",'
    '"failed_at":"2026-03-31T14:22:05.2Z"}}'
)


def test_reads_go_dead_letter_records(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    channel = data_dir / "channels" / "orders.dead-letter"
    channel.mkdir(parents=True)
    segment = channel / segment_name(0)
    segment.write_bytes(GO_DEAD_LETTER.encode() + b"\n")

    [entry] = list(read_channel(data_dir, "orders.dead-letter"))
    msg = entry.message
    assert (entry.offset, entry.segment) == (0, 0)
    assert msg.id == "01970a40-1111-7aaa-9bbb-0123456789ab"
    assert msg.channel == "orders.dead-letter"
    assert msg.origin == "billing-host"
    assert msg.payload_type == "com.keyop.messenger.DeadLetterPayload"
    assert msg.timestamp == datetime.datetime(2026, 3, 31, 14, 22, 5, 200131, tzinfo=UTC)
    assert (msg.service_name, msg.correlation_id) == (None, None)
    assert msg.payload["original"]["payload"] == {"order": 42}
    assert msg.payload["original"]["channel"] == "orders"
    assert msg.payload["retries"] == 5
    assert msg.payload["last_error"] == "invalid state transition"
    assert msg.payload["failed_at"] == "2026-03-31T14:22:05.2Z"

    with Messenger(make_config(tmp_path)) as m:
        assert list(m.read_channel("orders.dead-letter")) == [entry]
        with pytest.raises(InvalidNameError):
            m.publish("orders.dead-letter", "t", {})
    assert segment.read_bytes() == GO_DEAD_LETTER.encode() + b"\n"


def test_lone_surrogate_escapes_and_array_lines_as_go_reads_them(tmp_path: Path) -> None:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"); such a payload is
    read (as Python's json module reads it), also by a subscriber. A line
    holding a JSON array instead of an object is skipped, as 1.4 skips it."""
    data_dir = tmp_path / "data"
    channel = data_dir / "channels" / "odd"
    channel.mkdir(parents=True)
    good = ('{"v":1,"id":"a","ts":"2026-03-31T14:22:01Z","channel":"odd","origin":"go",'
            '"payload_type":"t","payload":{"text":"\\ud800 half","n":1}}')
    array = '[1,"b","2026-03-31T14:22:01Z","odd","go","t",null,null,{}]'
    (channel / segment_name(0)).write_text(f"{array}\n{good}\n")

    [entry] = list(read_channel(data_dir, "odd"))
    assert entry.message.id == "a", "the array line is not an envelope"
    assert entry.message.payload == {"text": "\ud800 half", "n": 1}

    (data_dir / "subscribers" / "odd").mkdir(parents=True)
    (data_dir / "subscribers" / "odd" / "s.offset").write_text("0\n")
    got: list[Any] = []
    with Messenger(make_config(tmp_path)) as m:
        sub = m.subscribe("odd", "s", lambda msg: got.append(msg.payload))
        for _ in range(200):
            if got:
                break
            time.sleep(0.01)
        sub.close()
    assert got == [{"text": "\ud800 half", "n": 1}], "delivered once, surrogate kept"


def test_a_1_4_channel_directory_with_a_name_this_version_refuses_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 1.4 hubs stored channels named by peers without checking the name: such
    # a directory is not read (stats leaves it out); it is said so once.
    config = make_config(tmp_path)
    data_dir = Path(config.storage.data_dir)
    odd = data_dir / "channels" / "with space"
    odd.mkdir(parents=True)
    (odd / f"{0:020d}.jsonl").write_text("")
    with Messenger(config) as m:
        m.publish("fine", "t", 1)
        for _ in range(3):
            assert [c.name for c in m.stats().channels] == ["fine"]
    said = [r.getMessage() for r in caplog.records if "with space" in r.getMessage()]
    assert len(said) == 1 and "not a channel this version reads" in said[0], said
