"""Structured Streaming: the stream reader (offsets, retention held with
``retain_as``) and the stream writers."""

from __future__ import annotations

import logging
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

from .reader import KeyopPartition, ReadSpec, align_offset, list_segments, stream_end
from .writer import PartitionCommit, WriteSpec, publish_arrow, publish_rows, report

try:  # pyspark >= 4.1
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamArrowWriterBase
except ImportError:  # pragma: no cover - pyspark 4.0
    _StreamArrowWriterBase = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]

log = logging.getLogger("keyop_messenger.spark")

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


def _data_loss(spec: ReadSpec, lost_from: int, lost_to: int | None, when: str) -> str:
    """The message of a data loss: which channel, which bytes, what to do."""
    what = f"bytes [{lost_from}, {lost_to})" if lost_to is not None else f"from {lost_from}"
    return (
        f"keyop data source: channel {spec.channel!r} in {spec.data_dir!r}: {what} were "
        f"deleted (by retention or by hand) {when}. Hold retention with the option "
        "'retain_as', or set failOnDataLoss=false to skip the gap with a warning"
    )


class StreamReader(DataSourceStreamReader):
    """The stream reader. Data deleted before the query read it (retention
    of a channel without ``retain_as``, a removed segment) raises
    :class:`DataLossError` when it is planned or read (``failOnDataLoss``,
    default true, like Spark's Kafka source); with ``failOnDataLoss=false``
    it is skipped, logged at WARNING and counted in :attr:`lost_bytes` and
    :attr:`lost_ranges`."""

    def __init__(self, spec: ReadSpec) -> None:
        self.spec = spec
        #: Bytes skipped because they were deleted before being read.
        self.lost_bytes = 0
        #: The skipped ``(start, end)`` byte ranges, in order.
        self.lost_ranges: list[tuple[int, int]] = []

    def _gap(self, start: int, end: int) -> None:
        """Fails or counts the deleted range ``[start, end)``."""
        from ..errors import DataLossError

        message = _data_loss(self.spec, start, end, "before the query read them")
        if self.spec.fail_on_data_loss:
            raise DataLossError(message)
        self.lost_bytes += end - start
        self.lost_ranges.append((start, end))
        log.warning("%s (skipped; %d bytes lost in total)", message, self.lost_bytes)

    def _retain(self, offset: int) -> None:
        if self.spec.retain_as is not None:
            write_offset_file(self.spec.data_dir, self.spec.channel, self.spec.retain_as, offset)

    def initialOffset(self) -> dict[str, int]:
        """Where a new query starts (``start_offset``); writes the ``retain_as`` offset file."""
        self.spec.exists()  # raises for a missing data_dir/channel unless allowMissing
        start = self.spec.start()
        if self.spec.start_offset == "earliest":
            # The oldest record still stored: nothing was lost before the query began.
            start = (list_segments(self.spec.data_dir, self.spec.channel) or [0])[0]
        self._retain(start)
        return {"offset": start}

    def getDefaultReadLimit(self) -> Any:
        """``maxOffsetsPerTrigger`` as a byte limit per micro-batch (pyspark 4.2+)."""
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes

        n = self.spec.max_offsets_per_trigger
        return ReadMaxBytes(n) if n > 0 else ReadAllAvailable()

    # Works with both signatures: latestOffset() (pyspark < 4.2) and
    # latestOffset(start, limit). A ReadMaxBytes limit (``maxOffsetsPerTrigger``)
    # ends the batch at the first record boundary at or after start + limit.
    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: Any = None
    ) -> dict[str, int]:
        """The end of the next micro-batch: the committed end of the channel,
        or less under ``maxOffsetsPerTrigger``."""
        end = stream_end(self.spec.data_dir, self.spec.channel)
        if start is not None:
            lo = _offset_of(start)
            end = max(end, lo)
            max_bytes = getattr(limit, "max_bytes", 0) or 0
            if max_bytes > 0 and lo + max_bytes < end:
                end = align_offset(self.spec.data_dir, self.spec.channel, lo + max_bytes)
        return {"offset": end}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """The input partitions of one micro-batch, from ``start`` to ``end``."""
        lo, hi = _offset_of(start), _offset_of(end)
        if lo < hi:
            segments = list_segments(self.spec.data_dir, self.spec.channel)
            first = segments[0] if segments else hi
            if lo < first:
                self._gap(lo, min(first, hi))
                lo = min(first, hi)
        return self.spec.partitions(lo, hi)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The records of one input partition as Arrow batches."""
        assert isinstance(partition, KeyopPartition)
        return _checked_read(self.spec, partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Spark is done with all before ``end``: moves the ``retain_as`` offset file there."""
        self._retain(_offset_of(end))


def _checked_read(spec: ReadSpec, partition: KeyopPartition) -> Iterator[pa.RecordBatch]:
    """Reads ``partition`` (on an executor), checking that its first record
    is where it was planned: a segment deleted between planning and reading
    raises :class:`DataLossError` (or, with ``failOnDataLoss=false``, is
    logged at WARNING and skipped)."""
    from ..errors import DataLossError

    def lost(at: int) -> None:
        message = _data_loss(spec, partition.start, at, "after the batch was planned")
        if spec.fail_on_data_loss:
            raise DataLossError(message)
        log.warning("%s (skipped)", message)

    if not _segment_exists(spec, partition.segment):
        lost(partition.end)
        return
    first = True
    for batch in spec.read(partition):
        if first and batch.num_rows:
            first = False
            # The `segment` column: records skipped as unreadable stay in the segment.
            at_segment = batch.column(batch.num_columns - 2)[0].as_py()
            if at_segment != partition.segment:
                lost(batch.column(batch.num_columns - 1)[0].as_py())
        yield batch


def _segment_exists(spec: ReadSpec, segment: int) -> bool:
    return os.path.exists(
        os.path.join(spec.data_dir, "channels", spec.channel, f"{segment:020d}.jsonl")
    )


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
