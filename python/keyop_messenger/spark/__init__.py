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
      machine). A data directory can be open in only one messenger at a time, so tasks
      take turns on it: the task holding it appends as its rows come, the others
      encode their rows meanwhile (up to 256 MiB of Arrow data each), and the holder
      gives the directory up after 0.1 s when another task waits. A task that cannot
      get the directory waits for up to ``lock_timeout_s`` (default 300) seconds.
      ``name`` sets the origin (default: the host name); ``sync_interval_ms``
      (default 1000) and ``segment_size_mb`` (or its deprecated name
      ``compaction_threshold_mb``) are passed to the messenger's storage section.
      Each task fsyncs once more when its rows are written, before it reports them
      committed (``sync_interval_ms=0``: every chunk is fsynced too).

    Optional: ``service_name``; ``correlation_id`` (one value for every message) or
    ``correlation_id_column`` (a string column whose value becomes each message's
    correlation id; the column stays in the payload); ``batch_size`` (rows per
    chunk, default 1000); ``connect_timeout_s`` (default 10);
    ``report_path``: the driver writes there, as JSON, the per-partition counts of
    the commit messages (also on abort, with the partitions that finished).

    The save mode must be ``append`` (channels are append-only; ``overwrite`` is
    refused). A failed task fails the job: the driver raises with the partition's
    error, which says how many rows that partition had already committed.

    Exactly once (for a deterministic input: the same rows in the same order in
    every attempt of a task): row ``i`` of partition ``p`` is published with the
    message id ``<job>:<p>:<i>``, where ``<job>`` is made once per write job (on
    the driver); every attempt of a task, retried or speculative, writes the same
    ids. Through a hub, the hub drops a record whose id it saw recently (its
    ``dedup.seen_id_lru_size`` most recent ids, while it runs). Into a
    ``data_dir``, a task first reads its progress file
    ``<data_dir>/spark-progress/<job>/<partition>.json`` (``{"rows", "offset"}``,
    written under the directory lock before the first chunk and after each
    committed chunk), scans the channel from that offset for ids of its job and
    partition, and resumes after the last row found; the job's folder is removed
    when the job commits (or, for a batch job, aborts).

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
    ``data_dir`` and ``channel`` (required; ``channel`` may name several channels
    separated by commas, read together: the ``channel`` column tells them apart).
    ``start_offset``: ``earliest`` (default),
    ``latest`` (streaming) or a global byte offset (e.g. a value of the ``offset``
    column; an offset inside a record moves to the next record).
    ``startingOffsets``: the same under Kafka's name (also ``-2``/``-1`` and a JSON
    object per channel, ``{"readings": 1234}``, which must name every channel read).
    ``endingOffsets`` (batch reads): ``latest`` (default), a byte offset or a JSON
    object per channel; the read stops before the first record at or after it.
    ``startingTimestamp`` / ``endingTimestamp``: milliseconds since the Unix epoch
    (as Kafka's); the read starts (ends) at the first record stamped at or after
    it, in every channel read (not together with ``startingOffsets`` /
    ``endingOffsets``; ``endingTimestamp`` for batch reads).
    ``maxOffsetsPerTrigger`` / ``maxBytesPerTrigger`` (streaming; offsets are
    bytes, so both are byte limits and the smaller applies): at most about this
    many bytes per micro-batch, shared by the channels in proportion to what each
    has to read, cut at the next record boundary (pyspark 4.2+).
    ``max_partition_bytes``: split a segment into input partitions of about this many
    bytes, cut at record boundaries (default 128 MiB; 0: one partition per segment
    file). ``minPartitions``: at least about this many input partitions (pieces of at
    most the bytes read divided by it; e.g. the number of cores).
    ``payload_schema``: a DDL field list (``"a INT, b STRUCT<c: STRING>"``); the
    ``payload`` column then is a struct of those fields parsed from the JSON (missing
    keys and values that do not fit their type are null, as with Spark's permissive
    ``from_json``; ``NOT NULL`` constraints are dropped) instead of the JSON string.
    A ``data_dir`` or ``channel`` that does not exist raises ``DataDirNotFoundError`` /
    ``ChannelNotFoundError`` when the query is planned (a typo is not an empty
    result); ``allowMissing``: ``true`` reads them as empty instead (a streaming read
    then waits for the channel to appear). Reading never creates anything.

    Columns: ``id``, ``ts`` (timestamp; nanoseconds truncated to microseconds),
    ``channel``, ``origin``, ``payload_type``, ``service_name``, ``correlation_id``
    (null when absent), ``payload`` (the stored JSON text), ``segment`` (start
    offset of the segment file) and ``offset`` (global byte offset of the record,
    as in subscriber offset files). A schema given with
    ``.schema(...)`` must be this one. Reading never locks the directory: it works
    while a messenger (or keyop-messenger 1.4) writes it, and returns only whole
    records. It sees what retention has kept: a messenger deletes sealed segments
    that every offset file of the channel has passed (a channel with no offset file
    keeps its data), and those the ``retention`` section's limits select. Bytes gone
    from inside the range read raise :class:`~keyop_messenger.DataLossError`;
    unreadable records are quarantined and passed over.

Streaming read
    Offsets are ``{"offset": N}``, the global byte offset of the next record (segment
    start + byte position in the segment); ``{"offsets": {channel: N, ...}}`` when
    several channels are read. ``latestOffset`` is the committed stream end
    (whole lines only); a micro-batch gets one input partition per segment range
    between its start and end offsets (split further by ``max_partition_bytes``).
    Restarting from the checkpoint replays an unfinished micro-batch with the same
    offsets, so the query loses nothing that is still on disk.
    ``Trigger.AvailableNow`` reads up to the ends the channels had when the query
    started (in several micro-batches under a byte limit), then stops. The query's
    progress shows, under ``sources[].latestOffset``, the channels' committed ends
    and ``bytesBehindLatest``: how many bytes the last planned micro-batch left
    unread (the query's lag; pyspark 4.2+).

    ``retain_as`` (a subscriber id) makes the query hold retention like a
    subscriber: it keeps ``subscribers/<channel>/<id>.offset`` at the end of the last
    batch Spark committed to the source (written when the query starts and on each
    source commit, which Spark makes when it plans the next batch), so the writing
    messenger never deletes a segment the query still needs, also while it is
    stopped. Use an id no subscriber uses; when the query is retired, delete the
    file with ``Messenger.unsubscribe(channel, id)`` (or let
    ``subscribers.offset_ttl`` expire it). Without it, data that retention (or
    anyone) deleted before a batch read it raises
    :class:`~keyop_messenger.errors.DataLossError` (``failOnDataLoss``, default
    true, like Spark's Kafka source); ``failOnDataLoss=false`` skips it with a
    WARNING (the reader counts the bytes lost). ``earliest`` starts at the oldest
    record still stored.

Options are checked: an unknown or misspelled option raises, naming the valid
ones and the closest match; a value of the wrong type raises naming the option,
the value and the type expected.

Streaming write
    Same options as the batch write, and exactly once in the same way: the job of
    a micro-batch is ``s<first 16 hex digits of the query id>.<batch id>``, the
    same when the batch is replayed after a restart from the checkpoint. Unless
    ``correlation_id`` or ``correlation_id_column`` is set, every chunk carries the
    correlation id ``spark:<query id>:<batch id>:<partition id>:<chunk index>``.

Counts
    Each task's commit message (:class:`PartitionCommit`) carries the rows of its
    partition committed (``rows``; ``skipped``: those an earlier attempt had
    committed). The driver logs the job's total at INFO and writes it to
    ``report_path`` (JSON: ``status``, ``rows``, ``partitions``, ...). A channel is
    an append-only log: an aborted job cannot take back what its tasks committed;
    its report says so in ``rows_committed_by_failed_partitions`` (from the
    progress files for ``data_dir``; through a hub each failed task's error
    says how many rows it committed). Spark aborts a job while its other tasks
    may still run: before counting, the driver of a ``data_dir`` write marks
    the job aborted (``spark-progress/<job>.aborted``, an empty file that
    stays for a batch job) and, if one of its tasks has started appending,
    waits for the directory's lock; a task checks the mark before each chunk
    and stops, so the count is final.

Executors run the publishing and reading code in forked Python workers: the
classes here are pickled by reference and import :mod:`keyop_messenger` there;
the engine's federation runtime is created lazily per process.

Modules: :mod:`.options` (options, defaults, name checks), :mod:`.mapping`
(JSON <-> Spark values), :mod:`.reader` (segments, partitions, batch read),
:mod:`.writer` (targets, publishing, batch write, :func:`publish_partitions`),
:mod:`.streaming` (stream reader and writers), :mod:`.source` (the data source).
"""

from __future__ import annotations

try:
    import pyspark.sql.datasource
    import pyspark.sql.types  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised only without pyspark
    raise ImportError(
        "keyop_messenger.spark needs pyspark 4.x with pyarrow "
        "(pip install 'keyop-messenger[spark]') and Java 17 or newer"
    ) from _exc

# The names below are the module's API of before the split (tests, examples and
# benches use them): re-exported explicitly ("X as X"), __all__ stays the public list.
from .mapping import RowEncoder as RowEncoder
from .mapping import format_timestamp as format_timestamp
from .mapping import json_to_spark as json_to_spark
from .options import DEFAULT_BATCH_SIZE as DEFAULT_BATCH_SIZE
from .options import DEFAULT_CONNECT_TIMEOUT_S as DEFAULT_CONNECT_TIMEOUT_S
from .options import DEFAULT_LOCK_TIMEOUT_S as DEFAULT_LOCK_TIMEOUT_S
from .options import DEFAULT_RETRIES as DEFAULT_RETRIES
from .options import ENVELOPE_COLUMNS
from .options import SOURCE_NAME as SOURCE_NAME
from .options import check_channel as check_channel
from .options import check_subscriber_id as check_subscriber_id
from .options import nullable_ddl as nullable_ddl
from .reader import KeyopPartition as KeyopPartition
from .reader import align_offset as align_offset
from .reader import list_segments as list_segments
from .reader import plan_partitions as plan_partitions
from .reader import stream_end as stream_end
from .source import KeyopDataSource, register
from .streaming import write_offset_file as write_offset_file
from .writer import PartitionCommit, publish_partitions
from .writer import PartitionError as PartitionError
from .writer import publish_payloads as publish_payloads

#: The old private name of :func:`json_to_spark`, kept for callers of 0.1.
_json_to_spark = json_to_spark

__all__ = [
    "ENVELOPE_COLUMNS",
    "KeyopDataSource",
    "PartitionCommit",
    "publish_partitions",
    "register",
]
