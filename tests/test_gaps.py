"""Data that is gone is reported, never skipped in silence.

When a reader's position points into bytes that no longer exist (deleted by
retention, a removed or truncated segment), a subscriber gets ``on_gap`` with
the byte range, a WARNING is logged and ``Stats.data_loss`` counts it; the read
paths raise ``DataLossError`` naming the range unless ``skip_gaps=True``.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import make_config
from keyop_messenger import DataLossError, Message, Messenger, read_channel

CH = "readings"
BLOB = "x" * 10_000
WAIT_S = 15.0


def segments(data_dir: Path, channel: str = CH) -> list[int]:
    return sorted(int(p.stem) for p in (data_dir / "channels" / channel).glob("*.jsonl"))


def segment_path(data_dir: Path, start: int, channel: str = CH) -> Path:
    return data_dir / "channels" / channel / f"{start:020}.jsonl"


def fill(m: Messenger, n: int = 300) -> list[str]:
    """About 3 MiB: three or more 1 MiB segments."""
    ids: list[str] = []
    for k in range(0, n, 25):
        ids += m.publish_batch(CH, [("t", {"n": k + i, "b": BLOB}) for i in range(25)])
    return ids


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A data directory whose channel has at least three segments."""
    config = make_config(tmp_path, segment_size_mb=1)
    with Messenger(config) as m:
        fill(m)
    data_dir = Path(config.storage.data_dir)
    assert len(segments(data_dir)) >= 3
    return data_dir


def test_read_channel_raises_on_a_removed_segment_and_names_the_range(data: Path) -> None:
    segs = segments(data)
    segment_path(data, segs[1]).unlink()
    it = read_channel(data, CH)
    before: list[Any] = []
    with pytest.raises(DataLossError) as err:
        for entry in it:
            before.append(entry.message.payload["n"])
    assert f"bytes {segs[1]}..{segs[2]} are gone" in str(err.value)
    assert CH in str(err.value)
    assert before == list(range(len(before))) and before
    # Asked to, it goes on past the gap.
    after = [e.message.payload["n"] for e in read_channel(data, CH, skip_gaps=True)]
    assert after[: len(before)] == before
    assert after[-1] == 299
    assert len(after) < 300


def test_messenger_read_channel_raises_below_the_first_segment(data: Path, tmp_path: Path) -> None:
    segs = segments(data)
    segment_path(data, segs[0]).unlink()
    with Messenger(make_config(tmp_path, segment_size_mb=1)) as m:
        with pytest.raises(DataLossError, match=f"bytes 10..{segs[1]} are gone"):
            list(m.read_channel(CH, start_offset=10))
        # Offset 0 means "the oldest record kept": retention trimming history
        # is not an error there.
        kept = [e.offset for e in m.read_channel(CH)]
        assert kept[0] == segs[1]
        assert [e.offset for e in m.read_channel(CH, start_offset=10, skip_gaps=True)] == kept


