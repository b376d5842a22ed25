"""Options of the ``keyop`` data source: typed access, defaults, the envelope
schema, and the checks of channel and subscriber names."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:

    pass


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
_N = TypeVar("_N", int, float)


class Options:
    """Typed access to the data source options (keys are case-insensitive)."""

    def __init__(self, options: Any) -> None:
        self._o = {str(k).lower(): str(v) for k, v in dict(options).items()}

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

    def boolean(self, key: str, default: bool) -> bool:
        """``true`` / ``false`` (any case; ``default`` when unset or empty)."""
        text = (self.get(key) or "").strip().lower()
        if text == "":
            return default
        if text not in ("true", "false"):
            raise ValueError(
                f"keyop data source: option {key!r} must be 'true' or 'false', got {text!r}"
            )
        return text == "true"

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
