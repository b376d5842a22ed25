"""Delivery benchmark: publish -> subscriber callback throughput and latency.

    python benches/deliver.py [--dir DIR] [--messages N]

Measures, in one process: relaxed-mode (sync_interval_ms 100) and durable
publish into a channel with one subscriber whose handler does nothing, and
the publish -> callback latency (p50/p99) of single messages at a gentle
rate. Target on a small x86 box: >= 300,000 msg/s delivered in relaxed mode.
This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time

import keyop_messenger as km

PAYLOAD = {"sensor": "t-17", "celsius": 21.5, "seq": 0, "ok": True}


def messenger(root: str, name: str, sync_interval_ms: int) -> km.Messenger:
    return km.Messenger(
        km.Config.from_dict(
            {
                "name": "bench",
                "storage": {
                    "data_dir": os.path.join(root, name),
                    "sync_interval_ms": sync_interval_ms,
                    "offset_flush_interval_ms": 100,
                },
            }
        )
    )


def throughput(m: km.Messenger, n: int, batch: int) -> tuple[float, float]:
    """Publishes n messages (in publish_batch groups of ``batch``) and waits
    until the subscriber has seen all; returns (publish msg/s, delivered msg/s)."""
    done = threading.Event()
    seen = 0

    def handler(_msg: km.Message) -> None:
        nonlocal seen
        seen += 1
        if seen == n:
            done.set()

    sub = m.subscribe("bench", "noop", handler)
    items = [("bench.Reading", PAYLOAD)] * batch
    start = time.perf_counter()
    for _ in range(n // batch):
        m.publish_batch("bench", items)
    published = time.perf_counter()
    if not done.wait(120):
        raise SystemExit(f"only {seen} of {n} messages delivered within 120 s")
    delivered = time.perf_counter()
    sub.close()
    return n / (published - start), n / (delivered - start)


def latency(m: km.Messenger, samples: int) -> tuple[float, float]:
    """p50 and p99 publish -> callback latency in microseconds."""
    arrived = threading.Event()
    sent_at = 0.0
    lat: list[float] = []

    def handler(_msg: km.Message) -> None:
        lat.append(time.perf_counter() - sent_at)
        arrived.set()

    sub = m.subscribe("latency", "probe", handler)
    for _ in range(samples):
        arrived.clear()
        sent_at = time.perf_counter()
        m.publish("latency", "bench.Reading", PAYLOAD)
        if not arrived.wait(5):
            raise SystemExit("a latency probe was not delivered within 5 s")
    sub.close()
    q = statistics.quantiles(lat, n=100)
    return q[49] * 1e6, q[98] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--messages", type=int, default=300_000)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="keyop-bench-", dir=args.dir)
    rows = []
    try:
        with messenger(root, "relaxed", 100) as m:
            pub, dlv = throughput(m, args.messages, 1000)
            rows.append(("relaxed, publish_batch(1000) -> no-op", pub, dlv))
            p50, p99 = latency(m, 2000)
            rows.append(("relaxed, latency p50 / p99 (us)", p50, p99))
        with messenger(root, "durable", 0) as m:
            pub, dlv = throughput(m, min(args.messages, 100_000), 1000)
            rows.append(("durable, publish_batch(1000) -> no-op", pub, dlv))
            p50, p99 = latency(m, 500)
            rows.append(("durable, latency p50 / p99 (us)", p50, p99))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'case':<40} {'publish/s | p50':>16} {'delivered/s | p99':>18}")
    print("-" * 76)
    for name, a, b in rows:
        print(f"{name:<40} {a:>16,.0f} {b:>18,.0f}")
    print("target: relaxed delivered >= 300,000 msg/s")


if __name__ == "__main__":
    main()
