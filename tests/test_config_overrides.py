"""Environment overrides ``KEYOP_<SECTION>__<KEY>``, ``--set`` flags, and
relative paths of a configuration file resolved against the file's folder."""

from __future__ import annotations

import datetime
import os
import signal
from pathlib import Path

import pytest

from keyop_messenger import ConfigError, load_config
from run_helpers import running, write_config


def _file(tmp_path: Path, text: str) -> Path:
    folder = tmp_path / "conf"
    folder.mkdir(exist_ok=True)
    path = folder / "keyop.yaml"
    path.write_text(text)
    return path


def test_environment_overrides_keys(tmp_path: Path) -> None:
    path = _file(tmp_path, "name: a\nstorage:\n  data_dir: /file\n")
    env = {
        "KEYOP_STORAGE__DATA_DIR": "/from-env",
        "KEYOP_METRICS__LISTEN_ADDR": "127.0.0.1:9464",
        "KEYOP_NAME": "b",
        "KEYOP_SUBSCRIBERS__OFFSET_TTL": "2h",
        "KEYOP_SUBSCRIBERS__MAX_RETRIES": "7",
        "KEYOP_HUB__ALLOWED_PEERS": "[{name: p1, publish: [temps]}]",
        "KEYOP_MESSENGER_CONFIG": "ignored: no double underscore",
        "PATH": os.environ.get("PATH", ""),
    }
    cfg = load_config(path, environ=env)
    assert cfg.storage.data_dir == "/from-env"
    assert cfg.metrics.listen_addr == "127.0.0.1:9464"
    assert cfg.name == "b"
    assert cfg.subscribers.offset_ttl == datetime.timedelta(hours=2)
    assert cfg.subscribers.max_retries == 7
    assert [(p.name, p.publish) for p in cfg.hub.allowed_peers] == [("p1", ["temps"])]


def test_precedence_flags_environment_file_defaults(tmp_path: Path) -> None:
    path = _file(tmp_path, "name: a\nstorage:\n  data_dir: /d\n  sync_interval_ms: 5\n")
    env = {"KEYOP_STORAGE__SYNC_INTERVAL_MS": "7"}
    flag = ["storage.sync_interval_ms=9"]
    assert load_config(path, environ=env, overrides=flag).storage.sync_interval_ms == 9
    assert load_config(path, environ=env).storage.sync_interval_ms == 7
    assert load_config(path).storage.sync_interval_ms == 5
    bare = _file(tmp_path, "name: a\nstorage:\n  data_dir: /d\n")
    assert load_config(bare).storage.sync_interval_ms == 0


def test_bad_overrides_name_their_source(tmp_path: Path) -> None:
    path = _file(tmp_path, "name: a\nstorage:\n  data_dir: /d\n")
    with pytest.raises(ConfigError) as info:
        load_config(
            path,
            environ={"KEYOP_STORAGE__DATADIR": "/x", "KEYOP_NOPE__X": "1"},
            overrides=["storage.sync_interval_ms"],
        )
    problems = info.value.problems
    assert any(p.startswith("KEYOP_NOPE__X: unknown section 'nope'") for p in problems)
    assert any(
        p.startswith("KEYOP_STORAGE__DATADIR: unknown key 'datadir' in section storage")
        for p in problems
    )
    assert "--set storage.sync_interval_ms: expected section.key=value" in problems
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={"KEYOP_STORAGE__SYNC_INTERVAL_MS": "abc"})
    assert info.value.problems == [
        "storage.sync_interval_ms: must be an integer, got string 'abc' "
        "(set by KEYOP_STORAGE__SYNC_INTERVAL_MS)"
    ]
    # A problem inside a list item a variable set names the variable too.
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={"KEYOP_HUB__ALLOWED_PEERS": '[{name: "bad name"}]'})
    (problem,) = info.value.problems
    assert problem.startswith("hub.allowed_peers[0].name: ")
    assert problem.endswith("(set by KEYOP_HUB__ALLOWED_PEERS)")


def test_relative_paths_resolve_against_the_file_folder(tmp_path: Path) -> None:
    text = (
        "name: a\nstorage:\n  data_dir: data\n"
        "tls:\n  cert: certs/a.crt\n  key: a.key\n  ca: /etc/ca.crt\n"
    )
    path = _file(tmp_path, text)
    folder = path.parent
    cfg = load_config(path, resolve_paths=True)
    assert cfg.storage.data_dir == str(folder / "data")
    assert cfg.tls.cert == str(folder / "certs" / "a.crt")
    assert cfg.tls.key == str(folder / "a.key")
    assert cfg.tls.ca == "/etc/ca.crt"
    # As keyop-messenger 1.4 reads it unless asked: relative to the current directory.
    assert load_config(path).storage.data_dir == "data"
    # A relative path from the environment stays relative to the current directory.
    env = {"KEYOP_STORAGE__DATA_DIR": "elsewhere"}
    assert load_config(path, resolve_paths=True, environ=env).storage.data_dir == "elsewhere"


def test_run_uses_file_folder_environment_and_flags(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    cfg = write_config(
        tmp_path / "conf" / "keyop.yaml", {"name": "solo", "storage": {"data_dir": "data"}}
    )
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    with running(["--config", str(cfg)], cwd=cwd) as solo:
        solo.wait_ready()
        assert solo.stop(signal.SIGTERM) == 0
    assert (tmp_path / "conf" / "data" / "channels").is_dir()
    assert not (cwd / "data").exists()
    env = {"KEYOP_STORAGE__DATA_DIR": str(tmp_path / "env-data")}
    with running(["--config", str(cfg)], env=env, cwd=cwd) as solo:
        found = solo.wait_line(r"ready \(data_dir (.*)\)")
        assert found.group(1) == str(tmp_path / "env-data")
        assert solo.stop() == 0
    flag = f"storage.data_dir={tmp_path / 'flag-data'}"
    with running(["--config", str(cfg), "--set", flag], env=env, cwd=cwd) as solo:
        found = solo.wait_line(r"ready \(data_dir (.*)\)")
        assert found.group(1) == str(tmp_path / "flag-data")
        assert solo.stop() == 0


def test_log_level_key(tmp_path: Path) -> None:
    path = _file(tmp_path, "name: a\nstorage:\n  data_dir: /d\nlog:\n  level: warning\n")
    assert load_config(path).log.level == "warning"
    assert load_config(path, environ={"KEYOP_LOG__LEVEL": "debug"}).log.level == "debug"
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides=["log.level=loud"])
    assert info.value.problems == [
        'log.level: must be "debug", "info", "warning" or "error", got \'loud\' '
        "(set by --set log.level)"
    ]
