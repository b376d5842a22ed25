"""Options of the ``keyop`` data source: typed access, defaults, the envelope
schema, and the checks of channel and subscriber names."""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

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
ENVELOPE_DDL = (
    "id STRING, ts TIMESTAMP, channel STRING, origin STRING, payload_type STRING, "
    "service_name STRING, correlation_id STRING, payload {payload}, segment BIGINT, "
    "`offset` BIGINT"
)
DEFAULT_BATCH_SIZE = 1000
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_RETRIES = 3
DEFAULT_LOCK_TIMEOUT_S = 300.0
#: Input partitions of a read hold at most this many bytes (Spark's own
#: ``spark.sql.files.maxPartitionBytes`` default), so a large segment is read in parallel.
DEFAULT_MAX_PARTITION_BYTES = 128 * 1024 * 1024
_N = TypeVar("_N", int, float)

#: Options of a read (batch or streaming), as documented in the package docstring.
READ_OPTIONS = (
    "data_dir",
    "channel",
    "start_offset",
    "max_partition_bytes",
    "payload_schema",
    "retain_as",
    "failOnDataLoss",
    "allowMissing",
    "startingOffsets",
    "endingOffsets",
    "maxOffsetsPerTrigger",
    "maxBytesPerTrigger",
    "startingTimestamp",
    "endingTimestamp",
    "minPartitions",
)
#: Options of a write (batch or streaming).
WRITE_OPTIONS = (
    "channel",
    "payload_type",
    "config",
    "data_dir",
    "name",
    "sync_interval_ms",
    "segment_size_mb",
    "compaction_threshold_mb",
    "service_name",
    "correlation_id",
    "correlation_id_column",
    "batch_size",
    "connect_timeout_s",
    "retries",
    "lock_timeout_s",
    "report_path",
)
#: Options Spark itself may pass along with the user's (never an error).
#: ``path`` (``load(path)``/``save(path)``) is not one: it would be ignored.
SPARK_OPTIONS = ("checkpointLocation",)
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class Options:
    """Typed access to the data source options (keys are case-insensitive)."""

    def __init__(self, options: Any) -> None:
        self._o = {str(k).lower(): str(v) for k, v in dict(options).items()}

    def check_known(self, valid: Iterable[str], what: str) -> None:
        """Raises ValueError naming every option not in ``valid`` (nor one
        Spark adds), with the closest valid name and the list of valid ones:
        a misspelled option must not be silently ignored."""
        names = {n.lower(): n for n in valid}
        allowed = set(names) | {n.lower() for n in SPARK_OPTIONS}
        unknown = sorted(k for k in self._o if k not in allowed)
        if not unknown:
            return
        problems = []
        for key in unknown:
            close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
            hint = f" (did you mean {names[close[0]]!r}?)" if close else ""
            problems.append(f"{key!r}{hint}")
        raise ValueError(
            f"keyop data source: unknown option{'s' if len(unknown) > 1 else ''} for a "
            f"{what}: {', '.join(problems)}; valid options are: {', '.join(names.values())}"
        )

    def boolean(self, key: str, default: bool) -> bool:
        """The option as a boolean (``true``/``false``, case-insensitive;
        ``default`` when unset or empty); raises naming the option and value."""
        text = self.get(key)
        if text is None or text.strip() == "":
            return default
        value = text.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ValueError(
            f"keyop data source: option {key!r} must be a boolean (true or false), got {text!r}"
        )

    def get(self, key: str, default: str | None = None) -> str | None:
        """The option's value, or ``default`` when it is not set."""
        return self._o.get(key.lower(), default)

    def required(self, key: str, what: str) -> str:
        """The option's value; ``ValueError`` naming the option and ``what`` it is for when absent
        or empty."""
        value = self.get(key)
        if value is None or value == "":
            raise ValueError(f"keyop data source: option {key!r} is required ({what})")
        return value

    def number(self, key: str, default: float, *, minimum: float = 0.0) -> float:
        """The option as a number >= ``minimum`` (``default`` when not set); ``ValueError``
        otherwise."""
        return self._parsed(key, default, float, "a number", minimum)

    def integer(self, key: str, default: int, *, minimum: int = 0) -> int:
        """The option as an integer >= ``minimum`` (``default`` when not set); ``ValueError``
        otherwise."""
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


