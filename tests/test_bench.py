"""The measurement helpers of ``keyop-messenger bench``: CPU time per message
and the one-core comparison (the whole suite runs with ``-m slow``)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from keyop_messenger import bench
from keyop_messenger.bench import Sample, Suite


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


def test_each_run_of_a_figure_deletes_its_data_directories(tmp_path: Path) -> None:
    """A case's data does not outlive its run: the page cache stays as small
    as one case needs (see Suite.sweep)."""
    suite = Suite(tmp_path, 0.05, 3)
    seen: list[Path] = []

    def case() -> Sample:
        with suite.messenger(200) as m:
            m.publish("bench", bench.TYPE, bench.PAYLOAD)
            data = Path(m.config.storage.data_dir)
            assert any(data.rglob("*.jsonl"))
        seen.append(data)
        assert data.exists()  # closed, not yet swept
        return Sample(1.0, 1.0)

    assert suite.median(case) == Sample(1.0, 1.0)
    assert len(seen) == 3 and len(set(seen)) == 3
    assert not [d for d in seen if d.exists()]
    assert list(tmp_path.iterdir()) == []


def test_raw_fdatasync_probe_syncs_whole_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 16-record probe writes 16 records per fdatasync and counts fdatasyncs."""
    synced: list[int] = []
    real_fdatasync = bench.os.fdatasync

    def counting_fdatasync(fd: int) -> None:
        synced.append(bench.os.fstat(fd).st_size)
        real_fdatasync(fd)

    monkeypatch.setattr(bench.os, "fdatasync", counting_fdatasync)
    suite = Suite(tmp_path, 0.05, 1)
    sample = suite.raw_fdatasync(16)
    assert synced and synced == [3200 * (i + 1) for i in range(len(synced))]
    assert sample.per_s == pytest.approx(len(synced) / 0.05, rel=0.5)


def test_group_commit_ceiling_takes_the_better_of_its_two_shapes() -> None:
    # A fast disk (125 us per fdatasync) against 8 us hand-offs: two batches of
    # 8 threads, one syncing while the other gathers, beat one batch of 16.
    assert bench.group_commit_ceiling(8000, 8.0, 16) == pytest.approx(64_000)
    # A slow disk (1 ms): one batch of all 16 plus 16 hand-offs per fdatasync.
    assert bench.group_commit_ceiling(1000, 8.0, 16) == pytest.approx(16e6 / 1128)
    # Free hand-offs: 16 records per fdatasync.
    assert bench.group_commit_ceiling(1000, 0.0, 16) == pytest.approx(16_000)
    # A 16-record fdatasync slower than a one-record one (1.2 ms against
    # 1 ms): the batch of all 16 pays that; two batches of 8 would pay at
    # least a one-record fdatasync each.
    assert bench.group_commit_ceiling(1000, 8.0, 16, 1e6 / 1200) == pytest.approx(16e6 / 1328)
    assert bench.group_commit_ceiling(8000, 1.0, 16, 4000) == pytest.approx(64_000)


def test_thread_handoff_probe_ends_its_ring(tmp_path: Path) -> None:
    # Threads left by earlier tests may end meanwhile: look only for new ones.
    before = set(threading.enumerate())
    us = Suite(tmp_path, 0.1, 1).thread_handoff(threads=4, hops=2000)
    assert 0 < us < 1e6
    assert set(threading.enumerate()) - before == set()


def test_thread_handoff_probe_pins_only_its_ring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pinned, the ring's threads run on the one CPU; the caller keeps its own."""
    mask = bench.os.sched_getaffinity(0)
    cpu = min(mask)
    seen: list[set[int]] = []

    class Spy(threading.Thread):
        def run(self) -> None:
            seen.append(bench.os.sched_getaffinity(0))
            super().run()

    monkeypatch.setattr(bench.threading, "Thread", Spy)
    Suite(tmp_path, 0.1, 1).thread_handoff(threads=3, hops=30, cpu=cpu)
    assert seen == [{cpu}] * 3
    assert bench.os.sched_getaffinity(0) == mask


def test_one_core_comparison_says_it_needs_two_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda _pid: {3})
    monkeypatch.setattr(bench, "_run_pinned", lambda *_: pytest.fail("no child on 1 CPU"))
    suite = Suite(tmp_path, 0.1, 1)
    bench.one_core_comparison(suite, quick=True)
    assert suite.results == {"one_core_skipped": "skipped: needs >= 2 CPUs; this process may use 1"}
    assert suite.rows == [("one-core comparison", "-", suite.results["one_core_skipped"])]


