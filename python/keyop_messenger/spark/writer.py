# why this file is long: one write path (targets, exactly-once ids and resume, chunked
# publishing, commit reports) shared by batch, streaming and publish_partitions.
"""Writing: options of a write, where a task publishes (hub or data directory),
publishing a partition in chunks, commit reports, the batch writer and
:func:`publish_partitions`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import itertools
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    Row,
    StringType,
    StructType,
)

from .mapping import RowEncoder
from .options import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_LOCK_TIMEOUT_S,
    DEFAULT_RETRIES,
    WRITE_OPTIONS,
    Options,
    check_channel,
    planned_path,
)

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]
    from pyspark.sql import DataFrame

    from ..config import Config


log = logging.getLogger("keyop_messenger.spark")


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
    """Chunks sent again after a lost connection (the hub drops the copies by id)."""
    job: str | None = None
    """The write job id (message ids are ``<job>:<partition>:<row index>``)."""
    skipped: int = 0
    """Rows an earlier attempt of this task had committed (found in the data
    directory and not written again); included in ``rows``."""


def _config_for_tasks(config_path: str) -> Config:
    """The configuration at ``config_path``, read on the driver, with its TLS
    files made absolute there (relative to the driver's current directory,
    as the file is read): the tasks that use it run in other directories,
    and on other machines."""
    from ..config import load_config

    config = load_config(config_path)
    files = {
        name: planned_path(getattr(config.tls, name), f"config: tls.{name}")
        for name in ("cert", "key", "ca")
        if getattr(config.tls, name)
    }
    return dataclasses.replace(config, tls=dataclasses.replace(config.tls, **files))


def _planned_report_path(path: str | None) -> str | None:
    return None if path is None else planned_path(path, "report_path")


def _check_on_the_driver(
    payload_type: str, o: Options, data_dir: str | None, storage: dict[str, int]
) -> None:
    """What every task would refuse, refused once when the write is planned:
    the envelope's text fields (the engine's rule) and the storage options
    (the configuration's rules). ``ValueError`` names the option."""
    from .. import _core
    from ..config import Config
    from ..errors import ConfigError, InvalidNameError

    fields = {"payload_type": payload_type}
    for key in ("service_name", "correlation_id"):
        value = o.get(key)
        if value:
            fields[key] = value
    for key, value in fields.items():
        try:
            _core.validate_field(key, value)
        except InvalidNameError as exc:
            raise ValueError(f"keyop data source: option {key!r}: {exc}") from None
    if data_dir is not None and os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise ValueError(
            f"keyop data source: data_dir {data_dir!r} is a file, not a data directory; "
            "check the option 'data_dir'"
        )
    if data_dir is not None and storage:
        try:
            Config.from_dict({"name": "spark", "storage": {"data_dir": data_dir, **storage}})
        except ConfigError as exc:
            raise ValueError(f"keyop data source: {exc}") from None


@dataclasses.dataclass(frozen=True)
class WriteSpec:
    """The checked write options: where to publish and how (built on the driver)."""
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
    def from_options(cls, options: Any, schema: StructType, *, streaming: bool) -> WriteSpec:
        """Checks the write options; ``ValueError`` names the first problem."""
        o = Options(options)
        o.check_known(WRITE_OPTIONS, "write")
        channel = o.required("channel", "the channel to publish to")
        check_channel(channel, publish=True)
        payload_type = o.get("payload_type")
        if payload_type is None:
            raise ValueError(
                "keyop data source: option 'payload_type' is required (it may be empty)"
            )
        config_path, data_dir = o.get("config") or None, o.get("data_dir") or None
        # Absolute when planned (see reader.py): executors may run elsewhere.
        if data_dir is not None:
            data_dir = planned_path(data_dir, "data_dir")
        if config_path is not None:
            config_path = planned_path(config_path, "config")
        if (config_path is None) == (data_dir is None):
            raise ValueError(
                "keyop data source: give exactly one of the options 'config' (publish through "
                "the hub named in that YAML file) and 'data_dir' (publish into a local data "
                "directory)"
            )
        config = _config_for_tasks(config_path) if config_path is not None else None
        if config is not None and not config.client.hubs:
            raise ValueError(
                f"keyop data source: {config_path}: client.hubs must name the hub to publish to"
            )
        storage: dict[str, int] = {}
        for key in ("sync_interval_ms", "segment_size_mb", "compaction_threshold_mb"):
            if o.get(key):
                storage[key] = o.integer(key, 0, minimum=-(2**31))
        _check_on_the_driver(payload_type, o, data_dir, storage)
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
            report_path=_planned_report_path(o.get("report_path") or None),
            encoder=RowEncoder(schema),
            streaming=streaming,
        )

    def target(self) -> _Target:
        """Where a task publishes: a hub (``config``) or a local data directory (``data_dir``)."""
        if self.config is not None:
            return _HubTarget(self.config, self.connect_timeout_s, self.retries)
        assert self.data_dir is not None
        return _DirTarget(self.data_dir, self.name, self.storage, self.lock_timeout_s)

    def free_target(self) -> _Target | None:
        """The data directory's target if its lock is free now, else None."""
        from ..errors import DataDirLockedError

        assert self.data_dir is not None
        try:
            return _DirTarget(self.data_dir, self.name, self.storage, 0.0)
        except DataDirLockedError:
            return None


