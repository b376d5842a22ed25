"""Tests of start positions: ``subscribe(start=..., reset=...)``,
``Subscription.seek`` and ``read_channel(since=..., until=..., limit=...)``.

Positions are "earliest", "latest", an int offset that starts a record, or a
timezone-aware datetime (the first record published at or after it). Waits
poll with a bounded deadline; nothing relies on a sleep being long enough
(the short sleeps only separate publish times).
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import make_config
from keyop_messenger import (
    ChannelNotFoundError,
    ConfigError,
    Message,
    Messenger,
    Subscription,
    read_channel,
)
from keyop_messenger.aio import AsyncMessenger

UTC = datetime.timezone.utc
CH = "positions"
WAIT_S = 10.0


class Collector:
    """A handler recording payload ``n`` values in delivery order."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.cond = threading.Condition()

    def __call__(self, msg: Message) -> None:
        with self.cond:
            self.seen.append(msg.payload["n"])
            self.cond.notify_all()

    def wait_for(self, count: int) -> list[int]:
        with self.cond:
            ok = self.cond.wait_for(lambda: len(self.seen) >= count, timeout=WAIT_S)
        assert ok, f"only {self.seen} delivered, expected {count}"
        return list(self.seen)


def publish(m: Messenger, ns: range) -> None:
    for n in ns:
        m.publish(CH, "t.N", {"n": n})


def offsets(m: Messenger) -> list[int]:
    return [e.offset for e in m.read_channel(CH)]


