"""Messages and payload classes shared by the pytest-benchmark suite (those of
``keyop-messenger bench``)."""

from __future__ import annotations

import dataclasses

import pydantic

from keyop_messenger.bench import PAYLOAD, TYPE

CHANNEL = "bench"
__all__ = ["CHANNEL", "PAYLOAD", "TYPE", "Reading", "ReadingModel"]


@dataclasses.dataclass
class Reading:
    """``PAYLOAD`` as a dataclass."""

    sensor: str
    celsius: float
    seq: int
    ok: bool


class ReadingModel(pydantic.BaseModel):
    """``PAYLOAD`` as a pydantic model."""

    sensor: str
    celsius: float
    seq: int
    ok: bool

