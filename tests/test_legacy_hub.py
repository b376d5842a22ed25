"""What this library's clients send to a 1.4 hub (tests/legacy_hub.py).

A 1.4 hub writes and fsyncs each received record in its read loop and answers
no ping meanwhile (docs/compatibility.md): a client keeps its batches to such
a hub to 256 records, and sends a hub of this implementation (which announces
``features``) as many as fit ``max_batch_bytes``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import fed_helpers
from fed_helpers import PKI, client_config, wait_until
from keyop_messenger import EphemeralMessenger, Messenger
from legacy_hub import LegacyHub

pki = fed_helpers.pki

HUBS = pytest.mark.parametrize("features", [(), ("refusals",)], ids=["1.4-hub", "our-hub"])


@HUBS
def test_a_durable_client_sends_a_1_4_hub_at_most_256_records_a_batch(
    pki: PKI, tmp_path: Path, features: tuple[str, ...]
) -> None:
    with LegacyHub(pki, features=features) as hub:
        cfg = client_config(pki, tmp_path / "node1", "node1", hub.port, publish=["temps"])
        with Messenger(cfg) as m:
            # Committed before the hub takes the connection: the client's
            # backlog is all 600 when it first sends.
            m.publish_batch("temps", [("t", {"n": i}) for i in range(600)])
            hub.start()
            wait_until(lambda: hub.records() == 600, "600 records at the hub")
        assert hub.hellos[0].get("features") == ["refusals"]
        assert hub.batch_sizes() == ([256, 256, 88] if not features else [600])


@HUBS
def test_an_ephemeral_client_sends_a_1_4_hub_at_most_256_records_a_frame(
    pki: PKI, tmp_path: Path, features: tuple[str, ...]
) -> None:
    """Publishes queued while the hub stores a frame go out together in the
    next one: up to 256 records for a 1.4 hub, all of them for ours."""
    with LegacyHub(pki, features=features, first_ack_delay=1.5) as hub:
        cfg = client_config(pki, tmp_path / "node1", "node1", hub.port, publish=["temps"])
        hub.start()
        with EphemeralMessenger(cfg) as e:
            e.connect()
            errors: list[BaseException] = []

            def publish(n: int) -> None:
                try:
                    e.publish_batch("temps", [("t", {"n": n, "i": i}) for i in range(100)])
                except BaseException as exc:  # reported below
                    errors.append(exc)

            first = threading.Thread(target=publish, args=(0,))
            first.start()
            wait_until(lambda: hub.records() == 100, "the first frame at the hub")
            rest = [threading.Thread(target=publish, args=(n,)) for n in range(1, 6)]
            for t in rest:
                t.start()
            for t in [first, *rest]:
                t.join(timeout=30)
            assert errors == []
        assert hub.hellos[0]["ephemeral"] is True
        sizes = hub.batch_sizes()
    assert sum(sizes) == 600
    assert sizes[0] == 100
    if features:
        assert sizes == [100, 500], "queued publishes share one frame"
    else:
        assert max(sizes) <= 256 and len(sizes) >= 4, sizes
        assert max(sizes) == 200, "queued publishes still share frames"