def wait_until(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def barrier(m: Messenger, c: Collector, n: int) -> list[int]:
    """Publishes ``n`` and returns everything delivered up to it."""
    publish(m, range(n, n + 1))
    with c.cond:
        ok = c.cond.wait_for(lambda: n in c.seen, timeout=WAIT_S)
    assert ok, f"barrier {n} not delivered: {c.seen}"
    return list(c.seen)


def test_latest_is_the_default(messenger: Messenger) -> None:
    publish(messenger, range(3))
    c = Collector()
    with messenger.subscribe(CH, "s", c):
        assert barrier(messenger, c, 100) == [100]


def test_earliest_delivers_history(messenger: Messenger) -> None:
    publish(messenger, range(3))
    c = Collector()
    with messenger.subscribe(CH, "s", c, start="earliest"):
        assert barrier(messenger, c, 100) == [0, 1, 2, 100]


def test_offset_start(messenger: Messenger) -> None:
    publish(messenger, range(4))
    at = offsets(messenger)[2]
    c = Collector()
    with messenger.subscribe(CH, "s", c, start=at):
        assert barrier(messenger, c, 100) == [2, 3, 100]


def test_offset_inside_a_record_is_refused(messenger: Messenger) -> None:
    publish(messenger, range(2))
    at = offsets(messenger)[1] + 3
    with pytest.raises(ConfigError, match="not the start of a record"):
        messenger.subscribe(CH, "s", Collector(), start=at)
    end = messenger.stream_end(CH)
    with pytest.raises(ConfigError, match="past the end"):
        messenger.subscribe(CH, "s", Collector(), start=end + 10)


def test_datetime_start_between_two_records(messenger: Messenger) -> None:
    publish(messenger, range(3))
    time.sleep(0.005)
    between = datetime.datetime.now(UTC)
    time.sleep(0.005)
    publish(messenger, range(3, 5))
    c = Collector()
    with messenger.subscribe(CH, "s", c, start=between):
        assert barrier(messenger, c, 100) == [3, 4, 100]
    # A time after every record: the end.
    c2 = Collector()
    later = datetime.datetime.now(UTC) + datetime.timedelta(hours=1)
    with messenger.subscribe(CH, "s2", c2, start=later):
        assert barrier(messenger, c2, 101) == [101]


def test_naive_datetime_is_refused(messenger: Messenger) -> None:
    publish(messenger, range(1))
    with pytest.raises(ConfigError, match="naive datetime"):
        messenger.subscribe(CH, "s", Collector(), start=datetime.datetime.now())
    with pytest.raises(ConfigError, match="naive datetime"):
        list(messenger.read_channel(CH, since=datetime.datetime.now()))


def test_start_applies_only_without_stored_offset_unless_reset(messenger: Messenger) -> None:
    publish(messenger, range(2))
    c = Collector()
    with messenger.subscribe(CH, "s", c):
        assert barrier(messenger, c, 100) == [100]
    # A stored offset wins over start=...
    c2 = Collector()
    with messenger.subscribe(CH, "s", c2, start="earliest"):
        assert barrier(messenger, c2, 101) == [101]
    # ... unless reset=True.
    c3 = Collector()
    with messenger.subscribe(CH, "s", c3, start="earliest", reset=True):
        assert barrier(messenger, c3, 102) == [0, 1, 100, 101, 102]
    # reset to "latest" skips what is there.
    publish(messenger, range(5, 7))
    c4 = Collector()
    with messenger.subscribe(CH, "s", c4, reset=True):
        assert barrier(messenger, c4, 103) == [103]


def test_seek_while_running(messenger: Messenger) -> None:
    publish(messenger, range(3))
    c = Collector()
    sub: Subscription
    with messenger.subscribe(CH, "s", c, start="earliest") as sub:
        assert c.wait_for(3) == [0, 1, 2]
        sub.seek("earliest")
        assert c.wait_for(6) == [0, 1, 2, 0, 1, 2]
        sub.seek(offsets(messenger)[2])
        assert c.wait_for(7) == [0, 1, 2, 0, 1, 2, 2]
        with pytest.raises(ConfigError, match="not the start of a record"):
            sub.seek(offsets(messenger)[1] + 1)
        sub.seek("latest")
        wait_until(lambda: sub.position == messenger.stream_end(CH))
        assert barrier(messenger, c, 100)[7:] == [100]
    # The offset the seek set was persisted: resuming starts after 100.
    c2 = Collector()
    with messenger.subscribe(CH, "s", c2):
        assert barrier(messenger, c2, 101) == [101]


def test_seek_persists_the_offset(messenger: Messenger, tmp_path: Path) -> None:
    publish(messenger, range(3))
    sub = messenger.subscribe(CH, "s", Collector())
    end = messenger.stream_end(CH)
    sub.seek("earliest")
    path = tmp_path / "data" / "subscribers" / CH / "s.offset"
    wait_until(lambda: sub.position == end)  # everything redelivered
    sub.close()
    assert int(path.read_text().strip()) == end


def test_read_channel_since_until_limit(messenger: Messenger, tmp_path: Path) -> None:
    publish(messenger, range(3))
    time.sleep(0.005)
    t1 = datetime.datetime.now(UTC)
    time.sleep(0.005)
    publish(messenger, range(3, 6))
    time.sleep(0.005)
    t2 = datetime.datetime.now(UTC)
    time.sleep(0.005)
    publish(messenger, range(6, 8))
    offs = offsets(messenger)

    def ns(**kw: object) -> list[int]:
        return [e.message.payload["n"] for e in messenger.read_channel(CH, **kw)]  # type: ignore[arg-type]

    assert ns(since=t1) == [3, 4, 5, 6, 7]
    assert ns(since=t1, until=t2) == [3, 4, 5]
    assert ns(until=t1) == [0, 1, 2]
    assert ns(since=offs[1], until=offs[4]) == [1, 2, 3]
    assert ns(since="earliest", limit=2) == [0, 1]
    assert ns(since=t2, limit=1) == [6]
    assert ns(since="latest") == []
    assert ns(limit=0) == []
    with pytest.raises(ConfigError, match="not the start of a record"):
        ns(since=offs[1] + 2)
    # The module function, on the data directory.
    data = tmp_path / "data"
    got = [e.message.payload["n"] for e in read_channel(data, CH, since=t1, until=t2, limit=2)]
    assert got == [3, 4]
    assert [e.message.payload["n"] for e in read_channel(data, CH, until=offs[2])] == [0, 1]


def test_read_channel_start_offset_is_checked_like_every_position(
    messenger: Messenger,
) -> None:
    """A start_offset inside a record, past the end or negative is refused
    (as ``since=``, ``subscribe(start=)`` and ``seek`` refuse it), never a
    silent skip to the next record or an empty result."""
    publish(messenger, range(3))
    offs = offsets(messenger)
    end = messenger.stream_end(CH)

    def ns(start: int) -> list[int]:
        return [e.message.payload["n"] for e in messenger.read_channel(CH, start_offset=start)]

    assert ns(0) == [0, 1, 2]
    assert ns(offs[1]) == [1, 2]
    assert ns(end) == []
    with pytest.raises(ConfigError, match="not the start of a record"):
        ns(offs[1] + 2)
    with pytest.raises(ConfigError, match="past the end"):
        ns(end + 1)
    with pytest.raises(ConfigError, match="negative"):
        ns(-1)
    with pytest.raises(ChannelNotFoundError):
        messenger.read_channel("nowhere", start_offset=0)


def test_positions_beyond_64_bits_are_config_errors_or_bounds(messenger: Messenger) -> None:
    # An offset no channel reaches is a ConfigError (an OverflowError before);
    # a time beyond the engine's 64-bit nanoseconds is before/after every record.
    publish(messenger, range(3))
    with pytest.raises(ConfigError, match="beyond any byte offset"):
        messenger.subscribe(CH, "s", lambda _m: None, start=2**70)
    with pytest.raises(ConfigError, match="beyond any byte offset"):
        messenger.read_channel(CH, since=2**63)
    utc = datetime.timezone.utc
    late = messenger.read_channel(CH, since=datetime.datetime(9999, 1, 1, tzinfo=utc))
    assert list(late) == []
    early = messenger.read_channel(CH, since=datetime.datetime(1, 1, 1, tzinfo=utc))
    assert [e.message.payload["n"] for e in early] == [0, 1, 2]


def test_async_subscribe_start_and_seek(tmp_path: Path) -> None:
    async def main() -> list[int]:
        seen: list[int] = []

        async def handler(msg: Message) -> None:
            seen.append(msg.payload["n"])

        async with AsyncMessenger(make_config(tmp_path)) as am:
            for n in range(3):
                await am.publish(CH, "t.N", {"n": n})
            sub = await am.subscribe(CH, "a", handler, start="earliest")
            deadline = time.monotonic() + WAIT_S
            while len(seen) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await sub.seek("earliest")
            while len(seen) < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await sub.close()
        return seen

    assert asyncio.run(main()) == [0, 1, 2, 0, 1, 2]


def test_seek_from_the_handler(messenger: Messenger) -> None:
    """A seek made by the handler applies after its call: replaying once."""
    publish(messenger, range(3))
    c = Collector()
    subs: list[Subscription] = []

    def handler(msg: Message) -> None:
        c(msg)
        if msg.payload["n"] == 2 and len(c.seen) == 3:
            subs[0].seek("earliest")

    with messenger.subscribe(CH, "s", handler, start="earliest") as sub:
        subs.append(sub)
        # Publish the barrier only once the replay happened: one published
        # earlier can share the handler's batch and be delivered before the seek.
        assert c.wait_for(6) == [0, 1, 2, 0, 1, 2]
        assert barrier(messenger, c, 100) == [0, 1, 2, 0, 1, 2, 100]