def test_one_core_comparison_reports_ratios_and_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda _pid: {5, 2, 7})
    pinned: list[list[int]] = []

    def fake_run_pinned(cpus: list[int], quick: bool) -> dict[str, Sample]:
        pinned.append(cpus)
        per_s = 1000.0 if len(cpus) == 2 else 600.0
        figures = {key: Sample(per_s, 1.0) for key in bench.ONE_CORE_CASES}
        if len(cpus) == 1:
            figures["subscribe_relaxed"] = Sample(400.0, 1.0)
        return figures

    monkeypatch.setattr(bench, "_run_pinned", fake_run_pinned)
    suite = Suite(tmp_path, 0.1, 1)
    bench.one_core_comparison(suite, quick=True)
    assert pinned == [[2, 5], [2]]
    r = suite.results
    assert (r["one_core_cpus"], r["two_core_cpus"]) == ("2", "2,5")
    assert r["one_core_publish_relaxed_per_s"] == 600.0
    assert r["two_core_publish_relaxed_per_s"] == 1000.0
    assert r["one_core_ratio_publish_relaxed"] == 0.6
    assert r["one_core_ratio_subscribe_relaxed"] == 0.4
    assert r["one_core_target_met"] is False
    verdicts = {label: ratio.rsplit(": ", 1)[1] for label, _, ratio in suite.rows}
    assert verdicts["1 core: relaxed publish"] == "met"
    assert verdicts["1 core: subscribe -> no-op handler"] == "MISSED"


@pytest.mark.slow
def test_quick_bench_prints_every_figure() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "keyop_messenger.bench", "--quick", "--json", "--one-core"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    for key in (
        "publish_relaxed_per_s",
        "publish_relaxed_16_per_s",
        "python_gil_loop_16_ratio",
        "raw_json_write_per_s",
        "cpu_us_per_msg_publish_relaxed",
        "cpu_us_per_msg_publish_durable",
        "cpu_us_per_msg_subscribe",
        "cpu_us_per_msg_federated",
        "federated_cpu_ceiling_per_s",
        "rss_idle_client_small_mb",
        "raw_fdatasync_16_records_per_s",
        "publish_durable_16_disk_ceiling_ratio",
        "thread_handoff_16_us",
        "publish_durable_16_handoff_ceiling_ratio",
        "gateway_publish_durable_requests_per_s",
        "gateway_publish_batch_100_durable_per_s",
        "gateway_sse_delivery_per_s",
    ):
        assert results[key] > 0, key
    if "one_core_skipped" not in results:
        for key in bench.ONE_CORE_CASES:
            assert results[f"one_core_ratio_{key}"] > 0, key
        assert isinstance(results["one_core_target_met"], bool)


def test_gil_loop_probe_runs_every_thread(tmp_path: Path) -> None:
    suite = Suite(tmp_path, 0.05, 1)
    one, many = suite.gil_loop(1), suite.gil_loop(4)
    assert one.per_s > 0 and many.per_s > 0
    # Four threads take turns on the GIL: together about as fast as one
    # (never four times), whatever the machine's load.
    assert many.per_s < 3 * one.per_s
    assert 0 < suite.gil_loop_ratio(4) < 3


def test_idle_memory_probes_measure_each_kind(tmp_path: Path) -> None:
    """The footprint probes start a local messenger, a 2-hub client (also with
    the small-board profile) and a hub whose 10 peers really connect, each in
    a child process that ends."""
    rss = bench.rss_idle_mb(tmp_path, peers=10)
    assert set(rss) == {"local", "client", "client-small", "hub"}
    for kind, mb in rss.items():
        assert 0 < mb < 500, f"{kind}: {mb} MB above the interpreter is not a plausible reading"


def test_gateway_figures_are_measured(tmp_path: Path) -> None:
    suite = bench.Suite(tmp_path, 0.2, 1)
    figures = suite.gateway(suite.pki(), 2000)
    assert set(figures) == {"requests_per_s", "batch_100_per_s", "sse_per_s"}
    assert all(v > 0 for v in figures.values()), figures