#: Spark SQL type names a field may start with (parameters and nested
#: types are left to Spark's parser).
_DDL_TYPES = frozenset(
    "STRING CHAR VARCHAR BOOLEAN BOOL TINYINT BYTE SMALLINT SHORT INT INTEGER BIGINT LONG "
    "FLOAT REAL DOUBLE DECIMAL DEC NUMERIC DATE TIMESTAMP TIMESTAMP_NTZ TIMESTAMP_LTZ BINARY "
    "ARRAY MAP STRUCT INTERVAL VARIANT VOID".split()
)
_DDL_FIELD_RE = re.compile(r"\s*(`(?:[^`]|``)+`|[^\s:`]+)\s*:?\s*([A-Za-z_]+)")


def check_payload_ddl(ddl: str) -> None:
    """Raises ValueError naming the option and the field when ``ddl`` is
    not a field list Spark can read: an empty field (a stray comma), a
    field without a type, or a type name Spark does not have. Spark parses
    the option inside the envelope's own DDL, so its error would point there."""
    fields: list[str] = []
    depth, quote, start = 0, None, 0
    for i, ch in enumerate(ddl):
        if quote is not None:
            quote = None if ch == quote else quote
        elif ch in "`'\"":
            quote = ch
        elif ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            fields.append(ddl[start:i])
            start = i + 1
    fields.append(ddl[start:])
    for n, field in enumerate(fields, 1):
        match = _DDL_FIELD_RE.match(field)
        if not field.strip():
            why = "is empty (a stray comma?)"
        elif match is None:
            why = "has no type"
        elif match.group(2).upper() not in _DDL_TYPES:
            why = f"has the unknown type {match.group(2)!r}"
        else:
            continue
        raise ValueError(
            f"keyop data source: option 'payload_schema' {ddl!r}: field {n} ({field.strip()!r}) "
            f"{why}; write fields as 'name TYPE, ...', e.g. 'sensor STRING, celsius DOUBLE'"
        )


def check_channel(channel: str, *, publish: bool) -> None:
    """Raises :class:`InvalidNameError` if ``channel`` is not a valid channel
    name (the engine's rule)."""
    from .. import _core
    from ..errors import InvalidNameError

    _core.validate_channel(channel)
    if publish and channel.endswith(".dead-letter"):
        raise InvalidNameError(f"cannot publish to dead-letter channel {channel!r}")


def check_subscriber_id(subscriber_id: str) -> None:
    """Raises :class:`InvalidNameError` unless ``subscriber_id`` may name a
    local subscriber (the channel-name rule, at most 244 bytes, no ``fed-`` or
    ``hub-`` prefix)."""
    from .. import _core
    from ..errors import InvalidNameError

    _core.validate_channel(subscriber_id)
    if subscriber_id.startswith(("fed-", "hub-")):
        raise InvalidNameError(
            f"invalid subscriber id {subscriber_id!r}: ids starting with 'fed-' or 'hub-' are "
            "reserved for federation cursors"
        )
    if len(subscriber_id.encode()) > 255 - len(".offset.tmp"):
        raise InvalidNameError(f"invalid subscriber id {subscriber_id!r}: too long")


def planned_path(value: str, option: str) -> str:
    """The absolute form of a path option, resolved where the read or write
    is planned: ``~`` expanded and a ``file:`` URI read as its path. A
    relative path is refused (``ValueError``) when the planning process runs
    in Spark's temporary files folder (Spark Connect runs it in the session's
    folder, which Spark deletes with the session: what was written there
    would be lost)."""
    path = value
    if path.startswith("file://"):
        path = path[len("file://") :]
        if not path.startswith("/"):
            raise ValueError(
                f"keyop data source: option {option!r}: {value!r} is not a local file URI "
                "(file:///absolute/path)"
            )
    elif path.startswith("file:"):
        path = path[len("file:") :]
    path = os.path.expanduser(path)
    if not os.path.isabs(path):
        here = os.getcwd()
        if _in_spark_temporary_folder(here):
            raise ValueError(
                f"keyop data source: option {option!r} is relative ({value!r}), and this read "
                f"or write is planned in Spark's temporary folder {here} (Spark Connect runs "
                "it in the session's folder, deleted with the session): give an absolute path"
            )
    return os.path.abspath(path)


def _in_spark_temporary_folder(directory: str) -> bool:
    """Whether ``directory`` is inside the folder Spark keeps a session's or
    application's files in (``SparkFiles.getRootDirectory()``, named
    ``userFiles-<uuid>``)."""
    real = os.path.realpath(directory)
    if f"{os.sep}userFiles-" in real:
        return True
    try:
        from pyspark import SparkFiles

        root = os.path.realpath(SparkFiles.getRootDirectory())
    except Exception:  # no SparkContext here, or not a Spark worker
        return False
    return real == root or real.startswith(root + os.sep)
