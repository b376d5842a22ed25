"""Structured Streaming: the stream reader (offsets, retention held with
``retain_as``) and the stream writers."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSourceStreamReader,
    DataSourceStreamWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    Row,
)

from .reader import KeyopPartition, ReadSpec, stream_end
from .writer import PartitionCommit, WriteSpec, publish_arrow, publish_rows, report

try:  # pyspark >= 4.1
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamArrowWriterBase
except ImportError:  # pragma: no cover - pyspark 4.0
    _StreamArrowWriterBase = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]



def _offset_of(offset: dict[str, Any] | None) -> int:
    if not offset:
        return 0
    return int(offset["offset"])


def write_offset_file(data_dir: str, channel: str, subscriber_id: str, offset: int) -> None:
    """Writes ``subscribers/<channel>/<subscriber_id>.offset`` as the engine
    does (temporary file, fsync, rename, fsync of the directory), so that
    retention keeps every segment from ``offset`` on."""
    folder = Path(data_dir) / "subscribers" / channel
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{subscriber_id}.offset"
    tmp = folder / f"{subscriber_id}.offset.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        os.write(fd, f"{offset}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class StreamReader(DataSourceStreamReader):
    """Streaming read of a channel; offsets are ``{"offset": N}``, global byte offsets."""
    def __init__(self, spec: ReadSpec) -> None:
        self.spec = spec

    def _retain(self, offset: int) -> None:
        if self.spec.retain_as is not None:
            write_offset_file(self.spec.data_dir, self.spec.channel, self.spec.retain_as, offset)

    def initialOffset(self) -> dict[str, int]:
        """Where a new query starts (``start_offset``); writes the ``retain_as`` offset file."""
        start = self.spec.start()
        self._retain(start)
        return {"offset": start}

    # Works with both signatures: latestOffset() (pyspark < 4.2) and
    # latestOffset(start, limit); every limit is read as "all available".
    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: Any = None
    ) -> dict[str, int]:
        """The committed end of the channel (whole records only), never before ``start``."""
        end = stream_end(self.spec.data_dir, self.spec.channel)
        if start is not None:
            end = max(end, _offset_of(start))
        return {"offset": end}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """The input partitions of one micro-batch, from ``start`` to ``end``."""
        return self.spec.partitions(_offset_of(start), _offset_of(end))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The records of one input partition as Arrow batches."""
        assert isinstance(partition, KeyopPartition)
        return self.spec.read(partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Spark is done with all before ``end``: moves the ``retain_as`` offset file there."""
        self._retain(_offset_of(end))


class StreamRowWriter(DataSourceStreamWriter):
    """Streaming write, one Row at a time (pyspark without the Arrow stream writer)."""
    def __init__(self, spec: WriteSpec) -> None:
        self.spec = spec

    def write(self, iterator: Iterator[Row]) -> PartitionCommit:
        """Publishes this task's rows; returns what it committed."""
        return publish_rows(self.spec, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Logs (and writes to ``report_path``) what the micro-batch's tasks committed."""
        report(self.spec, messages, aborted=False, batch_id=batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Logs (and writes to ``report_path``) what an aborted micro-batch committed."""
        report(self.spec, messages, aborted=True, batch_id=batchId)


if _StreamArrowWriterBase is not None:

    class StreamArrowWriter(_StreamArrowWriterBase):
        """Streaming write, receiving Arrow batches."""
        def __init__(self, spec: WriteSpec) -> None:
            self.spec = spec

        def write(self, iterator: Iterator[pa.RecordBatch]) -> PartitionCommit:
            """Publishes this task's rows; returns what it committed."""
            return publish_arrow(self.spec, iterator)

        def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
            """Logs (and writes to ``report_path``) what the micro-batch's tasks committed."""
            report(self.spec, messages, aborted=False, batch_id=batchId)

        def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
            """Logs (and writes to ``report_path``) what the tasks of an aborted micro-batch
            committed."""
            report(self.spec, messages, aborted=True, batch_id=batchId)


def stream_writer(spec: WriteSpec) -> DataSourceStreamWriter:
    """The stream writer for ``spec``: Arrow batches where pyspark has them (4.1+)."""
    if _StreamArrowWriterBase is not None:
        return StreamArrowWriter(spec)
    return StreamRowWriter(spec)  # pragma: no cover - pyspark 4.0
