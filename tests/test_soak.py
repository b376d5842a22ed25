"""Soak test (issue 7, part 7): 4 publishing threads, 3 local subscribers and a
federated client forwarding to a hub, with segments rolling and retention
running, for a bounded time. Memory must stay flat and every message must be
accounted for: each subscriber and the hub see every published id exactly once.

The default suite runs it for a few seconds; ``pytest -m slow`` runs the
three-minute version.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

import fed_helpers
from fed_helpers import PKI, Starter, client_config, hub_config, hub_port, peer
from keyop_messenger import Message

pki = fed_helpers.pki
start = fed_helpers.start


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read())[1])  # type: ignore[index]


def soak(pki: PKI, tmp_path: Path, start: Starter, seconds: float) -> None:
    hub = start(hub_config(pki, tmp_path / "hub", [peer("node1", publish=["soak"])]))
    cfg = client_config(pki, tmp_path / "node", "node1", hub_port(hub), publish=["soak"])
    cfg.storage = replace(cfg.storage, segment_size_mb=1, sync_interval_ms=20)
    node = start(cfg)

    # Each publisher's messages arrive in its own order everywhere, so
    # "exactly once" is checked with O(1) memory: the next expected sequence
    # number per (receiver, publisher), and a count of anything else.
    receivers = ["sub0", "sub1", "sub2", "hub"]
    expected = {r: [0] * 4 for r in receivers}
    anomalies: list[str] = []
    lock = threading.Lock()

    def counter(receiver: str):
        def handler(msg: Message) -> None:
            p, i = msg.payload["p"], msg.payload["i"]
            with lock:
                if i == expected[receiver][p]:
                    expected[receiver][p] += 1
                elif len(anomalies) < 10:
                    anomalies.append(f"{receiver}: publisher {p} sent {i}, expected "
                                     f"{expected[receiver][p]}")

        return handler

    for i in range(3):
        node.subscribe("soak", f"sub{i}", counter(f"sub{i}"))
    hub.subscribe("soak", "dashboard", counter("hub"))

    published = [0] * 4
    stop = threading.Event()

    def publisher(n: int) -> None:
        pad = "x" * 200
        while not stop.is_set():
            node.publish("soak", "t", {"p": n, "i": published[n], "pad": pad})
            published[n] += 1

    threads = [threading.Thread(target=publisher, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    samples: list[int] = []
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(min(1.0, seconds / 6))
            node.compact()
            samples.append(rss_kb())
    finally:
        stop.set()
        for t in threads:
            t.join()
    give_up = time.monotonic() + 120
    while time.monotonic() < give_up:
        with lock:
            if all(expected[r] == published for r in receivers) or anomalies:
                break
        time.sleep(0.1)
    assert not anomalies, anomalies
    assert all(expected[r] == published for r in receivers), (published, expected)
    assert node.stats().channels[0].stream_bytes > 1 << 20, "segments rolled"
    # Flat memory: after the first third (warm-up), growth stays small.
    warm = samples[len(samples) // 3 :]
    assert max(warm) - min(warm) < 40 * 1024, f"RSS samples (kB): {samples}"


def test_soak_short(pki: PKI, tmp_path: Path, start: Starter) -> None:
    soak(pki, tmp_path, start, 6.0)


@pytest.mark.slow
def test_soak_three_minutes(pki: PKI, tmp_path: Path, start: Starter) -> None:
    soak(pki, tmp_path, start, 180.0)

