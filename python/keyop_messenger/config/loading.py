"""Loading: a YAML file or a mapping becomes a :class:`Config`, and back to a mapping.

:class:`Config` is the root dataclass (its fields are in :class:`.schema.ConfigFields`)
with the methods that build it from a mapping, export it and validate it.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, fields, is_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import yaml

from ..errors import ConfigError
from .durations import format_duration, parse_duration
from .problems import Problems, describe, join_key
from .schema import ITEM_LISTS, SECTIONS, ConfigFields, TLSConfig
from .validation import check_config


class Config(ConfigFields):
    """The whole configuration of one messenger instance (the YAML document).

    The fields and their defaults are declared in :class:`.schema.ConfigFields`.
    Build it with :meth:`from_dict` / :func:`load_config` (which validate), or in
    code followed by :meth:`validate`. ``Messenger`` calls :meth:`validate` on the
    configuration it receives as well.

    Attributes:
        name: Instance name: ``origin`` of locally published envelopes,
            ``instance_name`` in the federation handshake, used in logs. Defaults to
            the OS host name; must be non-empty and should equal the CN of
            ``tls.cert``.
        storage: The ``storage`` section.
        subscribers: The ``subscribers`` section.
        hub: The ``hub`` section.
        client: The ``client`` section.
        tls: The ``tls`` section.
        federation: The ``federation`` section.
        dedup: The ``dedup`` section.
        audit: The ``audit`` section.
        metrics: The ``metrics`` section.
        log: The ``log`` section.
        retention: The ``retention`` section.
    """

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Config:
        """Build a configuration from a parsed YAML document (nested mappings) and validate it.

        Absent keys and YAML ``null`` values take their defaults. A duration may be
        a Go duration string, the integer 0 or a ``datetime.timedelta``.

        Raises:
            ConfigError: listing every problem found (unknown keys, wrong types,
                invalid values).
        """
        problems = Problems()
        if not isinstance(d, Mapping):
            raise ConfigError(
                [f"the configuration must be a mapping of keys to values, got {describe(d)}"]
            )
        config = _build(cls, d, "", problems)
        check_config(config, problems)
        if problems.messages:
            raise ConfigError(problems.messages)
        return config

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Config:
        """Read a YAML configuration file and validate it: :func:`load_config`.

        Raises:
            ConfigError: as :func:`load_config`.
        """
        config = load_config(path)
        assert isinstance(config, cls)
        return config

    def to_dict(self) -> dict[str, Any]:
        """Return the configuration in the YAML shape (durations as Go duration strings).

        ``Config.from_dict(config.to_dict()) == config`` for a valid configuration.
        """
        result = _to_plain(self)
        assert isinstance(result, dict)
        return result

    def validate(self) -> None:
        """Check the configuration; raise :class:`ConfigError` listing every problem.

        Useful for a configuration built in code; :meth:`from_dict` and
        :func:`load_config` already call it, and so does ``Messenger``.
        """
        problems = Problems()
        check_config(self, problems)
        if problems.messages:
            raise ConfigError(problems.messages)


def as_config(config: Config | Mapping[str, Any] | str | os.PathLike[str]) -> Config:
    """A :class:`Config` from what a messenger's constructor accepts: a
    ``Config`` (returned as is), a mapping (:meth:`Config.from_dict`) or the
    path of a YAML file (:func:`load_config`)."""
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return Config.from_dict(config)
    return load_config(config)


def load_config(
    path: str | os.PathLike[str],
    *,
    resolve_paths: bool = False,
    environ: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """Read a YAML configuration file and return the validated :class:`Config`.

    By default the file is read as keyop-messenger 1.4 reads it. The
    ``keyop-messenger`` command passes the options (``docs/service.md``):

    Args:
        path: the YAML file.
        resolve_paths: relative paths in the file (``storage.data_dir``,
            ``tls.cert``, ``tls.key``, ``tls.ca``) are relative to the file's
            folder instead of the current directory.
        environ: environment whose ``KEYOP_<SECTION>__<KEY>`` variables (and
            ``KEYOP_NAME``) override keys of the file (see :mod:`.overrides`).
        overrides: ``section.key=value`` strings overriding the environment and
            the file.

    Raises:
        ConfigError: the file cannot be read, is empty, is not valid YAML, its top
            level is not a mapping, or the configuration is invalid (every problem
            is listed).
    """
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as stream:
            text = stream.read()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError([f"cannot read configuration file: {reason}"], path=name) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"configuration file is not UTF-8 text: {exc}"], path=name) from exc
    import yaml  # only configuration files need it; importing it costs ~2 MB of RSS

    try:
        document = yaml.load(text, Loader=_strict_loader())  # a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError([f"malformed YAML: {_describe_yaml_error(exc)}"], path=name) from exc
    if document is None:
        raise ConfigError(["configuration file is empty"], path=name)
    if not isinstance(document, Mapping):
        kind = describe(document)
        raise ConfigError(
            [f"the top level must be a mapping of keys to values, got {kind}"], path=name
        )
    if not (resolve_paths or environ or overrides):
        try:
            return Config.from_dict(document)
        except ConfigError as err:
            raise ConfigError(err.problems, path=name) from None
    from . import overrides as _overrides

    document = dict(document)
    if resolve_paths:
        _overrides.resolve_paths(document, os.path.dirname(os.path.abspath(name)))
    found, problems = _overrides.collect(environ or {}, overrides)
    problems += _overrides.apply(document, found)
    if problems:
        raise ConfigError(problems, path=name)
    try:
        return Config.from_dict(document)
    except ConfigError as err:
        # Name the variable or flag that set a key a problem is about.
        sources = {dotted: source for source, dotted, _ in found}
        problems = [_with_source(p, sources) for p in err.problems]
        raise ConfigError(problems, path=name) from None


def _with_source(problem: str, sources: Mapping[str, str]) -> str:
    key = problem.partition(":")[0]
    while key:
        if key in sources:
            return f"{problem} (set by {sources[key]})"
        # hub.allowed_peers[0].name -> hub.allowed_peers[0] -> hub.allowed_peers
        key = key[: key.rindex("[")] if key.endswith("]") else key.rpartition(".")[0]
    return problem


# ---------------------------------------------------------------------------
# Implementation: building from a mapping
# ---------------------------------------------------------------------------

_UNKNOWN_KEY_HINTS: dict[str, str] = {
    "storage.max_segment_bytes": (
        "the segment size is set by storage.segment_size_mb, in MiB"
    ),
}


@functools.cache
def _strict_loader() -> type[yaml.SafeLoader]:
    """A SafeLoader that refuses a key given twice in one mapping (as Go's
    yaml.v3, which 1.4 reads with, does): the second silently replaced the
    first. Keys brought in by a merge (``<<``) may be overridden, as YAML says."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # unhashable: the base class reports it
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"key {key!r} is given twice",
                        key_node.start_mark,
                    )
                seen.add(key)
            return super().construct_mapping(node, deep)

    return StrictLoader


