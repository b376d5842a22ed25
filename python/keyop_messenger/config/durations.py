"""Durations in Go ``time.ParseDuration`` / ``Duration.String`` syntax (``"168h"``, ``"1.5s"``)."""

from __future__ import annotations

import datetime
import re

__all__ = ["format_duration", "parse_duration"]

_NS_PER_UNIT: dict[str, int] = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # micro sign
    "\u03bcs": 1_000,  # Greek small letter mu
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60 * 1_000_000_000,
    "h": 3600 * 1_000_000_000,
}
_UNIT_PATTERN = "ns|us|\u00b5s|\u03bcs|ms|s|m|h"
_NUMBER_PATTERN = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_DURATION_RE = re.compile(rf"[+-]?(?:{_NUMBER_PATTERN}(?:{_UNIT_PATTERN}))+")
_DURATION_TERM_RE = re.compile(rf"({_NUMBER_PATTERN})({_UNIT_PATTERN})")
_BARE_NUMBER_RE = re.compile(rf"[+-]?{_NUMBER_PATTERN}")
_MAX_DURATION_NS = 2**63 - 1  # Go's time.Duration is an int64 count of nanoseconds


def parse_duration(text: str) -> datetime.timedelta:
    """Parse a Go duration string such as ``"168h"``, ``"1h30m"``, ``"500ms"`` or ``"-1h"``.

    A duration is an optional sign followed by one or more decimal numbers,
    each with an optional fraction and a unit suffix: ``ns``, ``us`` (or
    ``µs``), ``ms``, ``s``, ``m``, ``h``. The string ``"0"`` (optionally
    signed) is the only number accepted without a unit. The result is
    truncated to whole microseconds (``timedelta``'s resolution).

    Raises:
        ValueError: ``text`` is not valid duration syntax or is out of the
            range of a Go duration (about 292 years).
        TypeError: ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise TypeError(f"a duration must be a string such as \"168h\", got {text!r}")
    sign, body = 1, text
    if body[:1] in ("+", "-"):
        sign = -1 if body[0] == "-" else 1
        body = body[1:]
    if body == "0":
        return datetime.timedelta(0)
    if not _DURATION_RE.fullmatch(text):
        if _BARE_NUMBER_RE.fullmatch(text):
            raise ValueError(
                f"invalid duration {text!r}: missing unit (for example \"{body}s\"; "
                "units: ns, us, ms, s, m, h)"
            )
        raise ValueError(
            f"invalid duration {text!r}: expected Go duration syntax such as "
            "\"168h\", \"1h30m\" or \"500ms\" (units: ns, us, ms, s, m, h)"
        )
    # Exact, in integers (fractions would pull in decimal): every fraction is padded
    # to as many decimal places as the longest one, so the terms add up as integers
    # scaled by 10**places; the total is truncated once, like Go.
    terms: list[tuple[str, str]] = _DURATION_TERM_RE.findall(body)
    places = max(len(number.partition(".")[2]) for number, _ in terms)
    scale: int = 10**places
    scaled = 0
    for number, unit in terms:
        whole, _, frac = number.partition(".")
        mantissa = int(whole or "0") * scale + int(frac.ljust(places, "0") or "0")
        scaled += mantissa * _NS_PER_UNIT[unit]
    nanoseconds = scaled // scale
    if nanoseconds > _MAX_DURATION_NS:
        raise ValueError(f"invalid duration {text!r}: out of range")
    return sign * datetime.timedelta(microseconds=nanoseconds // 1000)


def _format_fraction(value: int, precision: int) -> tuple[str, int]:
    """Split ``value`` into ``value // 10**precision`` and its fraction text (Go's fmtFrac)."""
    scale = 10**precision
    digits = f"{value % scale:0{precision}d}".rstrip("0")
    return ("." + digits if digits else ""), value // scale


def format_duration(td: datetime.timedelta) -> str:
    """Render ``td`` the way Go's ``time.Duration.String`` does (``"168h0m0s"``, ``"1.5s"``).

    :func:`parse_duration` reads the result back to the same value.
    """
    total_us = (td.days * 86_400 + td.seconds) * 1_000_000 + td.microseconds
    nanoseconds = abs(total_us) * 1000
    sign = "-" if total_us < 0 else ""
    if nanoseconds == 0:
        return "0s"
    if nanoseconds < 1_000_000_000:
        if nanoseconds < 1_000:
            unit, precision = "ns", 0
        elif nanoseconds < 1_000_000:
            unit, precision = "\u00b5s", 3
        else:
            unit, precision = "ms", 6
        fraction, whole = _format_fraction(nanoseconds, precision)
        return f"{sign}{whole}{fraction}{unit}"
    fraction, seconds = _format_fraction(nanoseconds, 9)
    text = f"{seconds % 60}{fraction}s"
    minutes = seconds // 60
    if minutes:
        text = f"{minutes % 60}m{text}"
        hours = minutes // 60
        if hours:
            text = f"{hours}h{text}"
    return sign + text
