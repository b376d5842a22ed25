"""Retention never deletes unread data by accident.

A channel nobody subscribed to keeps its data (keyop-messenger 1.4 deleted
every sealed segment of it on the next pass). Data goes only by a rule the
user set: consumed by every subscriber and federation cursor of the channel,
or the ``retention`` section's ``max_age`` / ``max_bytes`` (off by default,
global with per-channel entries). The segment size is ``storage.segment_size_mb``;
the 1.4 key ``compaction_threshold_mb`` still works, with a deprecation warning.
"""

from __future__ import annotations

import datetime
import itertools
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from keyop_messenger import Config, ConfigError, Messenger, read_channel

MIB = 1024 * 1024
CH = "sensor"
BLOB = "x" * 10_000
WAIT_S = 15.0


def cfg(tmp_path: Path, retention: dict[str, Any] | None = None, **storage: Any) -> Config:
    doc: dict[str, Any] = {
        "name": "node",
        "storage": {"data_dir": str(tmp_path / "data"), "segment_size_mb": 1, **storage},
    }
    if retention is not None:
        doc["retention"] = retention
    return Config.from_dict(doc)


def fill(m: Messenger, channel: str = CH, n: int = 300) -> list[str]:
    """About 3 MiB: three or more 1 MiB segments."""
    ids: list[str] = []
    for k in range(0, n, 25):
        ids += m.publish_batch(channel, [("t", {"n": k + i, "b": BLOB}) for i in range(25)])
    return ids


def segments(m: Messenger, channel: str = CH) -> list[int]:
    d = Path(m.config.storage.data_dir) / "channels" / channel
    return sorted(int(p.stem) for p in d.glob("*.jsonl"))


def held_bytes(m: Messenger, channel: str = CH) -> int:
    d = Path(m.config.storage.data_dir) / "channels" / channel
    return sum(p.stat().st_size for p in d.glob("*.jsonl"))


def test_a_channel_without_subscribers_keeps_its_data(tmp_path: Path) -> None:
    # A job writes a channel and its segments roll; a reader started later
    # (a streaming query, a new subscriber) must still find every row.
    with Messenger(cfg(tmp_path)) as m:
        ids = fill(m)
        before = segments(m)
        assert len(before) >= 3
        assert m.compact() == {}
        assert segments(m) == before
    assert [e.message.id for e in read_channel(tmp_path / "data", CH)] == ids


def test_consumed_segments_still_go_once_every_subscriber_passed_them(tmp_path: Path) -> None:
    with Messenger(cfg(tmp_path)) as m:
        sub = m.subscribe(CH, "reader", lambda msg: None)
        fill(m)
        end = m.stream_end(CH)
        deadline = time.monotonic() + WAIT_S
        while sub.position < end:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        sub.close()
        before = segments(m)
        report = m.compact()
        assert segments(m) == before[-1:]
        assert report[CH][0] == len(before) - 1


def test_max_bytes_trims_oldest_segments_and_reports_the_gap(tmp_path: Path) -> None:
    config = cfg(tmp_path, {"max_bytes": 2 * MIB, "channels": [{"name": "keep"}]})
    gaps: list[tuple[str, str, int, int]] = []
    with Messenger(config) as m:
        m.subscribe(CH, "slow", lambda msg: None).close()  # registered, reads nothing
        fill(m)
        fill(m, "keep")
        keep_before = segments(m, "keep")
        m.compact()
        first = segments(m)[0]
        assert first > 0
        assert held_bytes(m) <= 2 * MIB
        # The per-channel entry replaces the global limits: none for "keep".
        assert segments(m, "keep") == keep_before
        got: list[int] = []
        m.subscribe(CH, "slow", lambda msg: got.append(1), on_gap=lambda *a: gaps.append(a))
        deadline = time.monotonic() + WAIT_S
        while not gaps and time.monotonic() < deadline:
            time.sleep(0.02)
    assert gaps == [(CH, "slow", 0, first)]


def test_max_age_deletes_sealed_segments_written_before_it(tmp_path: Path) -> None:
    config = cfg(tmp_path, {"channels": [{"name": CH, "max_age": "1h"}]})
    with Messenger(config) as m:
        fill(m)
        before = segments(m)
        old = time.time() - 7200
        d = Path(config.storage.data_dir) / "channels" / CH
        for start in before[:2]:
            os.utime(d / f"{start:020}.jsonl", (old, old))
        m.compact()
        assert segments(m) == before[2:]


def test_retention_section_round_trips_and_is_off_by_default(tmp_path: Path) -> None:
    assert cfg(tmp_path).retention.max_age == datetime.timedelta(0)
    assert cfg(tmp_path).retention.max_bytes == 0
    config = cfg(tmp_path, {"max_age": "168h", "channels": [{"name": "a", "max_bytes": 5}]})
    assert Config.from_dict(config.to_dict()) == config
    assert config.retention.channels[0].max_bytes == 5


@pytest.mark.parametrize(
    ("retention", "problem"),
    [
        ({"max_bytes": -1}, "retention.max_bytes: must be >= 0"),
        ({"max_age": "-1h"}, "retention.max_age: must not be negative"),
        ({"channels": [{"name": "a"}, {"name": "a"}]}, "retention.channels[1].name"),
        ({"channels": [{"name": "../x"}]}, "retention.channels[0].name"),
        ({"channels": [{"max_bytes": 1}]}, "retention.channels[0].name: required"),
    ],
)
def test_bad_retention_values_are_reported(
    tmp_path: Path, retention: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ConfigError) as err:
        cfg(tmp_path, retention)
    assert any(p.startswith(problem) for p in err.value.problems), err.value.problems


def test_segment_size_mb_sets_the_segment_size(tmp_path: Path) -> None:
    with Messenger(cfg(tmp_path)) as m:
        fill(m)
        starts = segments(m)
    assert len(starts) >= 3
    assert all(b - a <= MIB for a, b in itertools.pairwise(starts))


def test_compaction_threshold_mb_still_works_with_a_deprecation_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    doc = {"name": "n", "storage": {"data_dir": str(tmp_path / "d"), "compaction_threshold_mb": 1}}
    with pytest.warns(DeprecationWarning, match="segment_size_mb"):
        config = Config.from_dict(doc)
    assert any("segment_size_mb" in r.getMessage() for r in caplog.records)
    with Messenger(config) as m:
        fill(m)
        assert len(segments(m)) >= 3


def test_compaction_threshold_mb_zero_means_the_default_as_in_1_4(tmp_path: Path) -> None:
    # 1.4 replaces a zero value by its default, so a 1.4 file's explicit 0
    # means 256 MiB segments, not segments that never roll.
    def size(**storage: int) -> int:
        doc = {"name": "n", "storage": {"data_dir": str(tmp_path / "d"), **storage}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return Config.from_dict(doc).storage.segment_mb()

    assert size(compaction_threshold_mb=0) == 256
    assert size(compaction_threshold_mb=-1) == -1
    assert size(compaction_threshold_mb=3) == 3
    assert size(segment_size_mb=0) == 0  # the new key's own meaning: never roll


def test_both_segment_size_keys_set_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err, pytest.warns(DeprecationWarning):
        cfg(tmp_path, compaction_threshold_mb=2)
    assert any(
        "compaction_threshold_mb" in p and "segment_size_mb" in p for p in err.value.problems
    ), err.value.problems
