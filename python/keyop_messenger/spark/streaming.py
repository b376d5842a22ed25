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
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
from pyspark.sql.types import (
    Row,
)

from .reader import (
    KeyopPartition,
    ReadSpec,
    align_offset,
    list_segments,
    spec_of,
    stream_end,
)
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


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The stream reader of one or more channels. Data deleted before the
    query read it (retention of a channel without ``retain_as``, a removed
    segment) raises :class:`DataLossError` when it is planned or read
    (``failOnDataLoss``, default true, like Spark's Kafka source); with
    ``failOnDataLoss=false`` it is skipped, logged at WARNING and counted in
    :attr:`lost_bytes` and :attr:`lost_ranges`.

    Offsets: ``{"offset": n}`` when one channel is read, ``{"offsets":
    {channel: n, ...}}`` for several (global byte offsets). The latest offset
    reported to the query's progress (``sources[].latestOffset``) carries, in
    ``bytesBehindLatest``, how far the planned micro-batch ends behind the
    channels' committed ends: the query's lag."""

    def __init__(self, spec: ReadSpec | Sequence[ReadSpec]) -> None:
        self.specs = [spec] if isinstance(spec, ReadSpec) else list(spec)
        self.spec = self.specs[0]
        #: Bytes skipped because they were deleted before being read.
        self.lost_bytes = 0
        #: The skipped ``(start, end)`` byte ranges, in order.
        self.lost_ranges: list[tuple[int, int]] = []
        #: Trigger.AvailableNow: the ends the query stops at.
        self._target: dict[str, int] | None = None
        #: The end of the last micro-batch planned (for the lag).
        self._planned: dict[str, int] | None = None

    def _pack(self, ends: dict[str, int]) -> dict[str, Any]:
        if len(self.specs) == 1:
            return {"offset": ends[self.spec.channel]}
        return {"offsets": {s.channel: ends[s.channel] for s in self.specs}}

    def _unpack(self, offset: dict[str, Any] | None) -> dict[str, int]:
        if not offset:
            return {s.channel: 0 for s in self.specs}
        if "offsets" in offset:
            given = offset["offsets"]
            return {s.channel: int(given.get(s.channel, 0)) for s in self.specs}
        if len(self.specs) != 1:
            raise ValueError(
                "keyop data source: the checkpoint holds the offset of one channel; a query "
                "reading several channels needs a new checkpoint location"
            )
        return {self.spec.channel: _offset_of(offset)}

    def _gap(self, spec: ReadSpec, start: int, end: int) -> None:
        """Fails or counts the deleted range ``[start, end)``."""
        from ..errors import DataLossError

        message = _data_loss(spec, start, end, "before the query read them")
        if spec.fail_on_data_loss:
            raise DataLossError(message)
        self.lost_bytes += end - start
        self.lost_ranges.append((start, end))
        log.warning("%s (skipped; %d bytes lost in total)", message, self.lost_bytes)

    @staticmethod
    def _retain(spec: ReadSpec, offset: int) -> None:
        if spec.retain_as is not None:
            write_offset_file(spec.data_dir, spec.channel, spec.retain_as, offset)

    def initialOffset(self) -> dict[str, Any]:
        """Where a new query starts (``startingOffsets`` / ``startingTimestamp``);
        writes the ``retain_as`` offset files."""
        starts: dict[str, int] = {}
        for spec in self.specs:
            spec.exists()  # raises for a missing data_dir/channel unless allowMissing
            start = spec.start()
            if spec.start_offset == "earliest":
                # The oldest record still stored: nothing was lost before the query began.
                start = (list_segments(spec.data_dir, spec.channel) or [0])[0]
            self._retain(spec, start)
            starts[spec.channel] = start
        return self._pack(starts)

    def getDefaultReadLimit(self) -> Any:
        """``maxOffsetsPerTrigger`` / ``maxBytesPerTrigger`` (offsets are bytes:
        the smaller of the two) as a byte limit per micro-batch (pyspark 4.2+)."""
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes

        n = self.spec.max_bytes_per_trigger
        return ReadMaxBytes(n) if n > 0 else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: the query stops at the channels' current ends."""
        self._target = {s.channel: stream_end(s.data_dir, s.channel) for s in self.specs}

    def _latest(self) -> dict[str, int]:
        latest = {s.channel: stream_end(s.data_dir, s.channel) for s in self.specs}
        if self._target is not None:
            latest = {c: min(n, self._target[c]) for c, n in latest.items()}
        return latest

    # Works with both signatures: latestOffset() (pyspark < 4.2) and
    # latestOffset(start, limit). A ReadMaxBytes limit (``maxOffsetsPerTrigger``)
    # is shared by the channels in proportion to what each has to read, and
    # ends each channel's part at the first record boundary at or after it.
    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: Any = None
    ) -> dict[str, Any]:
        """The end of the next micro-batch: the committed ends of the channels
        (at most the AvailableNow target), or less under the byte limit."""
        ends = self._latest()
        if start is not None:
            lo = self._unpack(start)
            ends = {c: max(n, lo[c]) for c, n in ends.items()}
            max_bytes = getattr(limit, "max_bytes", 0) or 0
            pending = sum(ends[c] - lo[c] for c in ends)
            if 0 < max_bytes < pending:
                for spec in self.specs:
                    c = spec.channel
                    share = max(1, max_bytes * (ends[c] - lo[c]) // pending)
                    if lo[c] + share < ends[c]:
                        ends[c] = align_offset(spec.data_dir, c, lo[c] + share)
        self._planned = ends
        return self._pack(ends)

    def reportLatestOffset(self) -> dict[str, Any]:
        """The channels' committed ends, and ``bytesBehindLatest``: bytes
        committed after the end of the last planned micro-batch (pyspark
        4.2+ shows this in the query progress, ``sources[].latestOffset``)."""
        latest = {s.channel: stream_end(s.data_dir, s.channel) for s in self.specs}
        planned = self._planned or {}
        out = self._pack(latest)
        out["bytesBehindLatest"] = sum(
            max(0, n - planned.get(c, n)) for c, n in latest.items()
        )
        return out

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """The input partitions of one micro-batch, from ``start`` to ``end``."""
        los, his = self._unpack(start), self._unpack(end)
        total = sum(max(0, his[c] - los[c]) for c in his)
        parts: list[KeyopPartition] = []
        for spec in self.specs:
            lo, hi = los[spec.channel], his[spec.channel]
            if lo < hi:
                segments = list_segments(spec.data_dir, spec.channel)
                first = segments[0] if segments else hi
                if lo < first:
                    self._gap(spec, lo, min(first, hi))
                    lo = min(first, hi)
            for p in spec.partitions(lo, hi, total):
                parts.append(KeyopPartition(len(parts), p.segment, p.start, p.end, p.channel))
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The records of one input partition as Arrow batches."""
        assert isinstance(partition, KeyopPartition)
        return _checked_read(spec_of(self.specs, partition), partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Spark is done with all before ``end``: moves the ``retain_as`` offset files there."""
        ends = self._unpack(end)
        for spec in self.specs:
            self._retain(spec, ends[spec.channel])


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
