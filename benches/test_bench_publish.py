"""Publishing from Python: one message relaxed and durable, and a batch of 100."""

from __future__ import annotations

from typing import Any

from bench_common import CHANNEL, PAYLOAD, TYPE
from keyop_messenger import Messenger


def test_publish_relaxed(benchmark: Any, relaxed: Messenger) -> None:
    benchmark(relaxed.publish, CHANNEL, TYPE, PAYLOAD)


def test_publish_durable(benchmark: Any, durable: Messenger) -> None:
    benchmark(durable.publish, CHANNEL, TYPE, PAYLOAD)


def test_publish_batch_100_durable(benchmark: Any, durable: Messenger) -> None:
    items = [(TYPE, PAYLOAD)] * 100
    benchmark.extra_info["messages_per_call"] = len(items)
    ids = benchmark(durable.publish_batch, CHANNEL, items)
    assert len(ids) == len(items)
