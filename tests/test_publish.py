# why this file is long: 39 tests of Messenger.publish / publish_batch (one file per public
# operation), sharing helpers.
"""Tests of Messenger publishing: ids, envelopes, payload types, context, batches,
group commit, name checks, size limits, I/O failures, durability modes,
closing and segment rolls."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict, is_typeddict

import pydantic
import pytest

import keyop_messenger
from conftest import NODE_NAME, make_config
from keyop_messenger import (
    ClosedError,
    Config,
    DataDirLockedError,
    InvalidNameError,
    KeyopError,
    LogEntry,
    MessageTooLargeError,
    Messenger,
    PayloadTypeError,
    StorageError,
    read_channel,
)

MIB = 1024 * 1024
MAX_RECORD_BYTES = 10 * MIB
UUID7_RE = r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$"
UTC = datetime.timezone.utc


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def data_dir(m: Messenger) -> Path:
    return Path(m.config.storage.data_dir)


def channel_dir(m: Messenger, channel: str) -> Path:
    return data_dir(m) / "channels" / channel


def stored(m: Messenger, channel: str) -> list[LogEntry]:
    """Every record of ``channel`` as found on disk (no payload decoding)."""
    return list(read_channel(data_dir(m), channel))


def stored_ids(m: Messenger, channel: str) -> list[str]:
    return [e.message.id for e in stored(m, channel)]


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.jsonl"))


def tree(root: Path) -> list[str]:
    """Every path below ``root``, relative, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def counters(m: Messenger, channel: str) -> dict[str, int]:
    return m._engine._counters(channel)


def run_threads(targets: list[Callable[[], None]], timeout: float = 60) -> None:
    """Runs each target in its own thread and waits (bounded) for all of them."""
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a publishing thread hung"


def envelope_overhead(channel: str, payload_type: str, ts_len: int) -> int:
    """Bytes of a record other than its payload's JSON, for a ``ts`` of ``ts_len``
    characters (20 to 30) and no service name or correlation id."""
    envelope = {
        "v": 1,
        "id": "0" * 36,
        "ts": "0" * ts_len,
        "channel": channel,
        "origin": NODE_NAME,
        "payload_type": payload_type,
        "payload": None,
    }
    line = json.dumps(envelope, separators=(",", ":"))
    return len(line) - len("null") + len("\n")


# ---------------------------------------------------------------------------
# Publish and read back
# ---------------------------------------------------------------------------


@pytest.mark.arm
def test_publish_returns_uuid7_and_reads_back(messenger: Messenger) -> None:
    now = datetime.datetime.now(UTC)
    payload = {"message": "hot", "values": [1, 2.5, None, True], "nested": {"k": "v"}}
    mid = messenger.publish(
        "alerts", "com.example.Alert", payload, service_name="svc", correlation_id="corr-1"
    )

    assert isinstance(mid, str)
    assert re.match(UUID7_RE, mid)
    parsed = uuid.UUID(mid)
    assert parsed.version == 7
    id_time = datetime.datetime.fromtimestamp((parsed.int >> 80) / 1000, UTC)
    assert abs(id_time - now) < datetime.timedelta(minutes=1)

    [entry] = stored(messenger, "alerts")
    msg = entry.message
    assert (msg.id, msg.channel, msg.origin, msg.payload_type) == (
        mid,
        "alerts",
        NODE_NAME,
        "com.example.Alert",
    )
    assert msg.payload == payload
    assert (msg.service_name, msg.correlation_id) == ("svc", "corr-1")
    assert msg.timestamp.tzinfo is not None
    assert msg.timestamp.utcoffset() == datetime.timedelta(0)
    assert abs(msg.timestamp - now) < datetime.timedelta(minutes=1)
    assert (entry.offset, entry.segment) == (0, 0)
    assert list(messenger.read_channel("alerts")) == [entry]


def test_publish_without_metadata_reads_back_none(messenger: Messenger) -> None:
    mid = messenger.publish("plain", "", None)
    [entry] = stored(messenger, "plain")
    assert entry.message.id == mid
    assert entry.message.payload_type == ""
    assert entry.message.payload is None
    assert entry.message.service_name is None
    assert entry.message.correlation_id is None


