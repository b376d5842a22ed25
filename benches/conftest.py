"""Fixtures of the pytest-benchmark suite (``pip install -e '.[bench]'``)::

    pytest benches --benchmark-only

Not part of the default test run (``testpaths = ["tests"]``). Messengers are
configured as in ``keyop-messenger bench``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from keyop_messenger import Messenger
from keyop_messenger.bench import Suite


@pytest.fixture
def relaxed(tmp_path: Path) -> Iterator[Messenger]:
    """A messenger whose publishes return after the write (fdatasync every 200 ms)."""
    with Suite(tmp_path, seconds=0, runs=1).messenger(200) as m:
        yield m


@pytest.fixture
def durable(tmp_path: Path) -> Iterator[Messenger]:
    """A messenger whose publishes return after their fdatasync."""
    with Suite(tmp_path, seconds=0, runs=1).messenger(0) as m:
        yield m