def _host_name() -> str:
    try:
        return socket.gethostname() or "spark"
    except OSError:
        return "spark"


class _Target:
    """Where a task publishes: a hub (ephemeral client) or a local data dir."""

    def publish_batch(
        self,
        channel: str,
        items: list[tuple[str, Any]],
        service_name: str | None,
        correlation_id: str | None,
        ids: list[str],
    ) -> list[str]:
        raise NotImplementedError

    def publish_encoded(
        self,
        channel: str,
        batch: Any,
        service_name: str | None,
        correlation_id: str | None,
    ) -> list[str]:
        """Publishes a ``_core.PayloadBatch`` (payloads and ids encoded by the
        engine); a data directory is given framed batches instead."""
        raise NotImplementedError

    def publish_framed(self, batch: Any) -> Any:
        """Hands a ``_core.FramedBatch`` (records framed by
        :func:`_core.encode_records`) to be appended; returns its receipt
        (``wait()`` raises if the append failed) or None for an empty batch."""
        raise NotImplementedError

    def resume(self, channel: str, prefix: str) -> int:
        """Rows of the task whose ids start with ``prefix`` already committed
        by an earlier attempt (0 when the target cannot tell)."""
        return 0

    def committed(self, channel: str, prefix: str, rows: int) -> None:
        """Called after each committed chunk: ``rows`` rows of the task are in."""

    def check_job(self, job: str) -> None:
        """Raises :class:`PartitionError` if ``job`` was aborted (a data
        directory's mark, :func:`_stop_tasks`); called before each chunk."""

    def finish(self) -> None:
        """Makes what the task wrote durable before it reports it committed
        (raises if it cannot)."""

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
        from ..ephemeral import EphemeralMessenger

        client = EphemeralMessenger(self.config)
        try:
            client.connect(self.connect_timeout_s)
        except BaseException:
            client.close()
            raise
        self.client = client

    def _with_retries(self, op: Callable[[], Any]) -> Any:
        from ..errors import ConnectionLostError

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
        ids: list[str],
    ) -> list[str]:
        sent = [False]

        def op() -> list[str]:
            if sent[0]:
                self.resent += 1
            sent[0] = True
            return list(
                self.client.publish_batch(
                    channel,
                    items,
                    service_name=service_name,
                    correlation_id=correlation_id,
                    ids=ids,
                )
            )

        result: list[str] = self._with_retries(op)
        return result

    def publish_encoded(
        self,
        channel: str,
        batch: Any,
        service_name: str | None,
        correlation_id: str | None,
    ) -> list[str]:
        from ..ephemeral import PUBLISH_TIMEOUT_S

        sent = [False]

        def op() -> list[str]:
            if sent[0]:
                self.resent += 1
            sent[0] = True
            return list(
                self.client._client.publish_batch(
                    channel, batch, service_name, correlation_id, timeout_s=PUBLISH_TIMEOUT_S
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
        from ..config import Config
        from ..errors import DataDirLockedError
        from ..messenger import Messenger

        self.data_dir = data_dir
        # A task's chunks are not fsynced one by one (unless sync_interval_ms
        # says so): finish() fsyncs once, before the task reports its rows.
        # A retried attempt finds what was written by the records' ids, so a
        # chunk lost to a power cut before that fsync is written again.
        self.durable = storage.get("sync_interval_ms") == 0
        storage = {"sync_interval_ms": TASK_SYNC_INTERVAL_MS, **storage}
        #: (channel, prefix, rows) of the last committed chunk, for the progress hint.
        self._last: tuple[str, str, int] | None = None
        self._finished = False
        config = Config.from_dict({"name": name, "storage": {"data_dir": data_dir, **storage}})
        deadline = time.monotonic() + lock_timeout_s
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
            # Another task appends for well under a second per million rows:
            # a short, fixed poll takes the lock soon after it is released.
            time.sleep(LOCK_POLL_S)

    def publish_batch(
        self,
        channel: str,
        items: list[tuple[str, Any]],
        service_name: str | None,
        correlation_id: str | None,
        ids: list[str],
    ) -> list[str]:
        return self.messenger.publish_batch(
            channel, items, service_name=service_name, correlation_id=correlation_id, ids=ids
        )

    def publish_framed(self, batch: Any) -> Any:
        return self.messenger._engine.publish_framed(batch, wait=False)

    def _progress_path(self, prefix: str) -> str:
        return _progress_path(self.data_dir, prefix)

    def resume(self, channel: str, prefix: str) -> int:
        from .reader import stream_end

        rows = _committed_rows(self.data_dir, channel, prefix)
        if rows is None:
            # First attempt (or an attempt that died before its first chunk):
            # nothing of the task is before the current end.
            self._write_progress(self._progress_path(prefix), 0, stream_end(self.data_dir, channel))
            return 0
        return rows

    def check_job(self, job: str) -> None:
        if os.path.exists(_aborted_path(self.data_dir, job)):
            raise PartitionError(
                f"the write job {job} was aborted (another of its tasks failed): "
                "this task stops appending"
            )

    def committed(self, channel: str, prefix: str, rows: int) -> None:
        self._last = (channel, prefix, rows)
        if self.durable:
            self._hint()

    def _hint(self) -> None:
        """Writes the progress hint of the last committed chunk: it shortens
        a retried attempt's scan (the scan finds later rows by their ids).
        Not fsynced, unlike the first progress file, and written only once
        the rows it counts are durable, so it never counts a lost row."""
        from .reader import stream_end

        if self._last is None:
            return
        channel, prefix, rows = self._last
        self._write_progress(
            self._progress_path(prefix), rows, stream_end(self.data_dir, channel), durable=False
        )

    def finish(self) -> None:
        self.messenger.flush()
        self._finished = True
        self._hint()

    @staticmethod
    def _write_progress(path: str, rows: int, offset: int, *, durable: bool = True) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "offset": offset}, f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def close(self) -> None:
        if not self._finished:
            # A failed task: what it wrote stays; its hint counts it once durable.
            try:
                self.finish()
            except Exception as exc:  # the task's own error is the one raised
                log.warning("keyop: fsync of a failed task's rows failed: %s", exc)
        self.messenger.close()


class PartitionError(RuntimeError):
    """A write task failed; says how much of its partition was committed."""


def _chunks(
    payloads: Iterable[dict[str, Any]], size: int, column: str | None, skip: int
) -> Iterator[tuple[int, list[dict[str, Any]], str | None]]:
    """Splits ``payloads`` into runs of at most ``size`` rows that share the
    correlation id in ``column`` (one run if ``column`` is None), leaving out
    the first ``skip`` rows; yields (index of the run's first row, rows, id)."""
    chunk: list[dict[str, Any]] = []
    key: str | None = None
    first = skip
    for p in itertools.islice(payloads, skip, None):
        k = p.get(column) if column is not None else None
        if chunk and (len(chunk) >= size or k != key):
            yield first, chunk, key
            first += len(chunk)
            chunk = []
        key = k
        chunk.append(p)
    if chunk:
        yield first, chunk, key


#: How often a data_dir task tries the directory lock while another task holds it.
LOCK_POLL_S = 0.01

#: How long a data_dir task holds the directory, at least, before it lets
#: another task waiting for it have a turn (see :class:`_Turns`).
MIN_TURN_S = 0.1

#: How often, at most, a data_dir task waiting for its turn tries the lock
#: while it encodes (each try opens the directory: about half a millisecond).
TURN_POLL_S = 0.02

#: The file in :data:`PROGRESS_DIR` that tasks waiting for the directory lock
#: hold a shared lock on.
WAITING_FILE = "waiting.lock"

#: The fsync interval of a data_dir task's writes unless ``sync_interval_ms``
#: is given (the task also fsyncs once at its end, before it reports its rows).
TASK_SYNC_INTERVAL_MS = 1000

#: Folder of a data directory where data_dir writes keep their progress.
PROGRESS_DIR = "spark-progress"


def new_job_id() -> str:
    """A new write job id: ``b`` and 16 hex digits (made once per job, on the driver)."""
    return "b" + uuid.uuid4().hex[:16]


def row_id_prefix(job: str, partition: int) -> str:
    """The prefix of the message ids of one task: ``<job>:<partition>:``; a
    row's id is the prefix and its index in the partition. Valid ids per
    envelope.rs (``A-Za-z0-9-_.:``, at most 64 bytes)."""
    return f"{job}:{partition}:"


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


#: What publishing a chunk gives once committed: (records, first id, last id).
_Sent = tuple[int, "str | None", "str | None"]

#: One chunk to publish: (index of its first row in the partition, rows,
#: correlation id from ``correlation_id_column`` or None, publish function
#: taking (target, correlation id, ids prefix) and returning a function
#: that waits for the chunk's commit).
_Chunk = tuple[
    int, int, "str | None", Callable[["_Target", "str | None", str], Callable[[], _Sent]]
]


def _sent(ids: list[str]) -> Callable[[], _Sent]:
    """The wait of a chunk already committed with ``ids``."""
    sent: _Sent = (len(ids), ids[0], ids[-1]) if ids else (0, None, None)
    return lambda: sent


def _dict_chunks(
    spec: WriteSpec, payloads: Iterable[dict[str, Any]]
) -> Callable[[int], Iterator[_Chunk]]:
    """Chunks of payload dicts (the general path), leaving out ``skip`` rows."""

    def chunks(skip: int) -> Iterator[_Chunk]:
        for first, chunk, key in _chunks(
            payloads, spec.batch_size, spec.correlation_id_column, skip
        ):

            def send(
                target: _Target, corr: str | None, prefix: str, first: int = first,
                chunk: list[dict[str, Any]] = chunk,
            ) -> Callable[[], _Sent]:  # fmt: skip
                items = [(spec.payload_type, p) for p in chunk]
                wanted = [f"{prefix}{first + i}" for i in range(len(chunk))]
                ids = target.publish_batch(spec.channel, items, spec.service_name, corr, wanted)
                return _sent(ids)

            yield first, len(chunk), key, send

    return chunks


def publish_payloads(
    spec: WriteSpec, payloads: Iterable[dict[str, Any]], job: str | None = None
) -> PartitionCommit:
    """Publishes ``payloads`` (this task's rows) as ``spec`` says; returns the
    task's commit message (see :func:`_publish_chunks`)."""
    rows = iter(payloads)
    head = list(itertools.islice(rows, 1))
    return _publish_chunks(spec, bool(head), _dict_chunks(spec, itertools.chain(head, rows)), job)


def _publish_chunks(
    spec: WriteSpec,
    any_rows: bool,
    chunks: Callable[[int], Iterator[_Chunk]],
    job: str | None = None,
    *,
    framed: _ArrowChunks | None = None,
) -> PartitionCommit:
    """Publishes this task's rows, given as ``chunks(skip)`` (the chunks after
    the first ``skip`` rows), as ``spec`` says; returns the task's commit
    message. Opens the target only if ``any_rows``: an empty partition
    connects to nothing. ``framed``: the chunks are framed records for a
    data directory, and the task takes turns on its lock (:class:`_Turns`).

    Exactly once for a deterministic input: row ``i`` of partition ``p`` gets
    the id ``<job>:<p>:<i>``, the same on every attempt of the task (``job``
    is made once per write job; a streaming micro-batch's is derived from the
    query id and the batch id, so a replay after a restart reuses it). A hub
    drops records whose ids it saw recently; a data directory write resumes
    after the rows an earlier attempt committed (see :class:`_DirTarget`)."""
    partition, attempt, batch_id, query_id = _task_info()
    if job is None:
        qid = (query_id or "query").replace("-", "")[:16]
        job = f"s{qid}.{batch_id}" if batch_id is not None else new_job_id()
    prefix = row_id_prefix(job, partition)
    commit = PartitionCommit(partition, attempt, 0, 0, batch_id=batch_id, job=job)
    target: _Target | None = None
    turns = _Turns(spec) if any_rows and framed is not None else None
    auto_corr = (
        spec.streaming and spec.correlation_id is None and spec.correlation_id_column is None
    )

    def corr_of(first: int, key: str | None) -> str | None:
        """The correlation id of the chunk whose first row is ``first``."""
        if spec.correlation_id_column is not None:
            return key
        if auto_corr:
            index = first // spec.batch_size
            return f"spark:{query_id or 'query'}:{batch_id}:{partition}:{index}"
        return spec.correlation_id

    def take_now() -> bool:
        """Takes the directory lock if it is free (turns only)."""
        nonlocal target
        assert turns is not None
        target = turns.try_take()
        return target is not None

    # A chunk's append overlaps the encoding of the next (done by the
    # iterator): each chunk is waited for, and counted, once the next one is
    # ready, and before the next one is handed over.
    in_flight: tuple[int, int, Callable[[], _Sent]] | None = None
    #: Chunks encoded while another task holds the directory (turns only),
    #: and their rows.
    queue: collections.deque[_Chunk] = collections.deque()
    queued_rows = 0

    def settle() -> None:
        """Waits for the chunk in flight to commit and counts it."""
        nonlocal in_flight
        if in_flight is None:
            return
        (first, count, wait), in_flight = in_flight, None
        assert target is not None
        sent, first_id, last_id = wait()
        if sent:
            commit.first_id = commit.first_id or first_id
            commit.last_id = last_id
        commit.rows += sent
        commit.batches += 1
        target.committed(spec.channel, prefix, first + count)

    def send(chunk: _Chunk) -> None:
        nonlocal in_flight
        assert target is not None
        first, count, key, publish = chunk
        settle()
        target.check_job(job)
        in_flight = (first, count, publish(target, corr_of(first, key), prefix))

    def send_queued() -> None:
        nonlocal queued_rows
        while queue:
            send(queue.popleft())
        queued_rows = 0

    try:
        if turns is not None:
            assert framed is not None
            # A task that finds the directory free takes it and appends as its
            # rows come; one that finds it taken encodes ahead meanwhile,
            # trying the lock after each chunk.
            if not take_now():
                framed.ahead(prefix, ENCODE_AHEAD_BYTES, corr_of, take_now)
            else:
                framed.ahead(prefix, 0, corr_of, lambda: True)
        if any_rows and target is None:
            target = turns.take() if turns is not None else spec.target()
        if target is not None:
            target.check_job(job)
            commit.skipped = target.resume(spec.channel, prefix)
            commit.rows = commit.skipped
            if commit.skipped:
                log.info(
                    "keyop: partition %d (attempt %d) resumes after %d rows an earlier "
                    "attempt committed",
                    partition,
                    attempt,
                    commit.skipped,
                )
        try:
            for chunk in chunks(commit.skipped):
                if turns is None:
                    send(chunk)
                    continue
                assert framed is not None
                queue.append(chunk)
                queued_rows += chunk[1]
                if target is None and not take_now():
                    if not framed.holds_too_much(queued_rows):
                        continue
                    target = turns.take()
                send_queued()
                if turns.should_yield():
                    # Another task waits with its rows encoded: its turn.
                    settle()
                    target.finish()
                    target.close()
                    target = None
                    turns.gave_up()
            if queue:
                assert turns is not None
                target = target or turns.take()
                send_queued()
        except BaseException:
            with contextlib.suppress(Exception):
                settle()  # counted if it was committed
            raise
        settle()
        if target is not None:
            target.finish()
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
        if turns is not None:
            turns.close()
    return commit


class _Turns:
    """Tasks writing into one data directory take turns on its lock: a task
    that wants it holds a shared lock on ``spark-progress/waiting.lock``
    meanwhile, and the holder gives the directory up once it has held it for
    :data:`MIN_TURN_S` while another task waits (each turn ends with an
    fsync and costs an open). So the tasks' appends interleave, and the last
    task to finish encoding has only its last turn's rows left to append."""

    def __init__(self, spec: WriteSpec) -> None:
        assert spec.data_dir is not None
        self.spec = spec
        folder = os.path.join(spec.data_dir, PROGRESS_DIR)
        os.makedirs(folder, exist_ok=True)
        self.fd = os.open(
            os.path.join(folder, WAITING_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644
        )
        self.waiting = False
        self.since = 0.0
        #: When try_take() may next try the lock (each try opens the directory).
        self.next_try = 0.0

    def wait(self) -> None:
        """Says this task waits for the directory."""
        if not self.waiting:
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            self.waiting = True

    def gave_up(self) -> None:
        """Called when this task gave the directory up for another: it waits
        for it now, and lets the other take it first."""
        self.wait()
        self.next_try = time.monotonic() + 2 * TURN_POLL_S

    def _taken(self, target: _Target) -> _Target:
        if self.waiting:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.waiting = False
        self.since = time.monotonic()
        return target

    def try_take(self) -> _Target | None:
        """The directory's target if its lock is free now, else None (and
        this task is counted as waiting)."""
        self.wait()
        now = time.monotonic()
        if now < self.next_try:
            return None
        self.next_try = now + TURN_POLL_S
        target = self.spec.free_target()
        return self._taken(target) if target is not None else None

    def take(self) -> _Target:
        """The directory's target, waiting for its lock (``lock_timeout_s``)."""
        self.wait()
        return self._taken(self.spec.target())

    def should_yield(self) -> bool:
        """Whether the holder should give the directory up: held for
        :data:`MIN_TURN_S`, and another task waits."""
        if time.monotonic() - self.since < MIN_TURN_S:
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        os.close(self.fd)  # releases its lock too


# Progress of a task: ``<data_dir>/spark-progress/<job>/<partition>.json``,
# ``{"rows": n, "offset": o}``: ``n`` rows were committed (and are durable)
# and every later record of the task is at or after the global offset ``o``.
# Written under the directory lock before the first chunk, then whenever what
# the task wrote is durable (the end of a turn, the end of the task); the
# job's folder is removed when the job commits (a streaming micro-batch's
# when the query's next batch commits: see report()).
def _progress_path(data_dir: str, prefix: str) -> str:
    """The progress file of the task whose ids start with ``prefix``."""
    job, partition = prefix.rstrip(":").rsplit(":", 1)
    return os.path.join(data_dir, PROGRESS_DIR, job, f"{partition}.json")


def _aborted_path(data_dir: str, job: str) -> str:
    """The mark of an aborted job: while it exists, the job's tasks append
    nothing more (:meth:`_Target.check_job`)."""
    return os.path.join(data_dir, PROGRESS_DIR, f"{job}.aborted")


@contextlib.contextmanager
def _stop_tasks(
    spec: WriteSpec, jobs: set[str], finished: set[int], *, for_good: bool
) -> Iterator[None]:
    """Stops the tasks of ``jobs`` appending to the data directory, for an
    aborted job's count: Spark aborts a job while its other tasks may still
    run. Marks each job aborted (a task checks before its first and each
    chunk, holding the directory's lock); then, if a task of a partition not
    in ``finished`` has started (it has a progress file), takes the lock, so
    no task is mid-append, and yields holding it. Unless ``for_good``, the
    marks go on exit (a streaming micro-batch is replayed under the same
    job). If the lock is not free within ``lock_timeout_s``, or a mark cannot
    be written, it logs why and yields anyway: the count may then miss rows
    still being appended."""
    from ..errors import DataDirLockedError

    assert spec.data_dir is not None
    marks = [_aborted_path(spec.data_dir, j) for j in sorted(jobs)]
    target: _Target | None = None
    try:
        for mark in marks:
            os.makedirs(os.path.dirname(mark), exist_ok=True)
            with open(mark, "w", encoding="utf-8") as f:
                f.flush()
                os.fsync(f.fileno())
        # A task that has not started appending sees the mark before it does.
        if any(_started(spec.data_dir, j, finished) for j in jobs):
            target = spec.target()
    except (OSError, DataDirLockedError) as exc:
        log.warning(
            "keyop: could not stop the tasks of aborted write %s before counting its rows "
            "(%s): the count may miss rows they append after it",
            ", ".join(sorted(jobs)),
            exc,
        )
    try:
        yield
    finally:
        if not for_good:
            for mark in marks:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(mark)
        if target is not None:
            target.close()


def _committed_rows(data_dir: str, channel: str, prefix: str) -> int | None:
    """Rows of the task whose ids start with ``prefix`` that are in the
    channel: its progress file's count, or more when records of later rows
    follow the file's offset (found by their ids). None without a progress
    file (the task never held the directory)."""
    from .. import _core

    try:
        with open(_progress_path(data_dir, prefix), encoding="utf-8") as f:
            progress = json.load(f)
    except FileNotFoundError:
        return None
    rows, offset = int(progress["rows"]), int(progress["offset"])
    if not os.path.isdir(os.path.join(data_dir, "channels", channel)):
        return rows
    for record in _core.read_channel(data_dir, channel, offset, skip_gaps=True, check_start=False):
        rid = record[2]
        if rid.startswith(prefix):
            rows = max(rows, int(rid[len(prefix) :]) + 1)
    return rows


def _drop_earlier_batches(data_dir: str, job: str) -> None:
    """Removes the progress of the micro-batches of ``job``'s query
    (``s<query>.<batch>``) before its batch: Spark replays at most the last
    batch whose commit it did not log."""
    query, _, batch = job.rpartition(".")
    try:
        names = os.listdir(os.path.join(data_dir, PROGRESS_DIR))
    except FileNotFoundError:
        return
    for name in names:
        other_query, _, other = name.rpartition(".")
        if other_query == query and other.isdigit() and int(other) < int(batch):
            shutil.rmtree(os.path.join(data_dir, PROGRESS_DIR, name), ignore_errors=True)


def _progress_partitions(data_dir: str, job: str, skip: set[int]) -> list[int]:
    """The partitions of ``job`` that have a progress file (those in ``skip`` left out)."""
    try:
        names = os.listdir(os.path.join(data_dir, PROGRESS_DIR, job))
    except FileNotFoundError:
        return []
    stems = (os.path.splitext(n) for n in names)
    return [int(s) for s, ext in stems if ext == ".json" and s.isdigit() and int(s) not in skip]


def _started(data_dir: str, job: str, skip: set[int]) -> bool:
    """Whether a task of ``job`` (partitions in ``skip`` left out) has started
    appending to the data directory: it writes its progress file first."""
    return bool(_progress_partitions(data_dir, job, skip))


def _progress_rows(data_dir: str, channel: str, job: str, skip: set[int]) -> dict[int, int]:
    """Rows committed per partition of ``job`` that has a progress file
    (partitions in ``skip`` left out): the file's count and the later rows
    found in the channel by their ids (:func:`_committed_rows`)."""
    found: dict[int, int] = {}
    for partition in _progress_partitions(data_dir, job, skip):
        try:
            rows = _committed_rows(data_dir, channel, row_id_prefix(job, partition))
        except (OSError, ValueError, KeyError):
            continue
        if rows is not None:
            found[partition] = rows
    return found


def report(
    spec: WriteSpec,
    messages: Sequence[WriterCommitMessage | None],
    *,
    aborted: bool,
    batch_id: int | None = None,
    job: str | None = None,
) -> dict[str, Any]:
    """The job's counts, logged at INFO and written to ``report_path``; returns them.

    ``rows``: rows the finished tasks committed (for a committed job, every
    row of the DataFrame). A channel is an append-only log: an aborted job
    cannot take back what its tasks committed, so its report also counts, in
    ``rows_committed_by_failed_partitions``, what the failed tasks had
    committed (known for ``data_dir`` writes from their progress files and
    the ids after them; None through a hub, where each failed task's error
    says it). A retried job
    writes the same message ids again, so a hub drops those rows and a
    ``data_dir`` write resumes after them (when the job is replayed, as a
    streaming micro-batch is after a restart)."""
    done = [m for m in messages if isinstance(m, PartitionCommit)]
    total = sum(m.rows for m in done)
    jobs = {m.job for m in done if m.job is not None} | ({job} if job else set())
    partial: int | None = None
    if spec.data_dir is not None:
        finished = {m.partition_id for m in done}
        # A streaming micro-batch that aborts may be replayed with the same job:
        # its progress stays, and its tasks are stopped only while counting.
        replayed = aborted and batch_id is not None
        with (
            _stop_tasks(spec, jobs, finished, for_good=not replayed)
            if aborted
            else contextlib.nullcontext()
        ):
            partial = sum(
                n
                for j in jobs
                for n in _progress_rows(spec.data_dir, spec.channel, j, finished).values()
            )
        if not replayed:
            for j in jobs:
                if batch_id is not None and not aborted:
                    # Spark writes its commit log after this: a driver lost in
                    # between replays the batch under the same job, whose
                    # tasks must find what they committed. Kept until the
                    # query's next batch commits.
                    _drop_earlier_batches(spec.data_dir, j)
                else:
                    shutil.rmtree(os.path.join(spec.data_dir, PROGRESS_DIR, j), ignore_errors=True)
    status = "aborted" if aborted else "committed"
    log.info(
        "keyop write to %r %s: %d rows from %d of %d partitions%s",
        spec.channel,
        status,
        total,
        len(done),
        len(messages),
        f" ({partial} more rows committed by the failed partitions stay in the channel)"
        if aborted and partial
        else (" (rows the failed partitions committed stay in the channel)" if aborted else ""),
    )
    # Through a hub a retried task sends its whole partition again: the hub
    # drops only the ids it still remembers. Never silent.
    sent_again = sorted(m.partition_id for m in done if m.attempt > 0) if spec.config else []
    if sent_again:
        log.warning(
            "keyop write to %r through a hub: partition(s) %s were retried and sent their "
            "rows again (%d rows); the hub drops the ids it still remembers "
            "(dedup.seen_id_lru_size, 100,000 by default, shared by all its publishers, "
            "while it runs): if more records reached it since the first attempt, some of "
            "these rows may be stored twice",
            spec.channel,
            sent_again,
            sum(m.rows for m in done if m.partition_id in sent_again),
        )
    counts: dict[str, Any] = {
        "channel": spec.channel,
        "status": status,
        "batch_id": batch_id,
        "rows": total,
        "rows_committed_by_failed_partitions": partial if aborted else 0,
        "partitions": [dataclasses.asdict(m) for m in done],
        "failed_partitions": len(messages) - len(done),
        "partitions_sent_again": sent_again,
    }
    if spec.report_path is None:
        return counts
    path = spec.report_path
    if batch_id is not None and "{batch_id}" in path:
        path = path.replace("{batch_id}", str(batch_id))
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(counts, f, indent=1)
    os.replace(tmp, path)
    return counts


def publish_arrow(
    spec: WriteSpec, batches: Iterable[pa.RecordBatch], job: str | None = None
) -> PartitionCommit:
    """Publishes this task's Arrow batches, one payload per row: encoded by
    the engine straight from the Arrow buffers when every column has a type
    it encodes (:meth:`RowEncoder.arrow_columns`), else
    through Python dicts."""
    encoder = spec.encoder
    it = iter(batches)
    head = next(it, None)
    while head is not None and head.num_rows == 0:
        head = next(it, None)
    if head is None:
        return _publish_chunks(spec, False, lambda skip: iter(()), job)
    columns = encoder.arrow_columns(head) if spec.correlation_id_column is None else None
    if columns is not None:
        chunks = _ArrowChunks(spec, itertools.chain([head], it), head_columns=columns)
        framed = chunks if spec.data_dir is not None else None
        return _publish_chunks(spec, True, chunks, job, framed=framed)
    return publish_payloads(
        spec, (p for b in itertools.chain([head], it) for p in encoder.from_arrow(b)), job
    )


#: A ``data_dir`` write encodes up to this many bytes of Arrow data ahead,
#: before it waits for the directory lock: tasks encode in parallel and take
#: turns only to append.
ENCODE_AHEAD_BYTES = 256 * 1024 * 1024


class _ArrowChunks:
    """Chunks of at most ``batch_size`` rows of Arrow batches (cut at batch
    ends too), encoded by the engine; called with ``skip``, leaves out the
    first ``skip`` rows of the partition. :meth:`ahead` encodes chunks before
    the target is open (a chunk that turns out to straddle ``skip`` is
    encoded again from there). For a data directory the chunks are framed
    as records too, in the same pass (ids, timestamps, checks:
    :func:`_core.encode_records`), so that under the directory lock a task
    only appends."""

    def __init__(
        self,
        spec: WriteSpec,
        batches: Iterable[pa.RecordBatch],
        head_columns: list[tuple[Any, ...]] | None = None,
    ) -> None:
        """``head_columns``: the first batch's :meth:`RowEncoder.arrow_columns`,
        when the caller already has them."""
        self.spec = spec
        self.framed = spec.data_dir is not None
        self.pieces = self._cut(iter(batches), head_columns)
        #: (first row, rows, columns, correlation id, chunk encoded with ids
        #: of ``prefix`` and that correlation id).
        self.ready: list[tuple[int, int, list[Any], str | None, Any]] = []
        self.prefix: str | None = None
        self.corr_of: Callable[[int, str | None], str | None] | None = None
        #: Arrow bytes per row, the most of any batch so far.
        self.row_bytes = 0.0

    def _cut(
        self, batches: Iterator[pa.RecordBatch], head: list[tuple[Any, ...]] | None
    ) -> Iterator[tuple[int, int, list[Any], int]]:
        """(first row, rows, columns, Arrow bytes) of each chunk, in order;
        ``head`` is the first batch's columns if already known."""
        row = 0  # index of the current batch's first row in the partition
        for batch in batches:
            n = batch.num_rows
            if head is not None:
                whole, head = head, None
            else:
                whole = self.spec.encoder.arrow_columns(batch) if n else []
            if whole is None:  # a later batch with other types (Spark sends one schema)
                raise TypeError(f"keyop: Arrow batch of unexpected types: {batch.schema}")
            # The buffers' sizes (batch.nbytes walks each buffer's referenced range).
            nbytes = sum(len(b) for c in whole for b in c[3:] if b is not None)
            per_row = nbytes / max(n, 1)
            self.row_bytes = max(self.row_bytes, per_row)
            for lo in range(0, n, self.spec.batch_size):
                size = min(self.spec.batch_size, n - lo)
                columns = [(c[0], c[1], c[2] + lo, *c[3:]) for c in whole]
                yield row + lo, size, columns, int(per_row * size)
            row += n

    def _encode(
        self, columns: list[Any], size: int, prefix: str, first: int, corr: str | None
    ) -> Any:
        from .. import _core

        spec = self.spec
        if self.framed:
            return _core.encode_records(
                spec.payload_type, columns, size, origin=spec.name, channel=spec.channel,
                id_prefix=prefix, first_row=first, service_name=spec.service_name,
                correlation_id=corr,
            )  # fmt: skip
        return _core.encode_columns(
            spec.payload_type, columns, size, id_prefix=prefix, first_row=first
        )

    def ahead(
        self,
        prefix: str,
        budget: int,
        corr_of: Callable[[int, str | None], str | None],
        stop: Callable[[], bool],
    ) -> None:
        """Encodes chunks (ids of ``prefix``, correlation ids by ``corr_of``)
        until ``budget`` bytes of Arrow data are encoded, ``stop()`` (asked
        after each chunk) is true, or the batches end; the chunks after
        those are encoded as they are iterated."""
        self.prefix, self.corr_of = prefix, corr_of
        used = 0
        while used < budget:
            piece = next(self.pieces, None)
            if piece is None:
                return
            first, size, columns, nbytes = piece
            corr = corr_of(first, None)
            encoded = self._encode(columns, size, prefix, first, corr)
            self.ready.append((first, size, columns, corr, encoded))
            used += nbytes
            if stop():
                return

    def holds_too_much(self, rows: int) -> bool:
        """Whether ``rows`` rows encoded and waiting for the directory are
        as much Arrow data as :data:`ENCODE_AHEAD_BYTES` (then the task
        waits for the lock instead of encoding more)."""
        return rows * self.row_bytes >= ENCODE_AHEAD_BYTES

    def __call__(self, skip: int) -> Iterator[_Chunk]:
        pending, self.ready = self.ready, []
        rest = ((f, n, c, None, None) for f, n, c, _ in self.pieces)
        for first, size, columns, made_for, encoded in itertools.chain(pending, rest):
            if first + size <= skip:
                continue
            if first < skip:  # straddles the resume point: encode from there
                cut = skip - first
                columns = [(c[0], c[1], c[2] + cut, *c[3:]) for c in columns]
                first, size, encoded = skip, size - cut, None
            if encoded is None and self.prefix is not None and self.corr_of is not None:
                made_for = self.corr_of(first, None)
                encoded = self._encode(columns, size, self.prefix, first, made_for)

            def send(
                target: _Target, corr: str | None, prefix: str, first: int = first,
                columns: list[Any] = columns, size: int = size, encoded: Any = encoded,
                made_for: str | None = made_for,
            ) -> Callable[[], _Sent]:  # fmt: skip
                if encoded is None or prefix != self.prefix or corr != made_for:
                    encoded = self._encode(columns, size, prefix, first, corr)
                if not self.framed:
                    return _sent(target.publish_encoded(
                        self.spec.channel, encoded, self.spec.service_name, corr
                    ))  # fmt: skip
                receipt = target.publish_framed(encoded)
                framed = encoded

                def wait() -> _Sent:
                    if receipt is not None:
                        receipt.wait()
                    return len(framed), framed.first_id, framed.last_id

                return wait

            yield first, size, None, send


def publish_rows(spec: WriteSpec, rows: Iterable[Row], job: str | None = None) -> PartitionCommit:
    """Publishes this task's Rows, one payload per row."""
    encoder = spec.encoder
    return publish_payloads(spec, (encoder.from_row(r) for r in rows), job)


class BatchWriter(DataSourceArrowWriter):
    """The batch writer. Made on the driver once per write job, which gives
    the job its id (:func:`new_job_id`): every attempt of a task writes the
    same message ids, so the write is exactly once (see
    :func:`publish_payloads`)."""

    def __init__(self, spec: WriteSpec) -> None:
        self.spec = spec
        self.job = new_job_id()

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PartitionCommit:
        """Publishes this task's rows; returns what it committed."""
        return publish_arrow(self.spec, iterator, self.job)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Logs (and writes to ``report_path``) what the tasks committed."""
        report(self.spec, messages, aborted=False, job=self.job)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Logs (and writes to ``report_path``) what the tasks of a failed job committed."""
        report(self.spec, messages, aborted=True, job=self.job)


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
    partition fails (rows committed before the failure stay published).
    Message ids are ``<job>:<partition>:<row index>`` with one job id per call,
    so the hub drops the rows a retried task sends again while it remembers
    their ids (``dedup.seen_id_lru_size``, 100,000 by default)."""
    check_channel(channel, publish=True)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    try:
        context = df.sparkSession.sparkContext
    except Exception as exc:  # Spark Connect has no SparkContext
        raise NotImplementedError(
            "publish_partitions needs classic PySpark (it counts rows with an accumulator); "
            "with Spark Connect write with df.write.format('keyop')"
        ) from exc
    config = _config_for_tasks(os.fspath(config_path))  # fails fast, on the driver
    if not config.client.hubs:
        raise ValueError(f"{config_path}: client.hubs must name the hub to publish to")
    spec = WriteSpec(
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
    counter = context.accumulator(0)
    # Only picklable values are captured: the spec (dataclasses), the job id and
    # the accumulator (Spark counts a retried task's updates once).
    df.foreachPartition(_PartitionPublisher(spec, counter, new_job_id()))
    return int(counter.value)


class _PartitionPublisher:
    """The picklable function ``publish_partitions`` runs on every partition."""

    def __init__(self, spec: WriteSpec, counter: Any, job: str) -> None:
        self.spec = spec
        self.counter = counter
        self.job = job

    def __call__(self, rows: Iterable[Row]) -> None:
        commit = publish_rows(self.spec, rows, self.job)
        self.counter.add(commit.rows)
