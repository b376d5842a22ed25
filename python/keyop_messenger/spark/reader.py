"""Reading channels: segment files, the committed stream end, planning input
partitions, and the batch reader (the streaming reader builds on it)."""

from __future__ import annotations

import dataclasses
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
    DEFAULT_MAX_PARTITION_BYTES,
    ENVELOPE_COLUMNS,
    READ_OPTIONS,
    Options,
    check_channel,
    check_subscriber_id,
    planned_path,
)
from .payload_parsing import arrow_parses, flat_kinds, parse_payloads

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
    """Records of one segment file of ``channel`` with ``start <= offset < end``."""

    def __init__(self, index: int, segment: int, start: int, end: int, channel: str = "") -> None:
        super().__init__(index)
        self.index = index
        self.segment = segment
        self.start = start
        self.end = end
        self.channel = channel

    def __repr__(self) -> str:
        return (
            f"KeyopPartition(index={self.index}, channel={self.channel!r}, "
            f"segment={self.segment}, start={self.start}, end={self.end})"
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
                parts.append(KeyopPartition(len(parts), seg, cut, nxt, channel))
                cut = nxt
            lo = cut
        parts.append(KeyopPartition(len(parts), seg, lo, hi, channel))
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
    max_bytes_per_trigger: int = 0
    min_partitions: int = 0

    @classmethod
    def from_options(cls, options: Any, schema: StructType) -> ReadSpec:
        """The checked read options of a read of one channel; ``ValueError``
        names the first problem (see :meth:`all_from_options`)."""
        specs = cls.all_from_options(options, schema)
        if len(specs) != 1:
            raise ValueError("keyop data source: this read takes one channel")
        return specs[0]

    @classmethod
    def all_from_options(cls, options: Any, schema: StructType) -> list[ReadSpec]:
        """Checks the read options and the schema; ``ValueError`` names the
        first problem. One spec per channel read (``channel`` may name several,
        separated by commas)."""
        o = Options(options)
        o.check_known(READ_OPTIONS, "read")
        # Absolute, resolved when the read is planned, in the Python worker that
        # plans it (its working directory is where Spark started, not the driver
        # program's current one; hence "give absolute paths" in the docs):
        # executors may run in another directory.
        data_dir = planned_path(o.required("data_dir", "the data directory to read"), "data_dir")
        channels = _channel_list(o.required("channel", "the channel(s) to read"))
        if o.get("start_offset") and o.get("startingOffsets"):
            raise ValueError(
                "keyop data source: give one of the options 'start_offset' and "
                "'startingOffsets' (the same thing, Kafka's name)"
            )
        key = "startingOffsets" if o.get("startingOffsets") else "start_offset"
        starts = _offset_option(o, key, channels, "earliest")
        endings = _offset_option(o, "endingOffsets", channels, "latest")
        if "earliest" in endings.values():
            raise ValueError(
                "keyop data source: option 'endingOffsets' must be 'latest', a byte offset "
                "or a JSON object of them per channel, got 'earliest'"
            )
        for name, offsets, given in (
            ("startingTimestamp", starts, o.get(key)),
            ("endingTimestamp", endings, o.get("endingOffsets")),
        ):
            if o.get(name):
                if given:
                    raise ValueError(
                        f"keyop data source: give one of the options {name!r} and "
                        f"{'endingOffsets' if name.startswith('end') else key!r}"
                    )
                ms = o.integer(name, 0, minimum=-(2**62))
                offsets.update({c: f"@{ms}" for c in channels})
        _check_read_schema(schema)
        retain_as = o.get("retain_as") or None
        if retain_as is not None:
            check_subscriber_id(retain_as)
        per_trigger = o.integer("maxOffsetsPerTrigger", 0)
        max_bytes = o.integer("maxBytesPerTrigger", 0)
        limits = [n for n in (per_trigger, max_bytes) if n > 0]
        return [
            cls(
                data_dir,
                channel,
                starts[channel],
                o.integer("max_partition_bytes", DEFAULT_MAX_PARTITION_BYTES),
                schema,
                retain_as,
                o.boolean("failOnDataLoss", True),
                o.boolean("allowMissing", False),
                endings[channel],
                per_trigger,
                min(limits) if limits else 0,
                o.integer("minPartitions", 0),
            )
            for channel in channels
        ]

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
        """The offset the read starts at (``earliest``, ``latest``, a byte offset moved to the
        next record, or the first record at or after ``startingTimestamp``)."""
        if self.start_offset == "earliest":
            return 0
        if self.start_offset == "latest":
            return stream_end(self.data_dir, self.channel)
        if self.start_offset.startswith("@"):
            return self._at_time(int(self.start_offset[1:]))
        return align_offset(self.data_dir, self.channel, int(self.start_offset))

    def end(self) -> int:
        """The offset a batch read ends at (``endingOffsets``: the committed end,
        or a byte offset moved to the next record and capped at the end;
        ``endingTimestamp``: the first record at or after that time)."""
        end = stream_end(self.data_dir, self.channel)
        if self.ending_offset == "latest":
            return end
        if self.ending_offset.startswith("@"):
            return min(end, self._at_time(int(self.ending_offset[1:])))
        return min(end, align_offset(self.data_dir, self.channel, int(self.ending_offset)))

    def _at_time(self, ms: int) -> int:
        """The offset of the first record stamped at or after ``ms``
        milliseconds since the Unix epoch (the end if there is none)."""
        from .. import _core

        if not os.path.isdir(_channel_dir(self.data_dir, self.channel)):
            return 0
        return int(_core.resolve_position(self.data_dir, self.channel, "time", ms * 1_000_000))

    def partitions(self, start: int, end: int, total: int = 0) -> list[KeyopPartition]:
        """The input partitions covering the byte range ``[start, end)``, cut
        between records: per segment file, split by ``max_partition_bytes``,
        and into pieces of at most ``total / minPartitions`` bytes (``total``:
        the bytes of the whole read, all channels; default this range)."""
        size = self.max_partition_bytes
        if self.min_partitions > 0:
            share = -(-max(total or end - start, 1) // self.min_partitions)
            size = min(size, share) if size > 0 else share
        return plan_partitions(self.data_dir, self.channel, start, end, size)

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
    raises :class:`DataLossError` unless ``skip_gaps``.

    The engine reads the records into Arrow buffers (``_core.read_columns``);
    a ``payload_schema`` is parsed batch by batch by
    :func:`~keyop_messenger.spark.payload_parsing.parse_payloads` (the
    engine, Arrow's JSON reader or :func:`json_to_spark`, with one result)."""
    import pyarrow as pa
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    from .. import _core

    arrow_schema = _arrow_schema(schema)
    types = [arrow_schema.field(i).type for i in range(len(arrow_schema))]
    payload_field = schema["payload"]
    as_text = isinstance(payload_field.dataType, StringType)
    parse = None if as_text else json_to_spark(payload_field.dataType)
    fast = not as_text and arrow_parses(payload_field.dataType)
    flat = None if as_text else flat_kinds(payload_field.dataType)

    def text(t: tuple[bytes, bytes, bytes | None, int], rows: int) -> pa.Array:
        offsets, data, validity, nulls = t
        bufs = [None if validity is None else pa.py_buffer(validity)]
        bufs += [pa.py_buffer(offsets), pa.py_buffer(data)]
        return pa.Array.from_buffers(pa.string(), rows, bufs, null_count=nulls)

    def int64(b: bytes, rows: int, kind: Any = None) -> pa.Array:
        return pa.Array.from_buffers(kind or pa.int64(), rows, [None, pa.py_buffer(b)])

    for found in _core.read_columns(
        data_dir,
        channel,
        partition.start,
        partition.end,
        skip_gaps=skip_gaps,
        batch_rows=_ARROW_BATCH_ROWS,
    ):
        rows, offs, segs, ts, ids, chans, origins, ptypes, services, corrs, raw = found
        lines = text(raw, rows)  # each payload's JSON text and a line feed
        if as_text:
            payload = pc.utf8_rtrim(lines, characters="\n")
        else:
            assert parse is not None
            payload = parse_payloads(raw[1], lines, rows, types[7], parse, fast, flat)
        arrays = [
            text(ids, rows),
            int64(ts, rows, pa.timestamp("us", tz="UTC")).cast(types[1]),
            text(chans, rows),
            text(origins, rows),
            text(ptypes, rows),
            text(services, rows),
            text(corrs, rows),
            payload,
            int64(segs, rows),
            int64(offs, rows),
        ]
        arrays = [a if a.type == t else a.cast(t) for a, t in zip(arrays, types, strict=True)]
        yield pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)


def _channel_list(text: str) -> list[str]:
    """The channels named by the ``channel`` option: one name, or several
    separated by commas (each checked; no repeats)."""
    channels = [c.strip() for c in text.split(",")]
    if any(not c for c in channels) or len(set(channels)) != len(channels):
        raise ValueError(
            "keyop data source: option 'channel' must name one channel or several "
            f"separated by commas, each once, got {text!r}"
        )
    for channel in channels:
        check_channel(channel, publish=False)
    return channels


def _offset_option(o: Options, key: str, channels: list[str], default: str) -> dict[str, str]:
    """An offset option per channel: ``earliest``, ``latest``, a byte offset
    >= 0 for every channel, or (as Spark's Kafka source takes them) a JSON
    object of those per channel, which must name every channel read (and no
    other); values returned as text."""
    text = (o.get(key) or default).strip()
    values: dict[str, Any] = {c: text for c in channels}
    if text.startswith("{"):
        try:
            per_channel = json.loads(text)
        except ValueError as exc:
            raise ValueError(
                f"keyop data source: option {key!r} is not valid JSON ({exc}): {text!r}"
            ) from None
        if not isinstance(per_channel, dict) or set(per_channel) != set(channels):
            raise ValueError(
                f"keyop data source: option {key!r} must name exactly the "
                f"channel{'s' if len(channels) > 1 else ''} read "
                f"({', '.join(repr(c) for c in channels)}), got {text!r}"
            )
        values = per_channel
    out: dict[str, str] = {}
    for channel in channels:
        value = str(values[channel]).strip().lower()
        if value == "-2":  # Kafka's numeric names
            value = "earliest"
        elif value == "-1":
            value = "latest"
        if value not in ("earliest", "latest"):
            if not value.isdigit():
                raise ValueError(
                    f"keyop data source: option {key!r} must be 'earliest', 'latest', a byte "
                    f"offset >= 0 or a JSON object of them per channel, got {text!r}"
                )
            value = str(int(value))
        out[channel] = value
    return out


def check_exists(data_dir: str, channel: str, *, allow_missing: bool) -> bool:
    """True if ``channel`` exists in ``data_dir``. A missing data directory
    raises :class:`DataDirNotFoundError`, a missing channel
    :class:`ChannelNotFoundError` (a misspelled path must not read as an
    empty channel); with ``allow_missing`` both return False instead."""
    from ..errors import ChannelNotFoundError, DataDirNotFoundError

    if not os.path.isdir(data_dir):
        if os.path.exists(data_dir):  # a file: not a missing directory, allowMissing or not
            raise NotADirectoryError(
                f"keyop data source: data_dir {data_dir!r} is a file, not a data directory; "
                "check the option 'data_dir'"
            )
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
    """Batch read of one or more channels: everything committed when the
    read was planned (up to ``endingOffsets`` / ``endingTimestamp``)."""

    def __init__(self, spec: ReadSpec | Sequence[ReadSpec]) -> None:
        self.specs = [spec] if isinstance(spec, ReadSpec) else list(spec)
        self.spec = self.specs[0]
        self.ends = {s.channel: s.end() if s.exists() else 0 for s in self.specs}
        self.end = self.ends[self.spec.channel]

    def partitions(self) -> Sequence[InputPartition]:
        """One input partition per segment file (split further by ``max_partition_bytes``)."""
        parts: list[KeyopPartition] = []
        ranges = [(spec, spec.start(), self.ends[spec.channel]) for spec in self.specs]
        total = sum(max(0, end - start) for _, start, end in ranges)
        for spec, start, end in ranges:
            for p in spec.partitions(start, end, total):
                parts.append(KeyopPartition(len(parts), p.segment, p.start, p.end, p.channel))
        # Spark needs at least one partition; an empty range reads nothing.
        return parts or [KeyopPartition(0, 0, 0, 0, self.spec.channel)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The records of one input partition as Arrow batches."""
        assert isinstance(partition, KeyopPartition)
        if partition.end <= partition.start:
            return iter(())
        return spec_of(self.specs, partition).read(partition)


def spec_of(specs: Sequence[ReadSpec], partition: KeyopPartition) -> ReadSpec:
    """The spec of the channel ``partition`` belongs to."""
    for spec in specs:
        if spec.channel == partition.channel or not partition.channel:
            return spec
    raise ValueError(f"keyop data source: partition of unknown channel {partition.channel!r}")
