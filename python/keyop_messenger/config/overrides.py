"""Overrides of single keys of a configuration file, and its relative paths.

Precedence, highest first: command-line flags (``--set section.key=value``),
environment variables, the file, the defaults.

* Environment: ``KEYOP_<SECTION>__<KEY>`` (two underscores between section and
  key, case-insensitive), e.g. ``KEYOP_STORAGE__DATA_DIR=/var/lib/keyop``,
  ``KEYOP_HUB__LISTEN_ADDR=0.0.0.0:7740``; ``KEYOP_NAME`` sets ``name``. Other
  ``KEYOP_*`` variables without ``__`` are not configuration keys and are
  left alone.
* A value is taken as written for string and duration keys, and read as
  YAML for the others (``true``, ``5``, ``[a, b]``, ``[{name: x}]``).
* Relative paths (``storage.data_dir``, ``tls.cert``, ``tls.key``, ``tls.ca``)
  written in a file are relative to the file's folder (with
  ``resolve_paths``); those given by the environment or a flag are relative to
  the current directory, as usual for them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import fields
from typing import Any

from .schema import SECTIONS, ConfigFields

__all__ = ["ENV_PREFIX", "PATH_KEYS", "Override", "apply", "collect", "resolve_paths"]

ENV_PREFIX = "KEYOP_"

#: Keys holding file system paths: (section, key).
PATH_KEYS: tuple[tuple[str, str], ...] = (
    ("storage", "data_dir"),
    ("tls", "cert"),
    ("tls", "key"),
    ("tls", "ca"),
)

#: ``(source, dotted key, raw value)``; source is how the user wrote it.
Override = tuple[str, str, str]


def resolve_paths(document: MutableMapping[str, Any], base_dir: str) -> None:
    """Makes the relative path values of ``document`` relative to ``base_dir``."""
    for section, key in PATH_KEYS:
        values = document.get(section)
        if not isinstance(values, MutableMapping):
            continue
        value = values.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value):
            values[key] = os.path.normpath(os.path.join(base_dir, value))


def collect(environ: Mapping[str, str], sets: Sequence[str]) -> tuple[list[Override], list[str]]:
    """The overrides from ``environ`` then ``sets`` (``key=value`` flags) in
    the order to apply them, and the problems of malformed ones."""
    out: list[Override] = []
    problems: list[str] = []
    for name in sorted(environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        if rest == "name":
            out.append((name, "name", environ[name]))
        elif "__" in rest:
            section, _, key = rest.partition("__")
            out.append((name, f"{section}.{key}", environ[name]))
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item}: expected section.key=value")
            continue
        out.append((f"--set {key.strip()}", key.strip(), value))
    return out, problems


def _field_type(dotted: str) -> tuple[str | None, str]:
    """The declared type of ``dotted`` (None if unknown) and a hint for the problem."""
    section, _, key = dotted.partition(".")
    top = {f.name: f.type for f in fields(ConfigFields)}
    if not key:
        kind = top.get(section)
        if kind is None or kind in SECTIONS:
            return None, "expected name or section.key"
        return str(kind), ""
    kind = top.get(section)
    if kind not in SECTIONS:
        return None, f"unknown section {section!r} (sections: {', '.join(sorted(top))})"
    keys = {f.name: f.type for f in fields(SECTIONS[str(kind)])}
    if key not in keys:
        return None, f"unknown key {key!r} in section {section} (keys: {', '.join(keys)})"
    return str(keys[key]), ""


def apply(document: MutableMapping[str, Any], overrides: Sequence[Override]) -> list[str]:
    """Sets every override in ``document`` (the parsed file); returns problems."""
    import yaml

    problems: list[str] = []
    for source, dotted, raw in overrides:
        kind, hint = _field_type(dotted)
        if kind is None:
            problems.append(f"{source}: {hint}")
            continue
        value: Any = raw
        if kind not in ("str", "datetime.timedelta"):
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError:
                problems.append(f"{source}: {dotted}: not a valid YAML value: {raw!r}")
                continue
        section, _, key = dotted.partition(".")
        if not key:
            document[section] = value
            continue
        values = document.get(section)
        if values is None:
            values = document[section] = {}
        if isinstance(values, MutableMapping):
            values[key] = value
        # otherwise the section itself is wrong: validation reports it
    return problems
