"""The measurement helpers of ``keyop-messenger bench`` (the whole suite runs
with ``-m slow``)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from keyop_messenger import bench
from keyop_messenger.bench import Sample


def test_cpu_time_counts_every_thread() -> None:
    def spin() -> None:
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass

    clock = bench._Stopwatch()
    worker = threading.Thread(target=spin)
    worker.start()
    worker.join()  # the measuring thread sleeps meanwhile
    sample = clock.sample(1000)
    # 0.2 s of CPU spent by the other thread, over 1000 messages.
    assert sample.cpu_us >= 200
    assert sample.per_s > 0


def test_median_is_taken_per_field() -> None:
    runs = iter([Sample(10.0, 3.0), Sample(30.0, 1.0), Sample(20.0, 2.0)])
    assert bench._median(3, lambda: next(runs)) == Sample(20.0, 2.0)


@pytest.mark.slow
def test_quick_bench_prints_every_figure() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "keyop_messenger.bench", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    for key in (
        "publish_relaxed_per_s",
        "cpu_us_per_publish_relaxed",
        "cpu_us_per_publish_durable",
        "cpu_us_per_delivery",
    ):
        assert results[key] > 0, key
