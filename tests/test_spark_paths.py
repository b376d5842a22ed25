"""The Spark side of fork safety and missing paths (uses test_spark's
session): a batch read of a data directory or channel that does not exist
raises (unless ``allowMissing=true``) and creates nothing; a Python worker
that forks while it holds a Messenger gets ForkedProcessError in the child,
and the parent's messages are all on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import keyop_messenger as km
from test_spark import _require_spark, spark  # noqa: F401 - fixtures

try:
    from pyspark.sql import SparkSession
except ImportError:  # _require_spark fails every test with the reason
    SparkSession = Any  # type: ignore[misc,assignment]


def test_read_of_a_missing_data_dir_raises(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    missing = tmp_path / "nope"
    with pytest.raises(Exception, match="DataDirNotFoundError") as info:
        spark.read.format("keyop").option("data_dir", str(missing)).option(
            "channel", "temps"
        ).load().collect()
    assert "allowMissing" in str(info.value)
    assert not missing.exists()


def test_read_of_a_missing_channel_raises(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    data = tmp_path / "data"
    with km.Messenger(km.Config.from_dict({"name": "n", "storage": {"data_dir": str(data)}})) as m:
        m.publish("temps", "t", {})
    with pytest.raises(Exception, match="ChannelNotFoundError"):
        spark.read.format("keyop").option("data_dir", str(data)).option(
            "channel", "humidity"
        ).load().collect()
    query = (
        spark.readStream.format("keyop")
        .option("data_dir", str(data))
        .option("channel", "humidity")
        .load()
        .writeStream.format("memory")
        .queryName("never")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        with pytest.raises(Exception, match="ChannelNotFoundError"):
            query.awaitTermination(60)
    finally:
        query.stop()
    assert not (data / "channels" / "humidity").exists()
    # allowMissing: empty, and still nothing created.
    for where in (data, tmp_path / "nope"):
        df = (
            spark.read.format("keyop")
            .option("data_dir", str(where))
            .option("channel", "humidity")
            .option("allowMissing", "true")
            .load()
        )
        assert df.count() == 0
        assert not (where / "channels" / "humidity").exists()
    assert not (tmp_path / "nope").exists()


def _publish_then_fork(root: str) -> Any:
    """A Spark task: opens a Messenger of its own, publishes, forks; the child
    tries the inherited Messenger, the parent publishes again."""

    def run(index: int, rows: Any) -> Any:
        import os

        import keyop_messenger as km

        data = os.path.join(root, f"part-{index}")
        cfg = km.Config.from_dict({"name": f"task{index}", "storage": {"data_dir": data}})
        m = km.Messenger(cfg)
        ids = [m.publish("temps", "t", {"row": r}) for r in rows]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                m.publish("temps", "t", {"child": True})
                outcome = b"published"
            except km.ForkedProcessError:
                outcome = b"ForkedProcessError"
            except BaseException as exc:
                outcome = repr(exc).encode()
            m.close()
            os.write(w, outcome)
            os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(r, "rb") as f:
            outcome = f.read().decode()
        ids.append(m.publish("temps", "t", {"after": True}))
        m.close()
        yield (index, data, outcome, os.waitstatus_to_exitcode(status), ids)

    return run


def test_a_spark_worker_that_forks(spark: SparkSession, tmp_path: Path) -> None:  # noqa: F811
    rdd = spark.sparkContext.parallelize(range(8), 2)
    results = rdd.mapPartitionsWithIndex(_publish_then_fork(str(tmp_path))).collect()
    assert len(results) == 2
    all_ids: list[str] = []
    for _index, data, outcome, code, ids in results:
        assert (outcome, code) == ("ForkedProcessError", 0)
        assert [e.message.id for e in km.read_channel(data, "temps")] == ids
        all_ids += ids
    assert len(set(all_ids)) == len(all_ids)


def test_path_options_are_planned_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from keyop_messenger.spark.options import planned_path

    monkeypatch.chdir(tmp_path)
    assert planned_path("data", "data_dir") == str(tmp_path / "data")
    assert planned_path("/abs/d", "data_dir") == "/abs/d"
    assert planned_path("file:///abs/d", "data_dir") == "/abs/d"
    assert planned_path("file:/abs/d", "data_dir") == "/abs/d"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert planned_path("~/d", "data_dir") == str(tmp_path / "home" / "d")
    with pytest.raises(ValueError, match="not a local file URI"):
        planned_path("file://host/d", "data_dir")
    # In Spark's temporary files folder (where Spark Connect plans), a
    # relative path is refused; an absolute one is fine.
    session = tmp_path / "spark-1" / "userFiles-2" / "session"
    session.mkdir(parents=True)
    monkeypatch.chdir(session)
    with pytest.raises(ValueError, match="give an absolute path"):
        planned_path("data", "data_dir")
    assert planned_path(str(tmp_path / "d"), "data_dir") == str(tmp_path / "d")


def test_a_hub_writes_tls_files_are_made_absolute_on_the_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tasks run in other folders (and machines): relative TLS paths of the
    configuration are resolved where the write is planned, as the file is read."""
    from keyop_messenger.spark.writer import _config_for_tasks

    cfg = tmp_path / "writer.yaml"
    cfg.write_text(
        "name: w\nstorage: {data_dir: /unused}\n"
        "client: {enabled: true, hubs: [{addr: '127.0.0.1:1'}]}\n"
        "tls: {cert: pki/w.crt, key: pki/w.key, ca: /etc/ca.crt}\n"
    )
    monkeypatch.chdir(tmp_path)
    config = _config_for_tasks("writer.yaml")
    assert (config.tls.cert, config.tls.key, config.tls.ca) == (
        str(tmp_path / "pki" / "w.crt"), str(tmp_path / "pki" / "w.key"), "/etc/ca.crt"
    )


def test_partitions_a_hub_write_sent_again_are_reported_and_warned(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    import dataclasses

    from keyop_messenger.config import Config
    from keyop_messenger.spark.writer import PartitionCommit, WriteSpec, report

    config = Config.from_dict({"name": "w", "storage": {"data_dir": str(tmp_path)}})
    spec = WriteSpec.__new__(WriteSpec)
    for f in dataclasses.fields(WriteSpec):
        object.__setattr__(spec, f.name, None)
    object.__setattr__(spec, "channel", "c")
    object.__setattr__(spec, "config", config)
    commits = [
        PartitionCommit(partition_id=0, attempt=0, rows=5, batches=1),
        PartitionCommit(partition_id=1, attempt=1, rows=7, batches=1),
    ]
    with caplog.at_level("WARNING", logger="keyop_messenger.spark"):
        counts = report(spec, commits, aborted=False)
    assert counts["partitions_sent_again"] == [1] and counts["rows"] == 12
    messages = [r.getMessage() for r in caplog.records]
    (warning,) = [m for m in messages if "sent their rows again" in m]
    assert "[1]" in warning and "(7 rows)" in warning and "dedup.seen_id_lru_size" in warning
