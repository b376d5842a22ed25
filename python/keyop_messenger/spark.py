"""PySpark integration: the ``keyop`` data source and :func:`publish_partitions`.

Needs pyspark 4.x (with pyarrow) and Java 17+: ``pip install 'keyop-messenger[spark]'``.

Register the data source once per session::

    from keyop_messenger import spark as kspark
    kspark.register(spark)

Batch write, one message per row (payload = the row as a JSON object)::

    (df.write.format("keyop").mode("append")
       .option("channel", "readings").option("payload_type", "demo.Reading")
       .option("config", "/etc/keyop/spark-writer.yaml")   # through a hub ...
       # .option("data_dir", "/var/lib/keyop")             # ... or a local data dir
       .save())

Batch read, one row per message, one input partition per segment file::

    df = (spark.read.format("keyop").option("data_dir", "/var/lib/keyop")
          .option("channel", "readings")
          .option("payload_schema", "sensor STRING, celsius DOUBLE")   # optional
          .load())

Streaming read and write work the same way with ``readStream`` / ``writeStream``.

Write options
    ``channel`` (required), ``payload_type`` (required; may be empty), and exactly one of:

    * ``config``: path of a YAML configuration. Every partition opens one short-lived
      :class:`~keyop_messenger.EphemeralMessenger` to ``client.hubs[0].addr`` (as
      ``name``, with the ``tls`` certificates) and publishes its rows with
      ``publish_batch`` in chunks of ``batch_size`` rows; each chunk is one frame and
      one hub commit, and returns only after the hub acknowledged it. All tasks connect
      with the same name and certificate, concurrently (the hub must keep several
      ephemeral connections of one peer open at once). The file is read and validated
      on the driver; the TLS files it names must be readable at the same paths on
      every executor. ``retries`` (default 3): a chunk whose connection is lost before
      the hub acknowledged it is sent again on a new connection, up to that many times
      in a row; the commit message counts these chunks as ``resent`` (each may have
      been stored twice).
    * ``data_dir``: a local data directory (local mode, or executors sharing the
      machine). A data directory can be open in only one messenger at a time, so each
      task opens a :class:`~keyop_messenger.Messenger` on it in turn: a task that finds
      the directory locked retries for up to ``lock_timeout_s`` (default 300) seconds.
      Tasks therefore write one after the other (use ``coalesce(1)`` to avoid the
      waiting), and no other process may keep the directory open meanwhile.
      ``name`` sets the origin (default: the host name); ``sync_interval_ms`` and
      ``compaction_threshold_mb`` are passed to the messenger's storage section.

    Optional: ``service_name``; ``correlation_id`` (one value for every message) or
    ``correlation_id_column`` (a string column whose value becomes each message's
    correlation id; the column stays in the payload); ``batch_size`` (rows per
    ``publish_batch``, default 1000); ``connect_timeout_s`` (default 10);
    ``report_path``: the driver writes there, as JSON, the per-partition counts of
    the commit messages (also on abort, with the partitions that finished).

    The save mode must be ``append`` (channels are append-only; ``overwrite`` is
    refused). A failed task fails the job: the driver raises with the partition's
    error, which says how many rows that partition had already committed. Delivery
    is at-least-once: a retried task publishes its chunks again.

Row to payload
    Each row becomes a JSON object keyed by column name, nested structs as objects,
    arrays as arrays, maps as objects (keys turned into strings). Dates are
    ``"YYYY-MM-DD"``; ``TIMESTAMP`` values are RFC 3339 UTC strings
    (``"2026-03-31T14:22:01.5Z"``, microseconds, trailing zeros trimmed);
    ``TIMESTAMP_NTZ`` values the same without the ``Z``; decimals are strings in plain
    notation (no precision lost); binary is base64; NaN and infinities are the strings
    ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (as Spark's ``to_json`` writes them);
    other types (intervals, variants, ...) use their string form. Reading with
    ``payload_schema`` turns all of these back into the Spark types.

Read options
    ``data_dir`` and ``channel`` (required). ``start_offset``: ``earliest`` (default),
    ``latest`` (streaming) or a global byte offset (e.g. a value of the ``offset``
    column; an offset inside a record moves to the next record).
    ``max_partition_bytes``: split a segment into input partitions of about this many
    bytes, cut at record boundaries (default 0: one partition per segment file).
    ``payload_schema``: a DDL field list (``"a INT, b STRUCT<c: STRING>"``); the
    ``payload`` column then is a struct of those fields parsed from the JSON (missing
    keys and values that do not fit their type are null, as with Spark's permissive
    ``from_json``; ``NOT NULL`` constraints are dropped) instead of the JSON string.

    Columns: ``id``, ``ts`` (timestamp; nanoseconds truncated to microseconds),
    ``channel``, ``origin``, ``payload_type``, ``service_name``, ``correlation_id``
    (null when absent), ``payload`` (compact JSON text, re-encoded from the stored
    value), ``segment`` (start offset of the segment file) and ``offset`` (global
    byte offset of the record, as in subscriber offset files). A schema given with
    ``.schema(...)`` must be this one. Reading never locks the directory: it works
    while a messenger (or keyop-messenger 1.4) writes it, and returns only whole
    records. It sees what retention has kept: a messenger deletes sealed segments
    that every offset file of the channel has passed.

Streaming read
    Offsets are ``{"offset": N}``, the global byte offset of the next record (segment
    start + byte position in the segment). ``latestOffset`` is the committed stream end
    (whole lines only); a micro-batch gets one input partition per segment range
    between its start and end offsets (split further by ``max_partition_bytes``).
    Restarting from the checkpoint replays an unfinished micro-batch with the same
    offsets, so the query loses nothing that is still on disk.

    ``retain_as`` (a subscriber id) makes the query hold retention like a
    subscriber: it keeps ``subscribers/<channel>/<id>.offset`` at the end of the last
    batch Spark committed to the source (written when the query starts and on each
    source commit, which Spark makes when it plans the next batch), so the writing
    messenger never deletes a segment the query still needs, also while it is
    stopped. Use an id no subscriber uses; when the query is retired, delete the
    file with ``Messenger.unsubscribe(channel, id)`` (or let
    ``subscribers.offset_ttl`` expire it). Without it, segments that retention
    deletes before a batch reads them are skipped.

Streaming write
    Same options as the batch write. At-least-once: a micro-batch whose tasks are
    retried, or that is replayed after a restart, is published again. Message ids are
    new on every attempt, but unless ``correlation_id`` or ``correlation_id_column``
    is set, every chunk carries the deterministic correlation id
    ``spark:<query id>:<batch id>:<partition id>:<chunk index>``, stable across task
    retries and restarts from the checkpoint (for a deterministic input). A chunk is
    committed all or nothing and contiguously, so a receiver drops duplicates by
    keeping only the first run of messages with a given correlation id.

Executors run the publishing and reading code in forked Python workers: the
classes here are pickled by reference and import :mod:`keyop_messenger` there;
the engine's federation runtime is created lazily per process.
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import datetime
import decimal
import itertools
import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

try:
    from pyspark.sql.datasource import (
        DataSource,
        DataSourceArrowWriter,
        DataSourceReader,
        DataSourceStreamReader,
        DataSourceStreamWriter,
        InputPartition,
        WriterCommitMessage,
    )
    from pyspark.sql.types import (
        ArrayType,
        BinaryType,
        BooleanType,
        ByteType,
        DataType,
        DateType,
        DecimalType,
        DoubleType,
        FloatType,
        IntegerType,
        LongType,
        MapType,
        NullType,
        Row,
        ShortType,
        StringType,
        StructType,
        TimestampNTZType,
        TimestampType,
    )
except ImportError as _exc:  # pragma: no cover - exercised only without pyspark
    raise ImportError(
        "keyop_messenger.spark needs pyspark 4.x with pyarrow "
        "(pip install 'keyop-messenger[spark]') and Java 17 or newer"
    ) from _exc

try:  # pyspark >= 4.1
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamArrowWriterBase
except ImportError:  # pragma: no cover - pyspark 4.0
    _StreamArrowWriterBase = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark.sql import DataFrame, SparkSession

    from .config import Config

__all__ = [
    "ENVELOPE_COLUMNS",
    "KeyopDataSource",
    "PartitionCommit",
    "publish_partitions",
    "register",
]

log = logging.getLogger("keyop_messenger.spark")

#: Name of the data source (``spark.read.format("keyop")``).
SOURCE_NAME = "keyop"
#: The columns of a read, in order.
ENVELOPE_COLUMNS = (
    "id",
    "ts",
    "channel",
    "origin",
    "payload_type",
    "service_name",
    "correlation_id",
    "payload",
    "segment",
    "offset",
)
_ENVELOPE_DDL = (
    "id STRING, ts TIMESTAMP, channel STRING, origin STRING, payload_type STRING, "
    "service_name STRING, correlation_id STRING, payload {payload}, segment BIGINT, "
    "`offset` BIGINT"
)
DEFAULT_BATCH_SIZE = 1000
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_RETRIES = 3
DEFAULT_LOCK_TIMEOUT_S = 300.0
_ARROW_BATCH_ROWS = 8192
_SEGMENT_RE = re.compile(r"^(\d+)\.jsonl$")
_UTC = datetime.timezone.utc
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=_UTC)
_N = TypeVar("_N", int, float)


def register(spark: SparkSession) -> None:
    """Registers the ``keyop`` data source in ``spark`` (idempotent)."""
    spark.dataSource.register(KeyopDataSource)


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------


class _Options:
    """Typed access to the data source options (keys are case-insensitive)."""

    def __init__(self, options: Any) -> None:
        self._o = {str(k).lower(): str(v) for k, v in dict(options).items()}

    def get(self, key: str, default: str | None = None) -> str | None:
        return self._o.get(key.lower(), default)

    def required(self, key: str, what: str) -> str:
        value = self.get(key)
        if value is None or value == "":
            raise ValueError(f"keyop data source: option {key!r} is required ({what})")
        return value

    def number(self, key: str, default: float, *, minimum: float = 0.0) -> float:
        return self._parsed(key, default, float, "a number", minimum)

    def integer(self, key: str, default: int, *, minimum: int = 0) -> int:
        return self._parsed(key, default, int, "an integer", minimum)

    def _parsed(
        self, key: str, default: _N, parse: Callable[[str], _N], kind: str, minimum: _N
    ) -> _N:
        """The option read by ``parse`` (``default`` when unset or empty);
        raises unless it is ``kind``, finite and at least ``minimum``."""
        text = self.get(key)
        if text is None or text == "":
            return default
        try:
            value = parse(text)
        except ValueError:
            raise ValueError(
                f"keyop data source: option {key!r} must be {kind}, got {text!r}"
            ) from None
        if (isinstance(value, float) and not math.isfinite(value)) or value < minimum:
            raise ValueError(
                f"keyop data source: option {key!r} must be >= {minimum}, got {text!r}"
            )
        return value


# ---------------------------------------------------------------------------
# The data source
# ---------------------------------------------------------------------------


class KeyopDataSource(DataSource):
    """The ``keyop`` data source: read, write and stream keyop-messenger channels.

    See the module documentation for the options."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        payload_schema = _Options(self.options).get("payload_schema")
        if payload_schema and payload_schema.strip():
            return _ENVELOPE_DDL.format(payload=f"STRUCT<{nullable_ddl(payload_schema)}>")
        return _ENVELOPE_DDL.format(payload="STRING")

    def reader(self, schema: StructType) -> DataSourceReader:
        spec = _ReadSpec.from_options(self.options, schema)
        if spec.retain_as is not None:
            raise ValueError("keyop data source: option 'retain_as' applies to streaming reads")
        return _BatchReader(spec)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _StreamReader(_ReadSpec.from_options(self.options, schema))

    def writer(self, schema: StructType, overwrite: bool) -> _BatchWriter:
        if overwrite:
            raise ValueError("keyop data source: channels are append-only; use mode('append')")
        return _BatchWriter(_WriteSpec.from_options(self.options, schema, streaming=False))

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        if overwrite:
            raise ValueError(
                "keyop data source: channels are append-only; use outputMode('append')"
            )
        spec = _WriteSpec.from_options(self.options, schema, streaming=True)
        if _StreamArrowWriterBase is not None:
            return _StreamArrowWriter(spec)
        return _StreamRowWriter(spec)  # pragma: no cover - pyspark 4.0


