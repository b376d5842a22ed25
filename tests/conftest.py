"""Shared fixtures: configurations and messengers rooted in a test's tmp_path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keyop_messenger import Config, Messenger

NODE_NAME = "test-node"


def make_config(tmp_path: Path, **storage_overrides: Any) -> Config:
    """A validated configuration named ``test-node`` whose data_dir is ``tmp_path/data``.

    ``storage_overrides`` replace keys of the ``storage`` section, e.g.
    ``make_config(tmp_path, sync_interval_ms=20)``.
    """
    storage: dict[str, Any] = {"data_dir": str(tmp_path / "data"), **storage_overrides}
    return Config.from_dict({"name": NODE_NAME, "storage": storage})


@pytest.fixture
def config(tmp_path: Path) -> Config:
    """The default test configuration (durable mode, default segment size)."""
    return make_config(tmp_path)


@pytest.fixture
def messenger(config: Config) -> Iterator[Messenger]:
    """An open messenger on ``config``, closed after the test."""
    m = Messenger(config)
    try:
        yield m
    finally:
        m.close()