def test_subscriber_gets_on_gap_a_warning_and_a_counter(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(tmp_path, segment_size_mb=1)
    data_dir = Path(config.storage.data_dir)
    with Messenger(config) as m:
        m.subscribe(CH, "slow", lambda msg: None).close()  # registered at offset 0
        ids = fill(m)
    segs = segments(data_dir)
    for start in segs[:2]:
        segment_path(data_dir, start).unlink()

    gaps: list[tuple[str, str, int, int]] = []
    got: list[Message] = []
    done = threading.Event()

    def handler(msg: Message) -> None:
        got.append(msg)
        if msg.id == ids[-1]:
            done.set()

    with caplog.at_level(logging.WARNING), Messenger(config) as m:
        before = m.stats().data_loss
        m.subscribe(CH, "slow", handler, on_gap=lambda *a: gaps.append(a))
        assert done.wait(WAIT_S)
        after = m.stats().data_loss
    assert gaps == [(CH, "slow", 0, segs[2])]
    assert got[0].id == ids[len(ids) - len(got)]
    assert after.gaps == before.gaps + 1
    assert after.gap_bytes == before.gap_bytes + segs[2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"bytes 0..{segs[2]} are gone" in w and CH in w for w in warnings), warnings


def test_a_truncated_sealed_segment_is_a_gap_for_subscribers(tmp_path: Path) -> None:
    config = make_config(tmp_path, segment_size_mb=1)
    data_dir = Path(config.storage.data_dir)
    with Messenger(config) as m:
        m.subscribe(CH, "s", lambda msg: None).close()
        ids = fill(m)
    segs = segments(data_dir)
    first = segment_path(data_dir, segs[0])
    lines = first.read_bytes().splitlines(keepends=True)
    kept = sum(len(line) for line in lines[:10])
    with first.open("r+b") as f:
        f.truncate(kept)

    gaps: list[tuple[str, str, int, int]] = []
    got: list[str] = []
    with Messenger(config) as m:
        m.subscribe(CH, "s", lambda msg: got.append(msg.id), on_gap=lambda *a: gaps.append(a))
        deadline = time.monotonic() + WAIT_S
        while (not got or got[-1] != ids[-1]) and time.monotonic() < deadline:
            time.sleep(0.02)
    assert gaps == [(CH, "s", kept, segs[1])]
    assert got[:10] == ids[:10]
    assert got[-1] == ids[-1]


def test_async_subscriber_gets_on_gap(tmp_path: Path) -> None:
    import asyncio

    from keyop_messenger.aio import AsyncMessenger

    config = make_config(tmp_path, segment_size_mb=1)
    data_dir = Path(config.storage.data_dir)
    with Messenger(config) as m:
        m.subscribe(CH, "slow", lambda msg: None).close()
        ids = fill(m)
    segs = segments(data_dir)
    segment_path(data_dir, segs[0]).unlink()
    gaps: list[tuple[str, str, int, int]] = []

    async def main() -> None:
        last = asyncio.Event()

        async def handler(msg: Message) -> None:
            if msg.id == ids[-1]:
                last.set()

        async with AsyncMessenger(config) as am:
            await am.subscribe(CH, "slow", handler, on_gap=lambda *a: gaps.append(a))
            await asyncio.wait_for(last.wait(), WAIT_S)

    asyncio.run(main())
    assert gaps == [(CH, "slow", 0, segs[1])]


def test_spark_planning_reports_bytes_gone_before_the_first_segment(data: Path) -> None:
    import keyop_messenger.spark as ks

    segs = segments(data)
    end = ks.stream_end(str(data), CH)
    segment_path(data, segs[0]).unlink()
    # A streaming query that had read up to offset 10 would skip the rest silently.
    with pytest.raises(DataLossError, match=f"bytes 10..{segs[1]} are gone"):
        ks.plan_partitions(str(data), CH, 10, end)
    # Offset 0 (a batch read, a query from the start) means the oldest kept.
    assert ks.plan_partitions(str(data), CH, 0, end)[0].start == segs[1]


def test_data_loss_is_exported_as_prometheus_counters(data: Path, tmp_path: Path) -> None:
    from keyop_messenger.metrics import render

    segs = segments(data)
    segment_path(data, segs[1]).unlink()
    with Messenger(make_config(tmp_path, segment_size_mb=1)) as m:
        before = m.stats().data_loss
        assert len(list(m.read_channel(CH, skip_gaps=True))) < 300
        text = render(m.stats())
    gaps = before.gaps + 1
    lost = before.gap_bytes + segs[2] - segs[1]
    assert "# TYPE keyop_data_loss_total counter" in text
    assert f'keyop_data_loss_total{{kind="gap"}} {gaps}' in text.splitlines()
    assert f'keyop_data_loss_total{{kind="quarantined"}} {before.quarantined}' in text
    assert f"keyop_data_loss_bytes_total {lost}" in text.splitlines()