_NOT_NULL_RE = re.compile(r"\s+NOT\s+NULL\b", re.IGNORECASE)


def nullable_ddl(ddl: str) -> str:
    """``ddl`` without its ``NOT NULL`` constraints (outside quotes and
    backquotes): any payload key may be missing, so every field is nullable."""
    out: list[str] = []
    plain: list[str] = []
    quote: str | None = None
    for ch in ddl:
        if quote is None:
            if ch in "`'\"":
                out.append(_NOT_NULL_RE.sub("", "".join(plain)))
                plain.clear()
                quote = ch
                out.append(ch)
            else:
                plain.append(ch)
        else:
            out.append(ch)
            if ch == quote:
                quote = None
    out.append(_NOT_NULL_RE.sub("", "".join(plain)))
    return "".join(out)


# ---------------------------------------------------------------------------
# Reading: segment files, stream end, planning
# ---------------------------------------------------------------------------


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
    ``max_partition_bytes`` when that is > 0."""
    if end <= start:
        return []
    segments = list_segments(data_dir, channel)
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
class _ReadSpec:
    data_dir: str
    channel: str
    start_offset: str
    max_partition_bytes: int
    schema: StructType
    retain_as: str | None = None

    @classmethod
    def from_options(cls, options: Any, schema: StructType) -> _ReadSpec:
        o = _Options(options)
        # Absolute, resolved on the driver: executors may run in another directory.
        data_dir = os.path.abspath(o.required("data_dir", "the data directory to read"))
        channel = o.required("channel", "the channel to read")
        start = (o.get("start_offset") or "earliest").strip().lower()
        if start not in ("earliest", "latest"):
            try:
                if int(start) < 0:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    "keyop data source: option 'start_offset' must be 'earliest', 'latest' "
                    f"or a byte offset >= 0, got {start!r}"
                ) from None
        check_channel(channel, publish=False)
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
        )

    def start(self) -> int:
        if self.start_offset == "earliest":
            return 0
        if self.start_offset == "latest":
            return stream_end(self.data_dir, self.channel)
        return align_offset(self.data_dir, self.channel, int(self.start_offset))

    def partitions(self, start: int, end: int) -> list[KeyopPartition]:
        return plan_partitions(self.data_dir, self.channel, start, end, self.max_partition_bytes)

    def read(self, partition: KeyopPartition) -> Iterator[pa.RecordBatch]:
        return _read_partition(self.data_dir, self.channel, partition, self.schema)


def _read_partition(
    data_dir: str, channel: str, partition: KeyopPartition, schema: StructType
) -> Iterator[pa.RecordBatch]:
    """Yields the records of ``partition`` as Arrow batches of ``schema``."""
    import pyarrow as pa

    from . import _core

    arrow_schema = _arrow_schema(schema)
    payload_field = schema["payload"]
    parse = (
        None
        if isinstance(payload_field.dataType, StringType)
        else _json_to_spark(payload_field.dataType)
    )
    convert = (
        json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=True).encode
        if parse is None
        else parse
    )
    types = [arrow_schema.field(i).type for i in range(len(arrow_schema))]
    records: Iterator[Any] = _core.read_channel(data_dir, channel, partition.start)
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


class _BatchReader(DataSourceReader):
    def __init__(self, spec: _ReadSpec) -> None:
        self.spec = spec
        self.end = stream_end(spec.data_dir, spec.channel)

    def partitions(self) -> Sequence[InputPartition]:
        parts = self.spec.partitions(self.spec.start(), self.end)
        # Spark needs at least one partition; an empty range reads nothing.
        return parts or [KeyopPartition(0, 0, 0, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KeyopPartition)
        if partition.end <= partition.start:
            return iter(())
        return self.spec.read(partition)


def _offset_of(offset: dict[str, Any] | None) -> int:
    if not offset:
        return 0
    return int(offset["offset"])


def check_subscriber_id(subscriber_id: str) -> None:
    """Raises :class:`InvalidNameError` unless ``subscriber_id`` may name a
    local subscriber (the channel-name rule, at most 244 bytes, no ``fed-`` or
    ``hub-`` prefix)."""
    from . import _core
    from .errors import InvalidNameError

    _core.validate_channel(subscriber_id)
    if subscriber_id.startswith(("fed-", "hub-")):
        raise InvalidNameError(
            f"invalid subscriber id {subscriber_id!r}: ids starting with 'fed-' or 'hub-' are "
            "reserved for federation cursors"
        )
    if len(subscriber_id.encode()) > 255 - len(".offset.tmp"):
        raise InvalidNameError(f"invalid subscriber id {subscriber_id!r}: too long")


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


class _StreamReader(DataSourceStreamReader):
    def __init__(self, spec: _ReadSpec) -> None:
        self.spec = spec

    def _retain(self, offset: int) -> None:
        if self.spec.retain_as is not None:
            write_offset_file(self.spec.data_dir, self.spec.channel, self.spec.retain_as, offset)

    def initialOffset(self) -> dict[str, int]:
        start = self.spec.start()
        self._retain(start)
        return {"offset": start}

    # Works with both signatures: latestOffset() (pyspark < 4.2) and
    # latestOffset(start, limit); every limit is read as "all available".
    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: Any = None
    ) -> dict[str, int]:
        end = stream_end(self.spec.data_dir, self.spec.channel)
        if start is not None:
            end = max(end, _offset_of(start))
        return {"offset": end}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return self.spec.partitions(_offset_of(start), _offset_of(end))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KeyopPartition)
        return self.spec.read(partition)

    def commit(self, end: dict[str, Any]) -> None:
        self._retain(_offset_of(end))


# ---------------------------------------------------------------------------
# JSON payload -> Spark values (payload_schema)
# ---------------------------------------------------------------------------

_TS_RE = re.compile(
    r"^(\d{4})-(\d\d)-(\d\d)(?:[Tt ](\d\d):(\d\d)(?::(\d\d)(?:\.(\d+))?)?)?"
    r"\s*(Z|z|[+-]\d\d(?::?\d\d)?)?$"
)


def _parse_timestamp(text: str, *, keep_zone: bool) -> datetime.datetime | None:
    """RFC 3339 / ISO 8601 text (any number of fraction digits, ``Z`` or an
    offset; no zone means UTC) to a datetime: aware UTC with ``keep_zone``,
    else the naive wall-clock time."""
    m = _TS_RE.match(text.strip())
    if not m:
        return None
    year, month, day, hh, mm, ss, frac, zone = m.groups()
    micros = int((frac or "0")[:6].ljust(6, "0"))
    try:
        dt = datetime.datetime(
            int(year), int(month), int(day), int(hh or 0), int(mm or 0), int(ss or 0), micros
        )
    except ValueError:
        return None
    if not keep_zone:
        return dt
    if zone and zone not in ("Z", "z"):
        sign = 1 if zone[0] == "+" else -1
        digits = zone[1:].replace(":", "")
        delta = datetime.timedelta(hours=int(digits[:2]), minutes=int(digits[2:4] or 0))
        dt = dt.replace(tzinfo=datetime.timezone(sign * delta))
        return dt.astimezone(_UTC)
    return dt.replace(tzinfo=_UTC)


_INT_RANGES = {
    ByteType: (-(2**7), 2**7 - 1),
    ShortType: (-(2**15), 2**15 - 1),
    IntegerType: (-(2**31), 2**31 - 1),
    LongType: (-(2**63), 2**63 - 1),
}
_SPECIAL_FLOATS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf,
                   "+Infinity": math.inf, "inf": math.inf, "-inf": -math.inf}  # fmt: skip


def _json_to_spark(dtype: DataType) -> Callable[[Any], Any]:
    """A function turning a JSON value into a Python value Arrow accepts for
    ``dtype``; values that do not fit become ``None``."""
    if isinstance(dtype, StructType):
        fields = [(f.name, _json_to_spark(f.dataType)) for f in dtype.fields]

        def struct(v: Any) -> Any:
            if not isinstance(v, dict):
                return None
            return {name: conv(v.get(name)) for name, conv in fields}

        return struct
    if isinstance(dtype, ArrayType):
        elem = _json_to_spark(dtype.elementType)
        return lambda v: [elem(x) for x in v] if isinstance(v, list) else None
    if isinstance(dtype, MapType):
        key = _json_to_spark(dtype.keyType)
        val = _json_to_spark(dtype.valueType)

        def mapping(v: Any) -> Any:
            if not isinstance(v, dict):
                return None
            out = []
            for k, x in v.items():
                kk = key(k)
                if kk is not None:
                    out.append((kk, val(x)))
            return out

        return mapping
    if isinstance(dtype, StringType):
        return lambda v: (
            v
            if isinstance(v, str) or v is None
            else json.dumps(v, ensure_ascii=False, separators=(",", ":"))
        )
    if isinstance(dtype, BooleanType):
        return lambda v: v if isinstance(v, bool) else None
    for cls, (lo, hi) in _INT_RANGES.items():
        if isinstance(dtype, cls):

            def integer(v: Any, lo: int = lo, hi: int = hi) -> Any:
                if isinstance(v, bool) or v is None:
                    return None
                try:
                    if isinstance(v, float):
                        if not v.is_integer():
                            return None
                        v = int(v)
                    elif isinstance(v, str):
                        v = int(v.strip())
                    elif not isinstance(v, int):
                        return None
                except (ValueError, OverflowError):
                    return None
                return v if lo <= v <= hi else None

            return integer
    if isinstance(dtype, (FloatType, DoubleType)):

        def floating(v: Any) -> Any:
            if isinstance(v, bool) or v is None:
                return None
            if isinstance(v, (int, float)):
                return float(v)
            if isinstance(v, str):
                if v in _SPECIAL_FLOATS:
                    return _SPECIAL_FLOATS[v]
                try:
                    return float(v)
                except ValueError:
                    return None
            return None

        return floating
    if isinstance(dtype, DecimalType):
        quantum = decimal.Decimal(1).scaleb(-dtype.scale)
        limit = decimal.Decimal(10) ** (dtype.precision - dtype.scale)

        def dec(v: Any) -> Any:
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                return None
            try:
                d = decimal.Decimal(str(v).strip()).quantize(
                    quantum, rounding=decimal.ROUND_HALF_UP
                )
            except (decimal.InvalidOperation, ValueError):
                return None
            return d if d.is_finite() and abs(d) < limit else None

        return dec
    if isinstance(dtype, DateType):

        def date(v: Any) -> Any:
            if not isinstance(v, str):
                return None
            dt = _parse_timestamp(v, keep_zone=False)
            return dt.date() if dt is not None else None

        return date
    if isinstance(dtype, TimestampType):

        def timestamp(v: Any) -> Any:
            if isinstance(v, str):
                return _parse_timestamp(v, keep_zone=True)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                try:
                    return _EPOCH + datetime.timedelta(seconds=v)
                except OverflowError:
                    return None
            return None

        return timestamp
    if isinstance(dtype, TimestampNTZType):
        return lambda v: _parse_timestamp(v, keep_zone=False) if isinstance(v, str) else None
    if isinstance(dtype, BinaryType):

        def binary(v: Any) -> Any:
            if not isinstance(v, str):
                return None
            try:
                return base64.b64decode(v, validate=True)
            except ValueError:
                return None

        return binary
    return lambda v: None  # NullType and types JSON cannot carry


# ---------------------------------------------------------------------------
# Spark values -> JSON payload
# ---------------------------------------------------------------------------


def _float_to_json(v: Any) -> Any:
    if v is None or math.isfinite(v):
        return v
    if math.isnan(v):
        return "NaN"
    return "Infinity" if v > 0 else "-Infinity"


def _wall_clock(dt: datetime.datetime) -> str:
    text = (
        f"{dt.year:04d}-{dt.month:02d}-{dt.day:02d}T{dt.hour:02d}:{dt.minute:02d}:{dt.second:02d}"
    )
    if dt.microsecond:
        text += f".{dt.microsecond:06d}".rstrip("0")
    return text


def format_timestamp(value: datetime.datetime) -> str:
    """RFC 3339 UTC text of a ``TIMESTAMP`` value (a naive value is local
    time, as PySpark hands them out), microseconds trimmed of trailing zeros."""
    return _wall_clock(value.astimezone(_UTC)) + "Z"


def _timestamp_to_json(v: Any) -> Any:
    return None if v is None else format_timestamp(v)


def _timestamp_ntz_to_json(v: Any) -> Any:
    return None if v is None else _wall_clock(v)


def _date_to_json(v: Any) -> Any:
    return None if v is None else v.isoformat()


def _decimal_to_json(v: Any) -> Any:
    return None if v is None else format(v, "f")


def _binary_to_json(v: Any) -> Any:
    return None if v is None else base64.b64encode(bytes(v)).decode("ascii")


def _key_to_json(k: Any) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, bool):
        return "true" if k else "false"
    if isinstance(k, float):
        return str(_float_to_json(k))
    if isinstance(k, datetime.datetime):
        return k.isoformat()
    if isinstance(k, (datetime.date, decimal.Decimal)):
        return k.isoformat() if isinstance(k, datetime.date) else format(k, "f")
    return str(k)


def _other_to_json(v: Any) -> Any:
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    if isinstance(v, datetime.timedelta):
        return str(v)
    return str(v)


_Conv = Callable[[Any], Any]


def _spark_to_json(dtype: DataType) -> _Conv | None:
    """A function turning a value of ``dtype`` (as PySpark or pyarrow hands
    it out) into JSON-ready data, or ``None`` when the value already is."""
    if isinstance(dtype, StructType):
        fields = [(f.name, _spark_to_json(f.dataType)) for f in dtype.fields]
        names = [n for n, _ in fields]

        def struct(v: Any) -> Any:
            if v is None:
                return None
            if isinstance(v, Row):
                v = dict(zip(names, v, strict=False))
            elif not isinstance(v, dict):
                v = dict(zip(names, v, strict=False))
            return {n: (c(v.get(n)) if c is not None else v.get(n)) for n, c in fields}

        return struct
    if isinstance(dtype, ArrayType):
        elem = _spark_to_json(dtype.elementType)
        if elem is None:
            return lambda v: None if v is None else list(v)
        return lambda v: None if v is None else [elem(x) for x in v]
    if isinstance(dtype, MapType):
        val = _spark_to_json(dtype.valueType)

        def mapping(v: Any) -> Any:
            if v is None:
                return None
            items = v.items() if isinstance(v, dict) else v
            if val is None:
                return {_key_to_json(k): x for k, x in items}
            return {_key_to_json(k): val(x) for k, x in items}

        return mapping
    if isinstance(dtype, (FloatType, DoubleType)):
        return _float_to_json
    if isinstance(dtype, TimestampType):
        return _timestamp_to_json
    if isinstance(dtype, TimestampNTZType):
        return _timestamp_ntz_to_json
    if isinstance(dtype, DateType):
        return _date_to_json
    if isinstance(dtype, DecimalType):
        return _decimal_to_json
    if isinstance(dtype, BinaryType):
        return _binary_to_json
    if isinstance(
        dtype,
        (StringType, BooleanType, ByteType, ShortType, IntegerType, LongType, NullType),
    ):
        return None
    return _other_to_json


_UNCHANGED: Any = object()


def _arrow_column_to_json(col: Any, dtype: DataType) -> Any:
    """``col`` converted to its JSON form by Arrow kernels, ``_UNCHANGED`` if
    it needs no conversion, or ``None`` when Python must convert it."""
    import pyarrow as pa
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    try:
        if isinstance(dtype, (FloatType, DoubleType)):
            finite = pc.all(pc.is_finite(col)).as_py()
            return _UNCHANGED if finite in (True, None) else None
        if isinstance(dtype, DateType):
            return col.cast(pa.string())
        if isinstance(dtype, DecimalType):
            text = col.cast(pa.string())
            # Arrow writes tiny values as 1E-30; JSON gets plain notation.
            return None if pc.any(pc.match_substring(text, "E")).as_py() else text
        if isinstance(dtype, (TimestampType, TimestampNTZType)):
            if isinstance(dtype, TimestampType):
                if getattr(col.type, "tz", None) is None:
                    return None  # a naive TIMESTAMP is local time: Python knows the zone
                col = col.cast(pa.timestamp("us", tz="UTC"))
            else:
                col = col.cast(pa.timestamp("us"))
            text = pc.strftime(col, format="%Y-%m-%dT%H:%M:%S")  # seconds with 6 decimals
            text = pc.replace_substring_regex(text, pattern=r"(\.\d*?)0+$", replacement=r"\1")
            text = pc.replace_substring_regex(text, pattern=r"\.$", replacement="")
            if isinstance(dtype, TimestampType):
                text = pc.binary_join_element_wise(text, pa.scalar("Z"), "")
            return text
    except (pa.ArrowException, ValueError, TypeError):
        return None
    return None


class RowEncoder:
    """Turns rows of a schema into payload dicts (see the module docs)."""

    def __init__(self, schema: StructType) -> None:
        names = schema.fieldNames()
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"keyop data source: duplicate column names {dupes}: a payload is a JSON "
                "object, so column names must be unique"
            )
        self.names = names
        self.schema = schema
        self.convs = [(f.name, _spark_to_json(f.dataType)) for f in schema.fields]
        self.active = [(n, c) for n, c in self.convs if c is not None]

    def __reduce__(self) -> tuple[Any, ...]:
        return (RowEncoder, (self.schema,))

    def from_arrow(self, batch: pa.RecordBatch) -> list[dict[str, Any]]:
        # Top-level timestamps, dates, decimals and floats are converted by
        # Arrow compute kernels (several times faster than per value).
        fix: list[tuple[str, _Conv]] = []
        for i, (name, conv) in enumerate(self.convs):
            if conv is None:
                continue
            done = _arrow_column_to_json(batch.column(i), self.schema.fields[i].dataType)
            if done is None:
                fix.append((name, conv))
            elif done is not _UNCHANGED:
                batch = batch.set_column(i, name, done)
        rows: list[dict[str, Any]] = batch.to_pylist()
        for name, conv in fix:
            for r in rows:
                r[name] = conv(r[name])
        return rows

    def from_row(self, row: Any) -> dict[str, Any]:
        d = dict(zip(self.names, row, strict=False))
        for name, conv in self.active:
            d[name] = conv(d[name])
        return d


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class PartitionCommit(WriterCommitMessage):
    """What one task published (the commit message of a write task)."""

    partition_id: int
    attempt: int
    rows: int
    batches: int
    first_id: str | None = None
    last_id: str | None = None
    batch_id: int | None = None
    resent: int = 0
    """Chunks sent again after a lost connection (each may be stored twice)."""


@dataclasses.dataclass(frozen=True)
class _WriteSpec:
    channel: str
    payload_type: str
    config: Config | None
    data_dir: str | None
    name: str
    storage: dict[str, int]
    service_name: str | None
    correlation_id: str | None
    correlation_id_column: str | None
    batch_size: int
    connect_timeout_s: float
    retries: int
    lock_timeout_s: float
    report_path: str | None
    encoder: RowEncoder
    streaming: bool

    @classmethod
    def from_options(cls, options: Any, schema: StructType, *, streaming: bool) -> _WriteSpec:
        from .config import load_config

        o = _Options(options)
        channel = o.required("channel", "the channel to publish to")
        check_channel(channel, publish=True)
        payload_type = o.get("payload_type")
        if payload_type is None:
            raise ValueError(
                "keyop data source: option 'payload_type' is required (it may be empty)"
            )
        config_path, data_dir = o.get("config") or None, o.get("data_dir") or None
        if data_dir is not None:
            data_dir = os.path.abspath(data_dir)  # executors may run in another directory
        if (config_path is None) == (data_dir is None):
            raise ValueError(
                "keyop data source: give exactly one of the options 'config' (publish through "
                "the hub named in that YAML file) and 'data_dir' (publish into a local data "
                "directory)"
            )
        config = load_config(config_path) if config_path is not None else None
        if config is not None and not config.client.hubs:
            raise ValueError(
                f"keyop data source: {config_path}: client.hubs must name the hub to publish to"
            )
        storage: dict[str, int] = {}
        for key in ("sync_interval_ms", "compaction_threshold_mb"):
            if o.get(key):
                storage[key] = o.integer(key, 0, minimum=-(2**31))
        column = o.get("correlation_id_column") or None
        if column is not None:
            field = next((f for f in schema.fields if f.name == column), None)
            if field is None:
                raise ValueError(
                    f"keyop data source: correlation_id_column {column!r} is not a column "
                    f"(columns: {schema.fieldNames()})"
                )
            if not isinstance(field.dataType, StringType):
                raise ValueError(
                    f"keyop data source: correlation_id_column {column!r} must be a string "
                    f"column, not {field.dataType.simpleString()}"
                )
        return cls(
            channel=channel,
            payload_type=payload_type,
            config=config,
            data_dir=data_dir,
            name=o.get("name") or _host_name(),
            storage=storage,
            service_name=o.get("service_name") or None,
            correlation_id=o.get("correlation_id") or None,
            correlation_id_column=column,
            batch_size=o.integer("batch_size", DEFAULT_BATCH_SIZE, minimum=1),
            connect_timeout_s=o.number("connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S),
            retries=o.integer("retries", DEFAULT_RETRIES),
            lock_timeout_s=o.number("lock_timeout_s", DEFAULT_LOCK_TIMEOUT_S),
            report_path=o.get("report_path") or None,
            encoder=RowEncoder(schema),
            streaming=streaming,
        )

    def target(self) -> _Target:
        if self.config is not None:
            return _HubTarget(self.config, self.connect_timeout_s, self.retries)
        assert self.data_dir is not None
        return _DirTarget(self.data_dir, self.name, self.storage, self.lock_timeout_s)


def _host_name() -> str:
    try:
        return socket.gethostname() or "spark"
    except OSError:
        return "spark"


def check_channel(channel: str, *, publish: bool) -> None:
    """Raises :class:`InvalidNameError` if ``channel`` is not a valid channel
    name (the engine's rule)."""
    from . import _core
    from .errors import InvalidNameError

    _core.validate_channel(channel)
    if publish and channel.endswith(".dead-letter"):
        raise InvalidNameError(f"cannot publish to dead-letter channel {channel!r}")


class _Target:
    """Where a task publishes: a hub (ephemeral client) or a local data dir."""

    def publish_batch(
        self,
        channel: str,
        items: list[tuple[str, Any]],
        service_name: str | None,
        correlation_id: str | None,
    ) -> list[str]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _HubTarget(_Target):
    """One ephemeral client; a chunk whose connection is lost before the hub
    acknowledged it is sent again on a new connection, up to ``retries``
    times in a row (it may then be stored twice: at-least-once)."""

    def __init__(self, config: Config, connect_timeout_s: float, retries: int) -> None:
        self.config = config
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.resent = 0
        self.client: Any = None
        self._with_retries(lambda: None)

    def _open(self) -> None:
        from .ephemeral import EphemeralMessenger

        client = EphemeralMessenger(self.config)
        try:
            client.connect(self.connect_timeout_s)
        except BaseException:
            client.close()
            raise
        self.client = client

    def _with_retries(self, op: Callable[[], Any]) -> Any:
        from .errors import ConnectionLostError

        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                if self.client is None:
                    self._open()
                return op()
            except ConnectionLostError as exc:
                self.close()
                if attempt == self.retries:
                    raise
                log.warning("keyop: %s; retrying in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")  # pragma: no cover

    def publish_batch(
        self,
        channel: str,
        items: list[tuple[str, Any]],
        service_name: str | None,
        correlation_id: str | None,
    ) -> list[str]:
        sent = [False]

        def op() -> list[str]:
            if sent[0]:
                self.resent += 1
            sent[0] = True
            return list(
                self.client.publish_batch(
                    channel, items, service_name=service_name, correlation_id=correlation_id
                )
            )

        result: list[str] = self._with_retries(op)
        return result

    def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            client.close()


class _DirTarget(_Target):
    def __init__(
        self, data_dir: str, name: str, storage: dict[str, int], lock_timeout_s: float
    ) -> None:
        from .config import Config
        from .errors import DataDirLockedError
        from .messenger import Messenger

        config = Config.from_dict({"name": name, "storage": {"data_dir": data_dir, **storage}})
        deadline = time.monotonic() + lock_timeout_s
        delay = 0.02
        while True:
            try:
                self.messenger = Messenger(config)
                return
            except DataDirLockedError as exc:
                if time.monotonic() >= deadline:
                    raise DataDirLockedError(
                        f"{exc} (waited {lock_timeout_s:g} s: lock_timeout_s; with the "
                        "data_dir option tasks take turns, so coalesce the DataFrame or "
                        "raise lock_timeout_s)"
                    ) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def publish_batch(
        self,
        channel: str,
        items: list[tuple[str, Any]],
        service_name: str | None,
        correlation_id: str | None,
    ) -> list[str]:
        return self.messenger.publish_batch(
            channel, items, service_name=service_name, correlation_id=correlation_id
        )

    def close(self) -> None:
        self.messenger.close()


class PartitionError(RuntimeError):
    """A write task failed; says how much of its partition was committed."""


def _chunks(
    payloads: Iterable[dict[str, Any]], size: int, column: str | None
) -> Iterator[tuple[list[dict[str, Any]], str | None]]:
    """Splits ``payloads`` into runs of at most ``size`` rows that share the
    correlation id in ``column`` (one run if ``column`` is None)."""
    chunk: list[dict[str, Any]] = []
    key: str | None = None
    for p in payloads:
        k = p.get(column) if column is not None else None
        if chunk and (len(chunk) >= size or k != key):
            yield chunk, key
            chunk = []
        key = k
        chunk.append(p)
    if chunk:
        yield chunk, key


def _task_info() -> tuple[int, int, int | None, str | None]:
    """(partition id, attempt, streaming batch id, streaming query id) of the
    running task."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return 0, 0, None, None
    batch = ctx.getLocalProperty("streaming.sql.batchId")
    query = ctx.getLocalProperty("sql.streaming.queryId")
    return (
        ctx.partitionId(),
        ctx.attemptNumber(),
        int(batch) if batch not in (None, "") else None,
        query or None,
    )


def publish_payloads(spec: _WriteSpec, payloads: Iterable[dict[str, Any]]) -> PartitionCommit:
    """Publishes ``payloads`` (this task's rows) as ``spec`` says; returns the
    task's commit message. Opens the target lazily: an empty partition
    connects to nothing."""
    partition, attempt, batch_id, query_id = _task_info()
    commit = PartitionCommit(partition, attempt, 0, 0, batch_id=batch_id)
    target: _Target | None = None
    auto_corr = (
        spec.streaming and spec.correlation_id is None and spec.correlation_id_column is None
    )
    try:
        for index, (chunk, key) in enumerate(
            _chunks(payloads, spec.batch_size, spec.correlation_id_column)
        ):
            if target is None:
                target = spec.target()
            if spec.correlation_id_column is not None:
                corr = key
            elif auto_corr:
                corr = f"spark:{query_id or 'query'}:{batch_id}:{partition}:{index}"
            else:
                corr = spec.correlation_id
            items = [(spec.payload_type, p) for p in chunk]
            ids = target.publish_batch(spec.channel, items, spec.service_name, corr)
            if ids:
                commit.first_id = commit.first_id or ids[0]
                commit.last_id = ids[-1]
            commit.rows += len(ids)
            commit.batches += 1
    except Exception as exc:
        where = "" if batch_id is None else f" of micro-batch {batch_id}"
        raise PartitionError(
            f"keyop: partition {partition}{where} (attempt {attempt}) failed after "
            f"committing {commit.rows} rows in {commit.batches} batches to channel "
            f"{spec.channel!r}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        if target is not None:
            commit.resent = getattr(target, "resent", 0)
            target.close()
    return commit


def _report(
    spec: _WriteSpec,
    messages: Sequence[WriterCommitMessage | None],
    *,
    aborted: bool,
    batch_id: int | None = None,
) -> None:
    done = [m for m in messages if isinstance(m, PartitionCommit)]
    total = sum(m.rows for m in done)
    log.info(
        "keyop write to %r %s: %d rows from %d of %d partitions",
        spec.channel,
        "aborted" if aborted else "committed",
        total,
        len(done),
        len(messages),
    )
    if spec.report_path is None:
        return
    report = {
        "channel": spec.channel,
        "status": "aborted" if aborted else "committed",
        "batch_id": batch_id,
        "rows": total,
        "partitions": [dataclasses.asdict(m) for m in done],
        "failed_partitions": len(messages) - len(done),
    }
    path = spec.report_path
    if batch_id is not None and "{batch_id}" in path:
        path = path.replace("{batch_id}", str(batch_id))
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def _publish_arrow(spec: _WriteSpec, batches: Iterable[pa.RecordBatch]) -> PartitionCommit:
    """Publishes this task's Arrow batches, one payload per row."""
    encoder = spec.encoder
    return publish_payloads(spec, (p for batch in batches for p in encoder.from_arrow(batch)))


def _publish_rows(spec: _WriteSpec, rows: Iterable[Row]) -> PartitionCommit:
    """Publishes this task's Rows, one payload per row."""
    encoder = spec.encoder
    return publish_payloads(spec, (encoder.from_row(r) for r in rows))


class _BatchWriter(DataSourceArrowWriter):
    def __init__(self, spec: _WriteSpec) -> None:
        self.spec = spec

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PartitionCommit:
        return _publish_arrow(self.spec, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _report(self.spec, messages, aborted=False)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        _report(self.spec, messages, aborted=True)


class _StreamRowWriter(DataSourceStreamWriter):
    def __init__(self, spec: _WriteSpec) -> None:
        self.spec = spec

    def write(self, iterator: Iterator[Row]) -> PartitionCommit:
        return _publish_rows(self.spec, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _report(self.spec, messages, aborted=False, batch_id=batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _report(self.spec, messages, aborted=True, batch_id=batchId)


if _StreamArrowWriterBase is not None:

    class _StreamArrowWriter(_StreamArrowWriterBase):
        def __init__(self, spec: _WriteSpec) -> None:
            self.spec = spec

        def write(self, iterator: Iterator[pa.RecordBatch]) -> PartitionCommit:
            return _publish_arrow(self.spec, iterator)

        def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
            _report(self.spec, messages, aborted=False, batch_id=batchId)

        def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
            _report(self.spec, messages, aborted=True, batch_id=batchId)


# ---------------------------------------------------------------------------
# publish_partitions: for jobs that do not use the data source
# ---------------------------------------------------------------------------


def publish_partitions(
    df: DataFrame,
    channel: str,
    payload_type: str,
    config_path: str | os.PathLike[str],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    service_name: str | None = None,
    correlation_id: str | None = None,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    retries: int = DEFAULT_RETRIES,
) -> int:
    """Publishes every row of ``df`` to ``channel`` through the hub of the
    configuration at ``config_path``, with ``df.foreachPartition``: each
    partition uses one ephemeral client and ``publish_batch`` in chunks of
    ``batch_size`` rows (payload = the row as a JSON object, as with the data
    source). Returns the number of rows published (counted with an
    accumulator, so classic PySpark only, not Spark Connect). Raises if a
    partition fails (rows committed before the failure stay published)."""
    from .config import load_config

    check_channel(channel, publish=True)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    config = load_config(config_path)  # fails fast, on the driver
    if not config.client.hubs:
        raise ValueError(f"{config_path}: client.hubs must name the hub to publish to")
    spec = _WriteSpec(
        channel=channel,
        payload_type=payload_type,
        config=config,
        data_dir=None,
        name=config.name,
        storage={},
        service_name=service_name,
        correlation_id=correlation_id,
        correlation_id_column=None,
        batch_size=batch_size,
        connect_timeout_s=connect_timeout_s,
        retries=retries,
        lock_timeout_s=0.0,
        report_path=None,
        encoder=RowEncoder(df.schema),
        streaming=False,
    )
    counter = df.sparkSession.sparkContext.accumulator(0)
    # Only picklable values are captured: the spec (dataclasses) and the accumulator.
    df.foreachPartition(_PartitionPublisher(spec, counter))
    return int(counter.value)


class _PartitionPublisher:
    """The picklable function ``publish_partitions`` runs on every partition."""

    def __init__(self, spec: _WriteSpec, counter: Any) -> None:
        self.spec = spec
        self.counter = counter

    def __call__(self, rows: Iterable[Row]) -> None:
        commit = _publish_rows(self.spec, rows)
        self.counter.add(commit.rows)
