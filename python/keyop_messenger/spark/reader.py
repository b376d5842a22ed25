"""Reading channels: segment files, the committed stream end, planning input
partitions, and the batch reader (the streaming reader builds on it)."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSourceReader,
    InputPartition,
)
from pyspark.sql.types import (
    StringType,
    StructType,
)

from .mapping import json_to_spark
from .options import (
    ENVELOPE_COLUMNS,
    READ_OPTIONS,
    Options,
    check_channel,
    check_subscriber_id,
)

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]



_ARROW_BATCH_ROWS = 8192
_SEGMENT_RE = re.compile(r"^(\d+)\.jsonl$")


def _channel_dir(data_dir: str, channel: str) -> Path:
    return Path(data_dir) / "channels" / channel


def list_segments(data_dir: str, channel: str) -> list[int]:
    """Start offsets of the segment files of ``channel``, ascending (empty if
    the channel does not exist)."""
    try:
        names = os.listdir(_channel_dir(data_dir, channel))
    except FileNotFoundError:
        return []
    starts = []
    for name in names:
        m = _SEGMENT_RE.match(name)
        if m:
            starts.append(int(m.group(1)))
    return sorted(starts)


def _segment_path(data_dir: str, channel: str, start: int) -> Path:
    return _channel_dir(data_dir, channel) / f"{start:020d}.jsonl"


def _whole_lines_size(path: Path) -> int:
    """Bytes of ``path`` up to and including its last line feed."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            pos = end
            while pos > 0:
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                chunk = f.read(step)
                i = chunk.rfind(b"\n")
                if i >= 0:
                    return pos + i + 1
            return 0
    except FileNotFoundError:
        return 0


def stream_end(data_dir: str, channel: str) -> int:
    """The committed end of ``channel`` in ``data_dir`` (whole records only),
    read without a lock: the offset the next record gets (0 if there is no
    channel)."""
    segments = list_segments(data_dir, channel)
    if not segments:
        return 0
    last = segments[-1]
    return last + _whole_lines_size(_segment_path(data_dir, channel, last))


def _next_boundary(data_dir: str, channel: str, segment: int, offset: int, limit: int) -> int:
    """The first record boundary at or after ``offset`` in ``segment`` (capped
    at ``limit``): ``offset`` itself if the previous byte is a line feed."""
    if offset <= segment:
        return segment
    path = _segment_path(data_dir, channel, segment)
    try:
        with open(path, "rb") as f:
            pos = offset - segment - 1
            f.seek(pos)
            while segment + pos < limit:
                chunk = f.read(65536)
                if not chunk:
                    return limit
                i = chunk.find(b"\n")
                if i >= 0:
                    return min(segment + pos + i + 1, limit)
                pos += len(chunk)
    except FileNotFoundError:
        pass
    return limit


class KeyopPartition(InputPartition):
    """Records of one segment file with ``start <= offset < end``."""

    def __init__(self, index: int, segment: int, start: int, end: int) -> None:
        super().__init__(index)
        self.index = index
        self.segment = segment
        self.start = start
        self.end = end

    def __repr__(self) -> str:
        return (
            f"KeyopPartition(index={self.index}, segment={self.segment}, "
            f"start={self.start}, end={self.end})"
        )


def plan_partitions(
    data_dir: str, channel: str, start: int, end: int, max_partition_bytes: int = 0
) -> list[KeyopPartition]:
    """Input partitions covering ``[start, end)``: one per segment file range,
    each split at record boundaries into pieces of about
    ``max_partition_bytes`` when that is > 0. Raises ``DataLossError`` when a
    non-zero ``start`` lies before the first segment (those bytes are gone;
    offset 0 means the oldest record kept)."""
    if end <= start:
        return []
    segments = list_segments(data_dir, channel)
    if segments and 0 < start < segments[0]:
        from ..errors import DataLossError

        raise DataLossError(
            f"channel {channel!r} in {data_dir}: bytes {start}..{segments[0]} are gone "
            "(deleted by retention, or a segment was removed) before this query read "
            "them; the 'retain_as' option makes retention keep what a query still needs"
        )
    parts: list[KeyopPartition] = []
    for i, seg in enumerate(segments):
        seg_end = segments[i + 1] if i + 1 < len(segments) else end
        lo, hi = max(start, seg), min(end, seg_end)
        if lo >= hi:
            continue
        if max_partition_bytes > 0:
            cut = lo
            while hi - cut > max_partition_bytes:
                nxt = _next_boundary(data_dir, channel, seg, cut + max_partition_bytes, hi)
                if nxt >= hi:
                    break
                parts.append(KeyopPartition(len(parts), seg, cut, nxt))
                cut = nxt
            lo = cut
        parts.append(KeyopPartition(len(parts), seg, lo, hi))
    return parts