def _describe_yaml_error(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def _build(cls: type, raw: Mapping[Any, Any], path: str, problems: Problems) -> Any:
    """Instantiate dataclass ``cls`` from mapping ``raw``; structural problems go to ``problems``.

    Scalars are passed through unchanged (type checks happen in ``_check_config``);
    sections and list items are built recursively, durations parsed, and unknown keys
    reported.
    """
    known = {f.name: f for f in fields(cls)}
    for key in raw:
        if key not in known:
            _report_unknown_key(path, key, list(known), problems)
    kwargs: dict[str, Any] = {}
    for name, spec in known.items():
        key = join_key(path, name)
        if name not in raw or raw[name] is None:
            if spec.default is MISSING and spec.default_factory is MISSING:
                kwargs[name] = ""  # required field of a list item; reported as missing
            continue
        value = raw[name]
        kind = spec.type
        if kind in SECTIONS:
            if isinstance(value, Mapping):
                kwargs[name] = _build(SECTIONS[kind], value, key, problems)
            else:
                problems.add(key, f"must be a mapping, got {describe(value)}", bad=True)
        elif kind in ITEM_LISTS:
            kwargs[name] = _build_items(ITEM_LISTS[kind], value, key, problems)
        elif kind == "datetime.timedelta":
            ttl = _to_duration(value, key, problems)
            if ttl is not None:
                kwargs[name] = ttl if ttl else spec.default  # zero means default
        elif kind == "float" and isinstance(value, int) and not isinstance(value, bool):
            kwargs[name] = float(value)
        elif kind == "list[str]" and isinstance(value, (list, tuple)):
            kwargs[name] = list(value)
        elif cls is TLSConfig and name == "min_version" and isinstance(value, float) \
                and value in (1.2, 1.3):
            kwargs[name] = str(value)  # unquoted YAML number 1.2 / 1.3
        else:
            kwargs[name] = value
    return cls(**kwargs)


def _report_unknown_key(path: str, key: object, known: list[str], problems: Problems) -> None:
    dotted = join_key(path, str(key))
    hint = _UNKNOWN_KEY_HINTS.get(dotted)
    if hint is None and isinstance(key, str):
        import difflib  # only for a mistyped key; not imported at start-up

        close = difflib.get_close_matches(key, known, n=1)
        if close:
            hint = f"did you mean {join_key(path, close[0])}?"
        else:
            where = f"in {path}" if path else "at the top level"
            hint = f"the keys {where} are: {', '.join(known)}"
    problems.add(dotted, f"unknown key ({hint})" if hint else "unknown key")


def _build_items(cls: type, value: Any, key: str, problems: Problems) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        problems.add(key, f"must be a list of mappings, got {describe(value)}", bad=True)
        return []
    items: list[Any] = []
    for index, entry in enumerate(value):
        item_key = f"{key}[{index}]"
        if isinstance(entry, cls):
            items.append(entry)
        elif isinstance(entry, Mapping):
            items.append(_build(cls, entry, item_key, problems))
        else:
            problems.add(item_key, f"must be a mapping, got {describe(entry)}", bad=True)
            items.append(_build(cls, {}, item_key, problems))  # placeholder keeps indices
    return items


def _to_duration(value: Any, key: str, problems: Problems) -> datetime.timedelta | None:
    """Convert a YAML value to a duration, or report it and return None."""
    if isinstance(value, datetime.timedelta):
        return value
    if isinstance(value, bool):
        problems.add(key, f"must be a duration such as \"168h\", got {describe(value)}",
                     bad=True)
        return None
    if isinstance(value, (int, float)):
        if value == 0:
            return datetime.timedelta(0)
        problems.add(
            key,
            f"a bare number is not a duration, add a unit (for example \"{value}s\"), "
            f"got {describe(value)}",
            bad=True,
        )
        return None
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except ValueError as exc:
            problems.add(key, str(exc), bad=True)
            return None
    problems.add(key, f"must be a duration such as \"168h\", got {describe(value)}", bad=True)
    return None


def _to_plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(item) for item in value]
    if isinstance(value, datetime.timedelta):
        return format_duration(value)
    return value

