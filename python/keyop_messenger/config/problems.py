"""Collecting configuration problems and describing offending values in their messages."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import is_dataclass


class Problems:
    """Collects problem messages and remembers keys whose values are unusable."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self._bad: set[str] = set()

    def add(self, key: str, message: str, *, bad: bool = False) -> None:
        """Records ``message`` about ``key``; ``bad`` marks the key's value unusable for later
        checks."""
        self.messages.append(f"{key}: {message}")
        if bad:
            self._bad.add(key)

    def usable(self, *keys: str) -> bool:
        """True if none of ``keys`` (nor a section or list containing it) was unusable."""
        return not any(self._is_bad(key) for key in keys)

    def _is_bad(self, key: str) -> bool:
        while key:
            if key in self._bad:
                return True
            cut = max(key.rfind("."), key.rfind("["))
            if cut <= 0:
                return False
            key = key[:cut]
        return False


def join_key(path: str, name: str) -> str:
    """The dotted key of ``name`` inside the section ``path`` (``name`` alone at the top)."""
    return f"{path}.{name}" if path else name


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def describe(value: object) -> str:
    """``"string 'abc'"``, ``"boolean True"``, ``"list"``... for problem messages."""
    name = _type_name(value)
    if value is None or isinstance(value, (Mapping, list, tuple)) or is_dataclass(value):
        return name
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{name} {text}"

