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
from fed_helpers import PKI, Starter, client_config, hub_config, hub_port, peer, stored_ids
from keyop_messenger import Message

pki = fed_helpers.pki
start = fed_helpers.start


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read())[1])  # type: ignore[index]


def soak(pki: PKI, tmp_path: Path, start: Starter, seconds: float) -> None:
    hub = start(hub_config(pki, tmp_path / "hub", [peer("node1", publish=["soak"])]))
    cfg = client_config(pki, tmp_path / "node", "node1", hub_port(hub), publish=["soak"])
    cfg.storage = replace(cfg.storage, compaction_threshold_mb=1, sync_interval_ms=20)
    node = start(cfg)

    counts = [0, 0, 0]
    hub_count = [0]
    lock = threading.Lock()

    def counter(i: int):
        def handler(_msg: Message) -> None:
            with lock:
                counts[i] += 1

        return handler

    for i in range(3):
        node.subscribe("soak", f"sub{i}", counter(i))

    def on_hub(_msg: Message) -> None:
        with lock:
            hub_count[0] += 1

    hub.subscribe("soak", "dashboard", on_hub)

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
    total = sum(published)
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up:
        with lock:
            if counts == [total] * 3 and hub_count[0] == total:
                break
        time.sleep(0.1)
    assert counts == [total] * 3, f"subscribers saw {counts} of {total}"
    assert hub_count[0] == total, f"hub saw {hub_count[0]} of {total}"
    hub_ids = stored_ids(tmp_path / "hub", "soak")
    assert len(hub_ids) == len(set(hub_ids)) == total
    segments = list((tmp_path / "node" / "channels" / "soak").glob("*.jsonl"))
    assert node.stats().channels[0].stream_bytes > 1 << 20, "segments rolled"
    assert len(segments) >= 1
    # Flat memory: after the first third (warm-up), growth stays small.
    warm = samples[len(samples) // 3 :]
    assert max(warm) - min(warm) < 40 * 1024, f"RSS samples (kB): {samples}"


def test_soak_short(pki: PKI, tmp_path: Path, start: Starter) -> None:
    soak(pki, tmp_path, start, 6.0)


@pytest.mark.slow
def test_soak_three_minutes(pki: PKI, tmp_path: Path, start: Starter) -> None:
    soak(pki, tmp_path, start, 180.0)

