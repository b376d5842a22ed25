"""Readers never create paths: ``read_channel`` (the module function and the
Messenger method) on a data directory or channel that does not exist raises
:class:`DataDirNotFoundError` / :class:`ChannelNotFoundError` at the call and
leaves the path absent. Only opening a Messenger creates its data_dir.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from keyop_messenger import (
    ChannelNotFoundError,
    Config,
    DataDirNotFoundError,
    InvalidNameError,
    Messenger,
    StorageError,
    read_channel,
)


def test_read_channel_of_a_missing_data_dir(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DataDirNotFoundError, match="does not exist") as info:
        read_channel(missing, "temps")  # raises at the call, before any next()
    assert str(missing) in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, StorageError)
    assert not missing.exists()


def test_read_channel_of_a_missing_channel(tmp_path: Path, config: Config) -> None:
    with Messenger(config) as m:
        m.publish("temps", "test.Reading", {})
    data = Path(config.storage.data_dir)
    with pytest.raises(ChannelNotFoundError, match='"humidity" does not exist') as info:
        read_channel(data, "humidity")
    assert isinstance(info.value, FileNotFoundError)
    assert not (data / "channels" / "humidity").exists()
    # An existing channel still reads.
    assert len(list(read_channel(data, "temps"))) == 1


def test_read_channel_checks_the_name_first(tmp_path: Path) -> None:
    with pytest.raises(InvalidNameError):
        read_channel(tmp_path / "nope", "../etc")
    assert not (tmp_path / "nope").exists()


def test_messenger_read_channel_of_a_missing_channel(config: Config) -> None:
    with Messenger(config) as m:
        with pytest.raises(ChannelNotFoundError, match='"humidity" does not exist'):
            m.read_channel("humidity")
        assert not (Path(config.storage.data_dir) / "channels" / "humidity").exists()
        m.publish("humidity", "test.Reading", {})
        assert len(list(m.read_channel("humidity"))) == 1
        # stream_end of a channel not there is still 0, and creates nothing.
        assert m.stream_end("pressure") == 0
        assert not (Path(config.storage.data_dir) / "channels" / "pressure").exists()


def test_only_opening_a_messenger_creates_the_data_dir(tmp_path: Path) -> None:
    data = tmp_path / "fresh"
    with pytest.raises(DataDirNotFoundError):
        read_channel(data, "temps")
    assert not data.exists()
    with Messenger(Config.from_dict({"name": "n", "storage": {"data_dir": str(data)}})):
        pass
    assert data.is_dir()


# ---------------------------------------------------------------------------
# The CLI: a missing data directory or channel is exit status 2, one line
# "Error: ..." on stderr, and nothing is created.
# ---------------------------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str]:
    from keyop_messenger.cli import main

    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


def write_config(tmp_path: Path, data: Path) -> Path:
    cfg = tmp_path / "keyop.yaml"
    cfg.write_text(f"name: n\nstorage:\n  data_dir: {data}\n")
    return cfg


@pytest.mark.parametrize(
    "command",
    [
        ["tail", "--data-dir", "{data}", "temps"],
        ["tail", "--data-dir", "{data}", "temps", "-f"],
        ["dead-letters", "--data-dir", "{data}", "temps"],
        ["stats", "--config", "{cfg}"],
        ["dead-letters", "replay", "--config", "{cfg}", "temps"],
    ],
)
def test_cli_on_a_missing_data_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    data = tmp_path / "nope"
    cfg = write_config(tmp_path, data)
    argv = [a.format(data=data, cfg=cfg) for a in command]
    code, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert err.startswith("Error: ") and err.count("\n") == 1, err
    assert "does not exist" in err and str(data) in err
    assert not data.exists()


@pytest.mark.parametrize(
    "command",
    [
        ["tail", "--data-dir", "{data}", "humidity"],
        ["dead-letters", "--data-dir", "{data}", "humidity"],
        ["dead-letters", "replay", "--config", "{cfg}", "humidity"],
    ],
)
def test_cli_on_a_missing_channel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    data = tmp_path / "data"
    cfg = write_config(tmp_path, data)
    with Messenger(Config.from_dict({"name": "n", "storage": {"data_dir": str(data)}})) as m:
        m.publish("temps", "test.Reading", {})
    argv = [a.format(data=data, cfg=cfg) for a in command]
    code, err = run_cli(capsys, *argv)
    assert code == 2, err
    assert err.startswith("Error: ") and err.count("\n") == 1, err
    assert 'channel "humidity' in err and "does not exist" in err
    assert not (data / "channels" / "humidity").exists()
    assert not (data / "channels" / "humidity.dead-letter").exists()
