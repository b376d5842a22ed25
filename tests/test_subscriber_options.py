"""Per-subscriber options of ``Messenger.subscribe`` (client API issue,
item 4): ``max_retries``, ``backoff=(initial_s, max_s)``, ``dead_letter``,
the :class:`DeadLetter` signal a handler raises, and the dead letter's
fields beyond 1.4 (``reason``, ``attempts``, ``channel``, ``offset``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import keyop_messenger as km
from keyop_messenger import Config, ConfigError, DeadLetter, KeyopError, Message, Messenger

WAIT_S = 15.0


@pytest.fixture
def messenger(tmp_path: Path) -> Iterator[Messenger]:
    cfg = {"name": "n1", "storage": {"data_dir": str(tmp_path)}, "subscribers": {"max_retries": 5}}
    with Messenger(Config.from_dict(cfg)) as m:
        yield m


def wait_until(predicate: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


class Recorder:
    """A handler failing with ``fail(message)`` (None: acknowledge)."""

    def __init__(self, fail: Callable[[Message], BaseException | None]) -> None:
        self.calls: list[tuple[str, float]] = []
        self._fail = fail
        self._lock = threading.Lock()

    def __call__(self, message: Message) -> None:
        with self._lock:
            self.calls.append((message.payload["n"], time.monotonic()))
        exc = self._fail(message)
        if exc is not None:
            raise exc

    def count(self, n: int) -> int:
        with self._lock:
            return sum(1 for m, _ in self.calls if m == n)


def dead_letters(m: Messenger, channel: str) -> list[dict[str, Any]]:
    try:
        return [e.message.payload for e in m.read_channel(f"{channel}.dead-letter")]
    except km.ChannelNotFoundError:
        return []


def test_dead_letter_signal_dead_letters_at_once_with_its_reason(messenger: Messenger) -> None:
    assert not issubclass(DeadLetter, KeyopError)
    handler = Recorder(lambda msg: DeadLetter("bad order") if msg.payload["n"] == 0 else None)
    messenger.subscribe("orders", "billing", handler)
    first = messenger.publish("orders", "t", {"n": 0})
    messenger.publish("orders", "t", {"n": 1})
    wait_until(lambda: handler.count(1) == 1, "the next message delivered")
    assert handler.count(0) == 1, "DeadLetter is not retried"
    (letter,) = wait_until(lambda: dead_letters(messenger, "orders"), "the dead letter")
    (entry,) = [e for e in messenger.read_channel("orders") if e.message.id == first]
    assert letter["original"]["id"] == first
    assert (letter["last_error"], letter["reason"]) == ("bad order", "rejected")
    assert (letter["retries"], letter["attempts"]) == (0, 1)
    assert (letter["channel"], letter["offset"]) == ("orders", entry.offset)
    assert "failed_at" in letter


@pytest.mark.parametrize(
    "exc_type", [RuntimeError, SystemExit, KeyboardInterrupt, GeneratorExit, BaseException]
)
def test_a_failure_in_a_batch_redelivers_only_the_failed_message(
    messenger: Messenger, exc_type: type[BaseException]
) -> None:
    """Whatever the handler raises, even a BaseException that is not an
    Exception, the messages of the batch handled before it stay handled."""
    failed: set[int] = set()

    def fail(msg: Message) -> BaseException | None:
        n = msg.payload["n"]
        if n % 10 == 5 and n not in failed:
            failed.add(n)
            return exc_type("once")
        return None

    messenger.publish_batch("orders", [("t", {"n": i}) for i in range(30)])
    handler = Recorder(fail)
    sub = messenger.subscribe(
        "orders", "billing", handler, start="earliest", backoff=(0.01, 0.01)
    )
    wait_until(lambda: sub.position == messenger.stream_end("orders"), "all handled")
    wait_until(lambda: len(handler.calls) >= 33, "33 calls")
    assert [n for n, _ in handler.calls] == [
        *range(6), *range(5, 16), *range(15, 26), *range(25, 30)
    ]
    assert dead_letters(messenger, "orders") == []


def test_max_retries_and_backoff_override_the_config(messenger: Messenger) -> None:
    handler = Recorder(lambda msg: RuntimeError("down") if msg.payload["n"] == 0 else None)
    messenger.subscribe("orders", "billing", handler, max_retries=2, backoff=(0.2, 0.3))
    messenger.publish("orders", "t", {"n": 0})
    messenger.publish("orders", "t", {"n": 1})
    wait_until(lambda: handler.count(1) == 1, "the next message delivered")
    assert handler.count(0) == 3, "the first call and two retries, not the config's five"
    (letter,) = dead_letters(messenger, "orders")
    assert (letter["retries"], letter["attempts"], letter["reason"]) == (2, 3, "retries_exhausted")
    assert letter["last_error"] == "RuntimeError: down"
    times = [t for n, t in handler.calls if n == 0]
    # Waits of at least 0.2 s then 0.3 s (the doubling capped at max_s) between calls.
    assert times[1] - times[0] >= 0.19 and times[2] - times[1] >= 0.29


def test_dead_letter_false_skips_without_a_dead_letter(messenger: Messenger) -> None:
    handler = Recorder(lambda msg: RuntimeError("down") if msg.payload["n"] == 0 else None)
    messenger.subscribe(
        "orders", "billing", handler, max_retries=0, backoff=(0.01, 0.01), dead_letter=False
    )
    messenger.publish("orders", "t", {"n": 0})
    messenger.publish("orders", "t", {"n": 1})
    wait_until(lambda: handler.count(1) == 1, "the next message delivered")
    assert handler.count(0) == 1
    assert dead_letters(messenger, "orders") == []


@pytest.mark.parametrize(
    "options", [{"max_retries": -1}, {"backoff": (1.0, 0.5)}, {"backoff": (-1.0, 1.0)}]
)
def test_bad_options_are_refused(messenger: Messenger, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="backoff"):
        messenger.subscribe("orders", "billing", lambda _m: None, **options)


def test_replay_keeps_the_original_id_origin_and_timestamp(tmp_path: Path) -> None:
    config = {"name": "n1", "storage": {"data_dir": str(tmp_path / "d")}}
    cfg_file = tmp_path / "km.yaml"
    cfg_file.write_text(json.dumps(config))  # JSON is YAML
    with Messenger(Config.from_dict(config)) as m:
        m.subscribe("orders", "billing", Recorder(lambda _msg: DeadLetter("no")))
        first = m.publish("orders", "t.Order", {"n": 0}, correlation_id="c1")
        wait_until(lambda: dead_letters(m, "orders"), "the dead letter")
        (original,) = [e.message for e in m.read_channel("orders")]
    assert original.id == first
    done = subprocess.run(
        [sys.executable, "-m", "keyop_messenger.cli", "dead-letters", "replay", "--config",
         str(cfg_file), "orders"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["new_id"] == first
    with Messenger(Config.from_dict(config)) as m:
        stored = [e.message for e in m.read_channel("orders")]
    assert len(stored) == 2
    replayed = stored[1]
    assert (replayed.id, replayed.origin, replayed.timestamp) == (
        original.id, original.origin, original.timestamp,
    )  # fmt: skip
    assert (replayed.payload, replayed.correlation_id) == ({"n": 0}, "c1")


def replay(cfg_file: Path, channel: str) -> list[dict[str, Any]]:
    """Runs ``dead-letters replay``; its JSON lines."""
    done = subprocess.run(
        [sys.executable, "-m", "keyop_messenger.cli", "dead-letters", "replay", "--config",
         str(cfg_file), channel],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def segment_lines(data_dir: Path, channel: str) -> list[bytes]:
    return [
        line
        for seg in sorted((data_dir / "channels" / channel).glob("*.jsonl"))
        for line in seg.read_bytes().splitlines()
    ]


def test_replay_appends_the_original_byte_for_byte(tmp_path: Path) -> None:
    # A 1.4 record with a field this version does not know and a number as
    # written (1.50): replay appends the very bytes, not a re-encoding.
    data_dir = tmp_path / "d"
    line = (
        b'{"v":1,"id":"01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f","ts":"2026-03-31T14:22:01.1234567Z",'
        b'"channel":"orders","origin":"go-host","payload_type":"t.Order",'
        b'"payload":{"price":1.50,"n":0},"x_future":{"k":[1,2]}}'
    )
    (data_dir / "channels" / "orders").mkdir(parents=True)
    (data_dir / "channels" / "orders" / f"{0:020d}.jsonl").write_bytes(line + b"\n")
    config = {"name": "n1", "storage": {"data_dir": str(data_dir)}}
    cfg_file = tmp_path / "km.yaml"
    cfg_file.write_text(json.dumps(config))  # JSON is YAML
    with Messenger(Config.from_dict(config)) as m:
        m.subscribe("orders", "billing", Recorder(lambda _msg: DeadLetter("no")), start="earliest")
        wait_until(lambda: dead_letters(m, "orders"), "the dead letter")
    (done,) = replay(cfg_file, "orders")
    assert done["new_id"] == "01970a3c-5e21-7b4f-8c2d-4a1b2c3d4e5f"
    assert segment_lines(data_dir, "orders") == [line, line]


def test_a_dead_letter_too_large_to_embed_its_original_names_a_whole_copy(
    tmp_path: Path,
) -> None:
    # A record near the 10 MiB limit fits no dead letter around it: the dead
    # letter (within the limit, readable) names a whole copy, which replay
    # appends. A long error message is cut.
    data_dir = tmp_path / "d"
    config = {"name": "n1", "storage": {"data_dir": str(data_dir)}}
    cfg_file = tmp_path / "km.yaml"
    cfg_file.write_text(json.dumps(config))  # JSON is YAML
    big = "x" * (10 * 1024 * 1024 - 1024)
    with Messenger(Config.from_dict(config)) as m:
        m.subscribe("orders", "billing", Recorder(lambda _msg: DeadLetter("e" * 100_000)))
        first = m.publish("orders", "t", {"n": 0, "big": big})
        (letter,) = wait_until(lambda: dead_letters(m, "orders"), "the dead letter")
    (original,) = segment_lines(data_dir, "orders")
    assert letter["original"] is None
    assert letter["original_id"] == first
    assert letter["original_bytes"] == len(original)
    assert (data_dir / letter["quarantine_file"]).read_bytes() == original + b"\n"
    assert letter["last_error"].startswith("e" * 16_000)
    assert letter["last_error"].endswith(f"... ({100_000 - 16 * 1024} more bytes)")
    assert (letter["reason"], letter["offset"]) == ("rejected", 0)
    (done,) = replay(cfg_file, "orders")
    assert (done["original_id"], done["new_id"]) == (first, first)
    assert segment_lines(data_dir, "orders") == [original, original]


def test_async_subscriber_options_and_dead_letter_signal(tmp_path: Path) -> None:
    from keyop_messenger.aio import AsyncMessenger

    config = {"name": "n1", "storage": {"data_dir": str(tmp_path)}}
    seen: list[int] = []

    async def handler(msg: Message) -> None:
        seen.append(msg.payload["n"])
        if msg.payload["n"] == 0:
            raise DeadLetter("async says no")

    async def main() -> list[dict[str, Any]]:
        async with AsyncMessenger(Config.from_dict(config)) as m:
            await m.subscribe("orders", "billing", handler, max_retries=3, backoff=(0.01, 0.01))
            await m.publish("orders", "t", {"n": 0})
            await m.publish("orders", "t", {"n": 1})
            for _ in range(int(WAIT_S / 0.02)):
                if 1 in seen:
                    break
                await asyncio.sleep(0.02)
            return dead_letters(m.messenger, "orders")

    letters = asyncio.run(main())
    assert seen == [0, 1], "DeadLetter is not retried"
    assert [(d["last_error"], d["attempts"]) for d in letters] == [("async says no", 1)]
