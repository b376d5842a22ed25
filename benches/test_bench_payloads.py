"""Typed payloads: a dataclass and a pydantic model, encoded on publish and
decoded on delivery."""

from __future__ import annotations

from typing import Any

import pytest

from bench_common import CHANNEL, PAYLOAD, Reading, ReadingModel
from keyop_messenger import Messenger
from keyop_messenger.payloads import PayloadRegistry, to_plain

KINDS = {"dataclass": Reading, "pydantic": ReadingModel}


@pytest.fixture(params=sorted(KINDS))
def payload_class(request: pytest.FixtureRequest) -> type:
    return KINDS[request.param]


def test_to_plain(benchmark: Any, payload_class: type) -> None:
    """The Python side of encoding: the object as JSON-ready data (the engine's
    encoder calls this for values that are not plain JSON)."""
    value = payload_class(**PAYLOAD)
    assert benchmark(to_plain, value) == PAYLOAD


def test_publish_typed_relaxed(benchmark: Any, relaxed: Messenger, payload_class: type) -> None:
    """Publishing a registered type: type check, encoding, envelope, relaxed write."""
    relaxed.register_payload_type("bench.Typed", payload_class)
    benchmark(relaxed.publish, CHANNEL, "bench.Typed", payload_class(**PAYLOAD))


def test_decode(benchmark: Any, payload_class: type) -> None:
    """Delivery's side: decoded JSON data into the registered type."""
    registry = PayloadRegistry()
    registry.register("bench.Typed", payload_class)
    assert benchmark(registry.decode, "bench.Typed", dict(PAYLOAD)) == payload_class(**PAYLOAD)