def _arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema Spark expects for batches of ``schema``."""
    from pyspark.sql.pandas.types import to_arrow_schema

    try:
        return to_arrow_schema(schema, timezone="UTC")
    except TypeError:  # pragma: no cover - older signature
        return to_arrow_schema(schema)


def align_offset(data_dir: str, channel: str, offset: int) -> int:
    """The first record boundary at or after ``offset`` (the stream end at
    most): a start offset in the middle of a record skips that record."""
    end = stream_end(data_dir, channel)
    if offset >= end:
        return end
    segments = [s for s in list_segments(data_dir, channel) if s <= offset]
    if not segments:
        return offset  # before the first segment: the reader starts there
    return _next_boundary(data_dir, channel, segments[-1], offset, end)


def _check_read_schema(schema: StructType) -> None:
    """A schema given with ``.schema(...)`` must be the envelope's, with the
    payload as a string or a struct."""
    names = [f.name for f in schema.fields]
    if names != list(ENVELOPE_COLUMNS) or not isinstance(
        schema["payload"].dataType, (StringType, StructType)
    ):
        raise ValueError(
            "keyop data source: the schema must be the envelope's columns "
            f"{list(ENVELOPE_COLUMNS)} with payload a STRING or a STRUCT; give the "
            f"payload's fields with the option 'payload_schema' (got {schema.simpleString()})"
        )


@dataclasses.dataclass(frozen=True)
class ReadSpec:
    """The checked read options: what to read and from where (built on the driver)."""
    data_dir: str
    channel: str
    start_offset: str
    max_partition_bytes: int
    schema: StructType
    retain_as: str | None = None
    fail_on_data_loss: bool = True
    allow_missing: bool = False
    ending_offset: str = "latest"
    max_offsets_per_trigger: int = 0

    @classmethod
    def from_options(cls, options: Any, schema: StructType) -> ReadSpec:
        """Checks the read options and the schema; ``ValueError`` names the first problem."""
        o = Options(options)
        o.check_known(READ_OPTIONS, "read")
        # Absolute, resolved on the driver: executors may run in another directory.
        data_dir = os.path.abspath(o.required("data_dir", "the data directory to read"))
        channel = o.required("channel", "the channel to read")
        check_channel(channel, publish=False)
        if o.get("start_offset") and o.get("startingOffsets"):
            raise ValueError(
                "keyop data source: give one of the options 'start_offset' and "
                "'startingOffsets' (the same thing, Kafka's name)"
            )
        key = "startingOffsets" if o.get("startingOffsets") else "start_offset"
        start = _offset_option(o, key, channel, "earliest")
        ending = _offset_option(o, "endingOffsets", channel, "latest")
        if ending == "earliest":
            raise ValueError(
                "keyop data source: option 'endingOffsets' must be 'latest', a byte offset "
                "or a JSON object of them per channel, got 'earliest'"
            )
        _check_read_schema(schema)
        retain_as = o.get("retain_as") or None
        if retain_as is not None:
            check_subscriber_id(retain_as)
        return cls(
            data_dir,
            channel,
            start,
            o.integer("max_partition_bytes", 0),
            schema,
            retain_as,
            o.boolean("failOnDataLoss", True),
            o.boolean("allowMissing", False),
            ending,
            o.integer("maxOffsetsPerTrigger", 0),
        )

    def exists(self) -> bool:
        """Whether the channel exists: raises :class:`DataDirNotFoundError` or
        :class:`ChannelNotFoundError` when the data directory or the channel
        is missing, unless ``allowMissing`` (then False: read nothing)."""
        return check_exists(self.data_dir, self.channel, allow_missing=self.allow_missing)

    def check_exists(self) -> None:
        """Raises :class:`DataDirNotFoundError` / :class:`ChannelNotFoundError`
        unless the data directory and channel exist or ``allowMissing`` is set
        (the planning step's check)."""
        self.exists()

    def start(self) -> int:
        """The offset the read starts at (``earliest``, ``latest`` or a byte offset moved to the
        next record)."""
        if self.start_offset == "earliest":
            return 0
        if self.start_offset == "latest":
            return stream_end(self.data_dir, self.channel)
        return align_offset(self.data_dir, self.channel, int(self.start_offset))

    def end(self) -> int:
        """The offset a batch read ends at (``endingOffsets``: the committed end,
        or a byte offset moved to the next record and capped at the end)."""
        end = stream_end(self.data_dir, self.channel)
        if self.ending_offset == "latest":
            return end
        return min(end, align_offset(self.data_dir, self.channel, int(self.ending_offset)))

    def partitions(self, start: int, end: int) -> list[KeyopPartition]:
        """The input partitions covering the byte range ``[start, end)``, cut between records."""
        return plan_partitions(self.data_dir, self.channel, start, end, self.max_partition_bytes)

    def read(self, partition: KeyopPartition) -> Iterator[pa.RecordBatch]:
        """The records of ``partition`` as Arrow batches of the read schema
        (``failOnDataLoss=false``: bytes gone from inside it are skipped)."""
        return _read_partition(
            self.data_dir,
            self.channel,
            partition,
            self.schema,
            skip_gaps=not self.fail_on_data_loss,
        )


def _read_partition(
    data_dir: str,
    channel: str,
    partition: KeyopPartition,
    schema: StructType,
    *,
    skip_gaps: bool = False,
) -> Iterator[pa.RecordBatch]:
    """Yields the records of ``partition`` as Arrow batches of ``schema``; a gap
    raises :class:`DataLossError` unless ``skip_gaps``."""
    import pyarrow as pa

    from .. import _core

    arrow_schema = _arrow_schema(schema)
    payload_field = schema["payload"]
    parse = (
        None
        if isinstance(payload_field.dataType, StringType)
        else json_to_spark(payload_field.dataType)
    )
    convert = (
        json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=True).encode
        if parse is None
        else parse
    )
    types = [arrow_schema.field(i).type for i in range(len(arrow_schema))]
    records: Iterator[Any] = _core.read_channel(
        data_dir, channel, partition.start, skip_gaps=skip_gaps
    )
    while True:
        chunk = list(itertools.islice(records, _ARROW_BATCH_ROWS))
        if chunk and chunk[-1][0] >= partition.end:
            chunk = chunk[: bisect.bisect_left([r[0] for r in chunk], partition.end)]
            records = iter(())
        if not chunk:
            return
        # Rows are (offset, segment, id, ts_nanos, channel, origin, payload_type,
        # service_name, correlation_id, payload); columns follow ENVELOPE_COLUMNS.
        offs, segs, ids, ts, chans, origins, ptypes, services, corrs, payloads = zip(
            *chunk, strict=True
        )
        arrays = [
            pa.array(ids, types[0]),
            pa.array([n // 1000 for n in ts], pa.int64()).cast(types[1]),
            pa.array(chans, types[2]),
            pa.array(origins, types[3]),
            pa.array(ptypes, types[4]),
            pa.array(services, types[5]),
            pa.array(corrs, types[6]),
            pa.array(list(map(convert, payloads)), types[7]),
            pa.array(segs, types[8]),
            pa.array(offs, types[9]),
        ]
        yield pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)


def _offset_option(o: Options, key: str, channel: str, default: str) -> str:
    """An offset option: ``earliest``, ``latest``, a byte offset >= 0, or (as
    Spark's Kafka source takes them) a JSON object of those per channel, which
    must name the channel read (and no other); returned as text."""
    text = (o.get(key) or default).strip()
    value: Any = text
    if text.startswith("{"):
        try:
            per_channel = json.loads(text)
        except ValueError as exc:
            raise ValueError(
                f"keyop data source: option {key!r} is not valid JSON ({exc}): {text!r}"
            ) from None
        if not isinstance(per_channel, dict) or set(per_channel) != {channel}:
            raise ValueError(
                f"keyop data source: option {key!r} must name exactly the channel read "
                f"({channel!r}), got {text!r}"
            )
        value = per_channel[channel]
    value = str(value).strip().lower()
    if value in ("earliest", "latest"):
        return value
    if value == "-2":  # Kafka's numeric names
        return "earliest"
    if value == "-1":
        return "latest"
    if not value.isdigit():
        raise ValueError(
            f"keyop data source: option {key!r} must be 'earliest', 'latest', a byte "
            f"offset >= 0 or a JSON object of them per channel, got {text!r}"
        )
    return str(int(value))


def check_exists(data_dir: str, channel: str, *, allow_missing: bool) -> bool:
    """True if ``channel`` exists in ``data_dir``. A missing data directory
    raises :class:`DataDirNotFoundError`, a missing channel
    :class:`ChannelNotFoundError` (a misspelled path must not read as an
    empty channel); with ``allow_missing`` both return False instead."""
    from ..errors import ChannelNotFoundError, DataDirNotFoundError

    if not os.path.isdir(data_dir):
        if allow_missing:
            return False
        raise DataDirNotFoundError(
            f"keyop data source: data directory {data_dir!r} does not exist; check the "
            "option 'data_dir' (or set allowMissing=true to read it as empty)"
        )
    if not _channel_dir(data_dir, channel).is_dir():
        if allow_missing:
            return False
        raise ChannelNotFoundError(
            f"keyop data source: channel {channel!r} does not exist in {data_dir!r}; check "
            "the option 'channel' (or set allowMissing=true to read it as empty)"
        )
    return True


class BatchReader(DataSourceReader):
    """Batch read of a channel: everything committed when the read was planned."""
    def __init__(self, spec: ReadSpec) -> None:
        self.spec = spec
        self.end = spec.end() if spec.exists() else 0

    def partitions(self) -> Sequence[InputPartition]:
        """One input partition per segment file (split further by ``max_partition_bytes``)."""
        parts = self.spec.partitions(self.spec.start(), self.end)
        # Spark needs at least one partition; an empty range reads nothing.
        return parts or [KeyopPartition(0, 0, 0, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The records of one input partition as Arrow batches."""
        assert isinstance(partition, KeyopPartition)
        if partition.end <= partition.start:
            return iter(())
        return self.spec.read(partition)
