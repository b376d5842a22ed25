"""Publish benchmark: durable, group-commit, batch and relaxed publish, each
next to a raw write+fdatasync probe measured in the same run.

    python benches/publish.py [--dir DIR] [--seconds S]

Prints a table of rates and the ratios the project targets:
durable 1 thread >= 0.85 x raw fdatasync rate; 16 threads >= 10 x 1 thread;
relaxed publish >= 250,000 msg/s. Figures depend on the disk: run it on the
machine you care about. This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import keyop_messenger as km

PAYLOAD = {"sensor": "t-17", "celsius": 21.5, "seq": 0, "ok": True}


def timed(seconds: float, step: Callable[[], int]) -> float:
    """Runs ``step`` (which returns messages done) until ``seconds`` pass; msgs/s."""
    done = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        done += step()
    return done / (time.perf_counter() - start)


def raw_fdatasync(path: str, seconds: float) -> float:
    record = b"x" * 199 + b"\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:

        def step() -> int:
            os.write(fd, record)
            os.fdatasync(fd)
            return 1

        return timed(seconds, step)
    finally:
        os.close(fd)


def messenger(root: str, name: str, sync_interval_ms: int) -> km.Messenger:
    cfg = km.Config.from_dict(
        {
            "name": "bench",
            "storage": {"data_dir": os.path.join(root, name), "sync_interval_ms": sync_interval_ms},
        }
    )
    return km.Messenger(cfg)


def threaded(m: km.Messenger, threads: int, seconds: float) -> float:
    counts = [0] * threads
    stop = time.perf_counter() + seconds

    def worker(i: int) -> None:
        n = 0
        while time.perf_counter() < stop:
            m.publish("bench", "bench.Reading", PAYLOAD)
            n += 1
        counts[i] = n

    start = time.perf_counter()
    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--seconds", type=float, default=2.0, help="duration of each measurement")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="keyop-bench-", dir=args.dir)
    s = args.seconds
    rows: list[tuple[str, float, str]] = []
    try:
        raw = raw_fdatasync(os.path.join(root, "raw.probe"), s)
        rows.append(("raw write+fdatasync, 200 B", raw, "1.00 x raw"))

        with messenger(root, "durable", 0) as m:
            one = timed(s, lambda: (m.publish("bench", "bench.Reading", PAYLOAD), 1)[1])
            rows.append(("durable publish, 1 thread", one, f"{one / raw:.2f} x raw (>= 0.85)"))
            many = threaded(m, 16, s)
            rows.append(
                ("durable publish, 16 threads", many, f"{many / one:.1f} x 1 thread (>= 10)")
            )
            batch = [("bench.Reading", PAYLOAD)] * 1000
            b = timed(s, lambda: len(m.publish_batch("bench", batch)))
            rows.append(("durable publish_batch of 1000", b, f"{b / raw:.0f} x raw"))

        with messenger(root, "relaxed", 100) as m:
            r = timed(s, lambda: (m.publish("bench", "bench.Reading", PAYLOAD), 1)[1])
            rows.append(("relaxed publish (sync 100 ms)", r, "target >= 250,000 msg/s"))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"{'case':<34} {'msg/s':>12}  ratio")
    print("-" * 72)
    for name, rate, ratio in rows:
        print(f"{name:<34} {rate:>12,.0f}  {ratio}")


if __name__ == "__main__":
    main()