def test_ids_are_unique_and_increasing(messenger: Messenger) -> None:
    ids = [messenger.publish("seq", "t", i) for i in range(200)]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert stored_ids(messenger, "seq") == ids


# ---------------------------------------------------------------------------
# Payload types
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Order(pydantic.BaseModel):
    order_id: int
    items: list[str]


class Alert(TypedDict):
    message: str
    level: int


class Color(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


REGISTERED_CASES = [
    pytest.param(Point, Point(1, 2), {"x": 1, "y": 2}, {"x": 1, "y": 2}, id="dataclass"),
    pytest.param(
        Order,
        Order(order_id=7, items=["a", "b"]),
        {"order_id": 7, "items": ["a", "b"]},
        {"order_id": 7, "items": ["a", "b"]},
        id="pydantic",
    ),
    pytest.param(
        Alert,
        Alert(message="hot", level=3),
        {"message": "hot", "level": 3},
        ["hot", 3],
        id="typeddict",
    ),
    pytest.param(dict, {"k": [1, None]}, {"k": [1, None]}, "not a mapping", id="dict"),
]


@pytest.mark.parametrize(("cls", "good", "plain", "bad"), REGISTERED_CASES)
def test_registered_type_round_trips(
    messenger: Messenger, cls: type, good: Any, plain: Any, bad: Any
) -> None:
    messenger.register_payload_type("com.example.T", cls)
    mid = messenger.publish("typed", "com.example.T", good)

    [entry] = list(messenger.read_channel("typed"))
    assert entry.message.id == mid
    expected_type = dict if is_typeddict(cls) else cls
    assert type(entry.message.payload) is expected_type
    assert entry.message.payload == good
    # On disk the payload is plain JSON data.
    assert [e.message.payload for e in stored(messenger, "typed")] == [plain]


@pytest.mark.parametrize(("cls", "good", "plain", "bad"), REGISTERED_CASES)
def test_registered_type_rejects_other_payloads(
    messenger: Messenger, cls: type, good: Any, plain: Any, bad: Any
) -> None:
    messenger.register_payload_type("com.example.T", cls)
    end = messenger.stream_end("typed")

    with pytest.raises(PayloadTypeError):
        messenger.publish("typed", "com.example.T", bad)
    with pytest.raises(PayloadTypeError):
        messenger.publish_batch("typed", [("com.example.T", good), ("com.example.T", bad)])

    assert messenger.stream_end("typed") == end
    assert not (data_dir(messenger) / "channels" / "typed").exists()


def test_duplicate_registration_is_refused(messenger: Messenger) -> None:
    messenger.register_payload_type("com.example.Point", Point)
    with pytest.raises(PayloadTypeError, match="already registered"):
        messenger.register_payload_type("com.example.Point", Point)
    with pytest.raises(PayloadTypeError, match="already registered"):
        messenger.register_payload_type("com.example.Point", dict)
    # The first registration still holds.
    with pytest.raises(PayloadTypeError):
        messenger.publish("typed", "com.example.Point", {"x": 1, "y": 2})
    messenger.publish("typed", "com.example.Point", Point(3, 4))
    assert [e.message.payload for e in messenger.read_channel("typed")] == [Point(3, 4)]


@pytest.mark.parametrize(("name", "cls"), [("", dict), ("com.example.Int", int)])
def test_unsupported_registration_is_refused(messenger: Messenger, name: str, cls: type) -> None:
    with pytest.raises(PayloadTypeError):
        messenger.register_payload_type(name, cls)


JSON_VALUES = [
    {"a": 1},
    {},
    [1, "two", None, False],
    [],
    "text",
    "",
    'line\nbreak "quoted" \\ tab\t unicode é 😀 \u2028',
    42,
    -1,
    2**70,
    3.5,
    0.1,
    1e300,
    True,
    None,
    {"a": [{"b": {"c": [1, 2, {"d": None}]}}], "e": {"f": []}},
]


@pytest.mark.parametrize("value", JSON_VALUES)
def test_unregistered_payload_round_trips_as_plain_data(messenger: Messenger, value: Any) -> None:
    mid = messenger.publish("plain", "com.example.Unregistered", value)
    [entry] = list(messenger.read_channel("plain"))
    assert entry.message.id == mid
    assert entry.message.payload == value
    assert type(entry.message.payload) is type(value)


def cyclic_list() -> list[Any]:
    value: list[Any] = []
    value.append(value)
    return value


NON_JSON_VALUES = [
    pytest.param(float("nan"), id="nan"),
    pytest.param(float("inf"), id="inf"),
    pytest.param(object(), id="object"),
    pytest.param(b"bytes", id="bytes"),
    pytest.param({1: "int key"}, id="int-key"),
    pytest.param({"a": [float("-inf")]}, id="nested-inf"),
    pytest.param({"a": {"b": object()}}, id="nested-object"),
    pytest.param(cyclic_list(), id="cycle"),
]


@pytest.mark.parametrize("value", NON_JSON_VALUES)
def test_non_json_payload_is_refused_and_nothing_written(messenger: Messenger, value: Any) -> None:
    messenger.publish("plain", "t", "before")
    end = messenger.stream_end("plain")

    with pytest.raises(PayloadTypeError):
        messenger.publish("plain", "t", value)
    with pytest.raises(PayloadTypeError):
        messenger.publish_batch("plain", [("t", "fine"), ("t", value)])

    assert messenger.stream_end("plain") == end
    assert [e.message.payload for e in stored(messenger, "plain")] == ["before"]


def test_common_python_values_are_encoded_as_json(messenger: Messenger) -> None:
    payload = {
        "when": datetime.datetime(2026, 3, 31, 14, 22, 1, 500000, tzinfo=UTC),
        "day": datetime.date(2026, 3, 31),
        "id": uuid.UUID("01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f"),
        "color": Color.RED,
        "level": Level.HIGH,
        "amount": decimal.Decimal("12.50"),
        "pair": ("a", 1),
        "point": Point(1, 2),
    }
    messenger.publish("encoded", "t", payload)
    [entry] = stored(messenger, "encoded")
    assert entry.message.payload == {
        "when": "2026-03-31T14:22:01.500000+00:00",
        "day": "2026-03-31",
        "id": "01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f",
        "color": "red",
        "level": 3,
        "amount": "12.50",
        "pair": ["a", 1],
        "point": {"x": 1, "y": 2},
    }


# ---------------------------------------------------------------------------
# Publishing context
# ---------------------------------------------------------------------------


def metadata(m: Messenger, channel: str) -> list[tuple[str | None, str | None]]:
    return [(e.message.service_name, e.message.correlation_id) for e in stored(m, channel)]


def test_context_sets_nests_and_is_overridden(messenger: Messenger) -> None:
    ch = "ctx"
    messenger.publish(ch, "t", 0)
    with keyop_messenger.context(service_name="svc", correlation_id="c1"):
        messenger.publish(ch, "t", 1)
        with keyop_messenger.context(correlation_id="c2"):
            messenger.publish(ch, "t", 2)
            messenger.publish(ch, "t", 3, service_name="explicit", correlation_id="c3")
            messenger.publish_batch(ch, [("t", 4)])
        with keyop_messenger.context(service_name="inner"):
            messenger.publish(ch, "t", 5)
        messenger.publish(ch, "t", 6)
    messenger.publish(ch, "t", 7)

    assert metadata(messenger, ch) == [
        (None, None),
        ("svc", "c1"),
        ("svc", "c2"),
        ("explicit", "c3"),
        ("svc", "c2"),
        ("inner", "c1"),
        ("svc", "c1"),
        (None, None),
    ]


def test_context_text_that_is_not_unicode_is_named(messenger: Messenger) -> None:
    """Fields taken from the context are checked like arguments: the error
    names the one at fault and nothing is written."""
    end = messenger.stream_end("ctx-bad")
    with keyop_messenger.context(correlation_id="c\ud800"), pytest.raises(
        InvalidNameError, match=re.escape("correlation id 'c\\ud800'")
    ):
        messenger.publish("ctx-bad", "t", 1)
    with keyop_messenger.context(service_name="s\udfff"), pytest.raises(
        InvalidNameError, match="service name"
    ):
        messenger.publish("ctx-bad", "t", 1, correlation_id="fine")
    assert messenger.stream_end("ctx-bad") == end


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((None, "t", 1), {}),
        (("ch", 3, 1), {}),
        (("ch", "t", 1), {"service_name": 7}),
        (("ch", "t", 1), {"correlation_id": b"bytes"}),
    ],
)
def test_publish_arguments_of_the_wrong_type_raise_type_error(
    messenger: Messenger, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    with pytest.raises(TypeError):
        messenger.publish(*args, **kwargs)


def test_publish_before_the_messenger_is_set_up_is_refused(tmp_path: Path) -> None:
    class Early(Messenger):
        def __init__(self, config: Config) -> None:
            self.publish("ch", "t", 1)  # before Messenger.__init__ opened anything

    with pytest.raises(ClosedError, match="not set up"):
        Early(make_config(tmp_path))
    assert not (tmp_path / "data").exists()


def test_context_is_restored_after_an_exception(messenger: Messenger) -> None:
    with pytest.raises(RuntimeError), keyop_messenger.context(service_name="svc"):
        raise RuntimeError("boom")
    messenger.publish("ctx", "t", 1)
    assert metadata(messenger, "ctx") == [(None, None)]


def test_context_is_per_thread(messenger: Messenger) -> None:
    go = threading.Event()
    done = threading.Event()

    def other_thread() -> None:
        if go.wait(timeout=30):
            messenger.publish("ctx", "t", "thread")
            done.set()

    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    try:
        with keyop_messenger.context(service_name="main", correlation_id="main-c"):
            go.set()
            assert done.wait(timeout=30), "publishing thread did not finish"
            messenger.publish("ctx", "t", "main")
    finally:
        go.set()
        thread.join(timeout=30)
    assert not thread.is_alive()

    by_payload = {e.message.payload: e.message for e in stored(messenger, "ctx")}
    assert (by_payload["thread"].service_name, by_payload["thread"].correlation_id) == (
        None,
        None,
    )
    assert (by_payload["main"].service_name, by_payload["main"].correlation_id) == (
        "main",
        "main-c",
    )


# ---------------------------------------------------------------------------
# Batches and group commit
# ---------------------------------------------------------------------------


@pytest.mark.arm
def test_publish_batch_is_ordered_and_contiguous(messenger: Messenger) -> None:
    first = messenger.publish("batch", "t", "first")
    ids = messenger.publish_batch("batch", [("t", {"i": i}) for i in range(10)], service_name="svc")
    last = messenger.publish("batch", "t", "last")

    assert len(ids) == 10
    assert len(set(ids)) == 10
    entries = stored(messenger, "batch")
    assert [e.message.id for e in entries] == [first, *ids, last]
    assert [e.message.payload for e in entries[1:-1]] == [{"i": i} for i in range(10)]
    assert {e.message.service_name for e in entries[1:-1]} == {"svc"}

    raw = (channel_dir(messenger, "batch") / "00000000000000000000.jsonl").read_bytes()
    lines = raw.splitlines(keepends=True)
    expected_offsets = [sum(len(line) for line in lines[:i]) for i in range(len(lines))]
    assert [e.offset for e in entries] == expected_offsets
    assert messenger.stream_end("batch") == len(raw)


def test_publish_batch_of_1000_is_one_write_and_one_fsync(messenger: Messenger) -> None:
    messenger.publish("big-batch", "t", "warm-up")
    before = counters(messenger, "big-batch")

    ids = messenger.publish_batch("big-batch", [("t", {"i": i}) for i in range(1000)])

    after = counters(messenger, "big-batch")
    assert after["fsyncs"] - before["fsyncs"] == 1
    assert after["writes"] - before["writes"] == 1
    assert after["records"] - before["records"] == 1000
    assert stored_ids(messenger, "big-batch")[1:] == ids


def test_empty_batch_writes_nothing(messenger: Messenger) -> None:
    end = messenger.stream_end("empty")
    assert messenger.publish_batch("empty", []) == []
    assert messenger.stream_end("empty") == end


def test_malformed_batch_item_is_refused(messenger: Messenger) -> None:
    end = messenger.stream_end("batch")
    with pytest.raises(PayloadTypeError):
        messenger.publish_batch("batch", [("t", 1), ("t", 2, 3)])
    assert messenger.stream_end("batch") == end


@pytest.mark.parametrize("item", ["ab", {"t": 1, "u": 2}], ids=["str", "mapping"])
def test_non_tuple_batch_item_is_refused(messenger: Messenger, item: Any) -> None:
    end = messenger.stream_end("batch")
    with pytest.raises(PayloadTypeError):
        messenger.publish_batch("batch", [item])
    assert messenger.stream_end("batch") == end


def test_group_commit_shares_fsyncs(messenger: Messenger) -> None:
    threads, per_thread = 16, 100
    barrier = threading.Barrier(threads, timeout=30)
    published: list[list[str]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def publisher(n: int) -> Callable[[], None]:
        def run() -> None:
            try:
                barrier.wait()
                for i in range(per_thread):
                    published[n].append(messenger.publish("gc", "t", {"thread": n, "i": i}))
            except BaseException as exc:  # reported below
                errors.append(exc)

        return run

    run_threads([publisher(n) for n in range(threads)])

    assert errors == []
    all_ids = [mid for ids in published for mid in ids]
    assert len(all_ids) == threads * per_thread
    assert len(set(all_ids)) == len(all_ids)
    on_disk = stored_ids(messenger, "gc")
    assert sorted(on_disk) == sorted(all_ids)
    position = {mid: n for n, mid in enumerate(on_disk)}
    for ids in published:  # each thread's messages are stored in its order
        assert [position[mid] for mid in ids] == sorted(position[mid] for mid in ids)
    c = counters(messenger, "gc")
    assert c["records"] == threads * per_thread
    assert c["fsyncs"] < threads * per_thread
    assert c["failures"] == 0


# ---------------------------------------------------------------------------
# Channel names
# ---------------------------------------------------------------------------

BAD_NAMES = [
    "..",
    ".",
    "a/b",
    "../escape",
    "/absolute",
    "",
    "x" * 256,
    "a\x00b",
    "chan.dead-letter",
    "white space",
    "tab\t",
    "é",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_invalid_channel_name_is_refused(messenger: Messenger, tmp_path: Path, name: str) -> None:
    before = tree(tmp_path)
    for publish in (
        lambda: messenger.publish(name, "t", {}),
        lambda: messenger.publish_batch(name, [("t", {})]),
    ):
        with pytest.raises(InvalidNameError) as info:
            publish()
        assert isinstance(info.value, KeyopError)
        assert isinstance(info.value, ValueError)
    assert tree(tmp_path) == before
    assert list((data_dir(messenger) / "channels").iterdir()) == []


@pytest.mark.parametrize("name", [n for n in BAD_NAMES if n != "chan.dead-letter"])
def test_reading_an_invalid_channel_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidNameError):
        list(read_channel(tmp_path, name))
    assert tree(tmp_path) == []


def test_longest_publishable_name_leaves_room_for_its_dead_letter_channel(
    messenger: Messenger,
) -> None:
    # 243 + len(".dead-letter") == 255, the file-name limit.
    with pytest.raises(InvalidNameError, match="at most 243"):
        messenger.publish("c" * 244, "t", "ok")
    sub = messenger.subscribe("c" * 243, "s", lambda m: None)
    sub.close()
    assert channel_dir(messenger, "c" * 243 + ".dead-letter").is_dir()


@pytest.mark.parametrize("name", ["c" * 243, "A.b_c-9", "fed-hub"])
def test_valid_channel_names_work(messenger: Messenger, name: str) -> None:
    mid = messenger.publish(name, "t", "ok")
    assert channel_dir(messenger, name).is_dir()
    assert stored_ids(messenger, name) == [mid]


# ---------------------------------------------------------------------------
# Size limit
# ---------------------------------------------------------------------------


def test_message_over_10_mib_is_refused(messenger: Messenger) -> None:
    # One byte over the limit even with the shortest possible timestamp.
    size = MAX_RECORD_BYTES - envelope_overhead("big", "blob", ts_len=20) - 2 + 1
    too_big = "x" * size
    messenger.publish("big", "blob", "small")
    end = messenger.stream_end("big")

    with pytest.raises(MessageTooLargeError) as info:
        messenger.publish("big", "blob", too_big)
    assert isinstance(info.value, KeyopError)
    assert isinstance(info.value, ValueError)
    with pytest.raises(MessageTooLargeError):
        messenger.publish_batch("big", [("blob", "fine"), ("blob", too_big)])

    assert messenger.stream_end("big") == end
    assert [e.message.payload for e in stored(messenger, "big")] == ["small"]


def test_message_at_the_limit_is_accepted(messenger: Messenger) -> None:
    # At most the limit even with the longest possible timestamp.
    size = MAX_RECORD_BYTES - envelope_overhead("big", "blob", ts_len=30) - 2
    mid = messenger.publish("big", "blob", "y" * size)
    [entry] = stored(messenger, "big")
    assert entry.message.id == mid
    assert entry.message.payload == "y" * size
    assert MAX_RECORD_BYTES - 10 <= messenger.stream_end("big") <= MAX_RECORD_BYTES


def test_nine_mib_message_is_accepted(messenger: Messenger) -> None:
    payload = {"blob": "z" * (9 * MIB)}
    mid = messenger.publish("big", "blob", payload)
    [entry] = list(messenger.read_channel("big"))
    assert entry.message.id == mid
    assert entry.message.payload == payload


# ---------------------------------------------------------------------------
# I/O failures (fault injection)
# ---------------------------------------------------------------------------


def active_segment(m: Messenger, channel: str) -> Path:
    return segment_files(channel_dir(m, channel))[-1]


def test_failed_partial_write_is_not_committed(messenger: Messenger) -> None:
    first = messenger.publish("faulty", "t", "first")
    segment = active_segment(messenger, "faulty")
    size = segment.stat().st_size
    messenger._engine._inject_fault("faulty", "write", partial=17)

    with pytest.raises(StorageError) as info:
        messenger.publish("faulty", "t", "failed")
    assert isinstance(info.value, OSError)
    assert "not committed" in str(info.value)
    assert segment.stat().st_size == size
    assert messenger.stream_end("faulty") == size

    third = messenger.publish("faulty", "t", "third")
    assert stored_ids(messenger, "faulty") == [first, third]
    assert len(segment.read_bytes().splitlines()) == 2
    assert counters(messenger, "faulty")["failures"] == 1


def test_failed_batch_write_commits_nothing(messenger: Messenger) -> None:
    first = messenger.publish("faulty", "t", "first")
    size = active_segment(messenger, "faulty").stat().st_size
    messenger._engine._inject_fault("faulty", "write", partial=300)

    with pytest.raises(StorageError):
        messenger.publish_batch("faulty", [("t", {"i": i}) for i in range(10)])
    assert active_segment(messenger, "faulty").stat().st_size == size

    ids = messenger.publish_batch("faulty", [("t", "ok")])
    assert stored_ids(messenger, "faulty") == [first, *ids]


def test_failed_fsync_is_not_committed(messenger: Messenger) -> None:
    first = messenger.publish("faulty", "t", "first")
    segment = active_segment(messenger, "faulty")
    size = segment.stat().st_size
    messenger._engine._inject_fault("faulty", "sync")

    with pytest.raises(StorageError, match="not committed"):
        messenger.publish("faulty", "t", "unsynced")
    assert segment.stat().st_size == size
    assert b"unsynced" not in segment.read_bytes()
    assert stored_ids(messenger, "faulty") == [first]
    assert [e.message.id for e in messenger.read_channel("faulty")] == [first]

    third = messenger.publish("faulty", "t", "third")
    assert stored_ids(messenger, "faulty") == [first, third]


def test_failed_roll_is_not_committed_and_later_publishes_work(tmp_path: Path) -> None:
    blob = "r" * 200_000
    with Messenger(make_config(tmp_path, segment_size_mb=1)) as m:
        ok = [m.publish("rolling", "t", {"n": n, "blob": blob}) for n in range(5)]
        first_size = m.stream_end("rolling")
        assert first_size + len(blob) > MIB  # the next record needs a new segment
        m._engine._inject_fault("rolling", "roll")

        with pytest.raises(StorageError, match="not committed"):
            m.publish("rolling", "t", {"n": 5, "blob": blob})
        assert m.stream_end("rolling") == first_size
        assert counters(m, "rolling")["rolls"] == 0

        ok += [m.publish("rolling", "t", {"n": n, "blob": blob}) for n in (6, 7)]
        assert counters(m, "rolling")["rolls"] == 1

        entries = stored(m, "rolling")
        assert [e.message.id for e in entries] == ok
        assert [e.message.payload["n"] for e in entries] == [0, 1, 2, 3, 4, 6, 7]
        assert [e.segment for e in entries] == [0] * 5 + [first_size] * 2
        names = [p.name for p in segment_files(channel_dir(m, "rolling"))]
        assert names == ["00000000000000000000.jsonl", f"{first_size:020d}.jsonl"]


# ---------------------------------------------------------------------------
# Durability modes and closing
# ---------------------------------------------------------------------------


@pytest.mark.arm
def test_relaxed_mode_publishes_are_readable_and_persist(tmp_path: Path) -> None:
    config = make_config(tmp_path, sync_interval_ms=20)
    with Messenger(config) as m:
        ids = [m.publish("relaxed", "t", {"i": i}) for i in range(50)]
        assert [e.message.id for e in m.read_channel("relaxed")] == ids
        c = counters(m, "relaxed")
        assert (c["records"], c["writes"], c["failures"]) == (50, 50, 0)
    with pytest.raises(ClosedError):
        counters(m, "relaxed")
    with Messenger(config) as reopened:
        assert [e.message.id for e in reopened.read_channel("relaxed")] == ids


def test_relaxed_publishers_on_many_threads_lose_and_reorder_nothing(tmp_path: Path) -> None:
    """Relaxed publishes from 16 threads, and from a subscriber's callback, which
    each publish at once while holding the GIL when the channel is idle and
    queue otherwise: every message stored once, each thread's in its order."""
    threads, per_thread = 16, 300
    barrier = threading.Barrier(threads, timeout=30)
    published: list[list[str]] = [[] for _ in range(threads)]
    echoed: list[str] = []
    errors: list[BaseException] = []
    with Messenger(make_config(tmp_path, sync_interval_ms=200)) as m:

        def echo(msg: Any) -> None:
            echoed.append(m.publish("echo", "t", msg.payload))

        m.subscribe("many", "echo", echo)

        def publisher(n: int) -> Callable[[], None]:
            def run() -> None:
                try:
                    barrier.wait()
                    for i in range(per_thread):
                        published[n].append(m.publish("many", "t", {"thread": n, "i": i}))
                except BaseException as exc:  # reported below
                    errors.append(exc)

            return run

        run_threads([publisher(n) for n in range(threads)])
        assert errors == []
        on_disk = stored_ids(m, "many")
        assert sorted(on_disk) == sorted(mid for ids in published for mid in ids)
        position = {mid: n for n, mid in enumerate(on_disk)}
        for ids in published:
            assert [position[mid] for mid in ids] == sorted(position[mid] for mid in ids)
        deadline = time.monotonic() + 60
        while len(stored_ids(m, "echo")) < threads * per_thread:
            assert time.monotonic() < deadline, "the callback's publishes never all arrived"
            time.sleep(0.05)
        assert stored_ids(m, "echo") == echoed
        c = counters(m, "many")
        assert (c["records"], c["failures"]) == (threads * per_thread, 0)


def test_close_is_idempotent_and_refuses_later_use(messenger: Messenger) -> None:
    mid = messenger.publish("closing", "t", 1)
    assert not messenger.closed
    messenger.close()
    messenger.close()
    assert messenger.closed

    with pytest.raises(ClosedError) as info:
        messenger.publish("closing", "t", 2)
    assert isinstance(info.value, KeyopError)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(ClosedError):
        messenger.publish_batch("closing", [("t", 3)])
    with pytest.raises(ClosedError):
        messenger.stream_end("closing")
    assert stored_ids(messenger, "closing") == [mid]


def test_data_dir_lock_is_held_while_open_and_released_on_close(config: Config) -> None:
    first = Messenger(config)
    try:
        with pytest.raises(StorageError, match="in use") as info:
            Messenger(config)
        assert isinstance(info.value, OSError)
        first.publish("locked", "t", "still works")
    finally:
        first.close()

    with Messenger(config) as second:
        second.publish("locked", "t", "second")
        assert [e.message.payload for e in second.read_channel("locked")] == [
            "still works",
            "second",
        ]
    assert second.closed
    Messenger(config).close()  # the context manager released the lock too


def test_held_data_dir_raises_data_dir_locked_error(tmp_path: Path, config: Config) -> None:
    with Messenger(config):
        with pytest.raises(DataDirLockedError, match="in use by another messenger") as info:
            Messenger(config)
    assert isinstance(info.value, StorageError)  # still caught by `except StorageError`
    assert isinstance(info.value, OSError)

    # Other storage failures stay plain StorageErrors.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError) as other:
        Messenger(make_config(tmp_path, data_dir=str(blocker)))
    assert not isinstance(other.value, DataDirLockedError)


# ---------------------------------------------------------------------------
# Segment rolling
# ---------------------------------------------------------------------------


@pytest.mark.arm
def test_segments_roll_at_the_threshold(tmp_path: Path) -> None:
    blob = "s" * 10_000
    with Messenger(make_config(tmp_path, segment_size_mb=1)) as m:
        ids = [m.publish("rolled", "t", {"n": n, "blob": blob}) for n in range(256)]
        entries = list(m.read_channel("rolled"))
        segments = segment_files(channel_dir(m, "rolled"))
        assert counters(m, "rolled")["rolls"] == len(segments) - 1
        assert m.stream_end("rolled") == int(segments[-1].stem) + segments[-1].stat().st_size

    assert [e.message.id for e in entries] == ids
    assert len(segments) >= 3

    expected: list[tuple[int, int]] = []  # (offset, segment) of each line on disk
    start = 0
    for path in segments:
        assert path.name == f"{start:020d}.jsonl"
        data = path.read_bytes()
        assert 0 < len(data) <= MIB
        assert data.endswith(b"\n")
        offset = start
        for line in data.splitlines(keepends=True):
            expected.append((offset, start))
            offset += len(line)
        start += len(data)
    assert [(e.offset, e.segment) for e in entries] == expected


# ---------------------------------------------------------------------------
# Configuration file
# ---------------------------------------------------------------------------


def test_messenger_accepts_a_yaml_config_path(tmp_path: Path) -> None:
    path = tmp_path / "keyop.yaml"
    path.write_text(
        "name: yaml-node\n"
        "storage:\n"
        f"  data_dir: {json.dumps(str(tmp_path / 'yaml-data'))}\n"
        "  sync_interval_ms: 0\n",
        encoding="utf-8",
    )
    for source in (path, str(path)):
        with Messenger(source) as m:
            assert m.name == "yaml-node"
            m.publish("from-yaml", "t", str(source))
    entries = list(read_channel(tmp_path / "yaml-data", "from-yaml"))
    assert [e.message.origin for e in entries] == ["yaml-node", "yaml-node"]
    assert [e.message.payload for e in entries] == [str(path), str(path)]
