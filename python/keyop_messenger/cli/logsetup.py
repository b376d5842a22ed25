"""Logging of the ``run`` command: level from ``-v``/``-q``, text or JSON lines on stderr.

The library itself only has loggers under ``keyop_messenger`` (the engine's
Rust log events arrive there too, through pyo3-log) and a ``NullHandler``;
an application configures logging itself. ``run`` is such an application.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time
from typing import TextIO

__all__ = [
    "JsonFormatter",
    "level_for",
    "set_package_level",
    "setup_command_logging",
    "setup_logging",
]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Loggers of the engine's dependencies that log through it (pyo3-log names
#: a Rust target ``keyop_messenger.<target>``): ``-v`` leaves them at INFO,
#: ``-vv`` shows their DEBUG lines too.
DEPENDENCY_LOGGERS = ("rustls", "tungstenite", "tokio_tungstenite", "iana_time_zone")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (RFC 3339 UTC), ``level``, ``logger``,
    ``message`` (and ``exc`` with the traceback when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        """``record`` as one line of JSON."""
        ts = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        doc = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def level_for(verbose: int, quiet: int, configured: str = "") -> int:
    """``-v`` DEBUG (``-vv`` DEBUG for every logger, not only keyop_messenger);
    ``-q`` WARNING, ``-qq`` ERROR; without them ``configured`` (``log.level``),
    INFO if empty."""
    if verbose:
        return logging.DEBUG
    if quiet:
        return logging.WARNING if quiet == 1 else logging.ERROR
    return logging.getLevelName(configured.upper()) if configured else logging.INFO


def set_package_level(level: int) -> None:
    """Sets the level of the ``keyop_messenger`` loggers, the engine's included
    (pyo3-log caches levels: the cache is reset)."""
    from .. import _core

    logging.getLogger("keyop_messenger").setLevel(level)
    _core.reset_log_cache()


class _CurrentStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of the record."""

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


_COMMAND_HANDLER: logging.Handler | None = None


def setup_command_logging() -> None:
    """Warnings and errors of the package on stderr for the operator commands
    (the package itself only has a NullHandler). Idempotent."""
    global _COMMAND_HANDLER
    if _COMMAND_HANDLER is None:
        _COMMAND_HANDLER = _CurrentStderr()
        _COMMAND_HANDLER.setLevel(logging.WARNING)
        _COMMAND_HANDLER.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logging.getLogger("keyop_messenger").addHandler(_COMMAND_HANDLER)


def setup_logging(
    verbose: int = 0,
    quiet: int = 0,
    fmt: str = "text",
    stream: TextIO | None = None,
    configured: str = "",
) -> logging.Handler:
    """Sends ``keyop_messenger.*`` records (every logger's with ``-vv``) to
    ``stream`` (stderr) in ``fmt`` (``text`` or ``json``); returns the handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter(TEXT_FORMAT)
        formatter.converter = time.gmtime
        formatter.default_time_format = "%Y-%m-%dT%H:%M:%S"
        formatter.default_msec_format = "%s.%03dZ"
        handler.setFormatter(formatter)
    global _COMMAND_HANDLER
    level = level_for(verbose, quiet, configured)
    package = logging.getLogger("keyop_messenger")
    if _COMMAND_HANDLER is not None:
        package.removeHandler(_COMMAND_HANDLER)
        _COMMAND_HANDLER = None
    package.setLevel(level)
    for dep in DEPENDENCY_LOGGERS:
        quiet_dep = verbose == 1
        logging.getLogger(f"keyop_messenger.{dep}").setLevel(
            logging.INFO if quiet_dep else logging.NOTSET
        )
    if verbose >= 2:
        root = logging.getLogger()
        root.setLevel(logging.DEBUG)
        root.addHandler(handler)
    else:
        package.addHandler(handler)
        package.propagate = False
    return handler

