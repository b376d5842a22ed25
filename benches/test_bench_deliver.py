"""Delivery into a no-op handler, timed per batch: the Python side alone (a
batch of rows as the engine hands it over), and end to end from disk."""

from __future__ import annotations

import threading
from typing import Any

from bench_common import CHANNEL, PAYLOAD, TYPE
from keyop_messenger import Message, Messenger
from keyop_messenger.bench import _deliver_backlog
from keyop_messenger.subscription import Deliverer

#: A full delivery batch (the engine hands over up to 512 records at a time).
BATCH = 512


def _noop(_message: Message) -> None:
    pass


def _engine_rows(m: Messenger, n: int) -> list[tuple[Any, ...]]:
    """``n`` delivery rows exactly as the engine passes them to Python."""
    rows: list[tuple[Any, ...]] = []
    done = threading.Event()

    def capture(batch: list[tuple[Any, ...]]) -> tuple[int, None]:
        rows.extend(batch)
        if len(rows) >= n:
            done.set()
        return len(batch), None

    sub = m._engine.subscribe(CHANNEL, "capture", capture)
    try:
        m.publish_batch(CHANNEL, [(TYPE, PAYLOAD)] * n)
        assert done.wait(30), f"{len(rows)} of {n} rows delivered"
    finally:
        sub.close()
    return rows[:n]


def _per_message(benchmark: Any, messages: int) -> None:
    benchmark.extra_info["messages_per_call"] = messages
    if benchmark.stats is not None:
        median = benchmark.stats.stats.median
        benchmark.extra_info["median_us_per_message"] = round(median / messages * 1e6, 3)


def test_deliver_batch(benchmark: Any, relaxed: Messenger) -> None:
    """Building a Message per row and calling the handler, for one batch."""
    rows = _engine_rows(relaxed, BATCH)
    deliver = Deliverer(_noop, relaxed._registry, CHANNEL, "bench")
    assert benchmark(deliver, rows) == (BATCH, None)
    _per_message(benchmark, BATCH)


def test_deliver_backlog(benchmark: Any, relaxed: Messenger) -> None:
    """A subscription delivering 20 stored batches (read, decode, Python)."""
    n = 20 * BATCH
    relaxed.publish_batch(CHANNEL, [(TYPE, PAYLOAD)] * n)
    benchmark.pedantic(_deliver_backlog, args=(relaxed, n), rounds=5, warmup_rounds=1)
    _per_message(benchmark, n)
