# why this file is long: 63 tests, one or more per config key and problem message, sharing the
# FULL_EXAMPLE document and its helpers.
"""Tests of keyop_messenger.config: defaults, loading, durations and validation."""

from __future__ import annotations

import datetime
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from keyop_messenger.config import (
    DEFAULT_FED_CLIENT_OFFSET_TTL,
    AllowedPeer,
    AuditConfig,
    ClientConfig,
    Config,
    DedupConfig,
    FederationConfig,
    HubConfig,
    HubEndpoint,
    StorageConfig,
    SubscribersConfig,
    TLSConfig,
    format_duration,
    load_config,
    parse_duration,
)
from keyop_messenger.errors import ConfigError

td = datetime.timedelta

FULL_EXAMPLE = """\
name: billing-host                 # must equal the CN in tls.cert
storage:
  data_dir: /var/lib/keyop/billing
  sync_interval_ms: 0
  max_subscriber_lag_mb: 512
  segment_size_mb: 256             # 1.4 name: compaction_threshold_mb
  offset_flush_interval_ms: 0
subscribers:
  max_retries: 5
hub:
  enabled: true
  listen_addr: "0.0.0.0:7740"
  fed_client_offset_ttl: "168h"
  allowed_peers:
    - name: sensor-1
      publish: [temps]
    - name: dash-1
      subscribe: [alerts, metrics]
client:
  enabled: true
  hubs:
    - addr: "hub2.example.net:7740"
      subscribe: [commands]
      publish: [alerts]
tls:
  cert: /etc/keyop/billing-host.crt
  key:  /etc/keyop/billing-host.key
  ca:   /etc/keyop/ca.crt
  min_version: "1.3"
  expiry_warn_days: 30
federation:
  reconnect_base_ms: 500
  reconnect_max_ms: 60000
  reconnect_jitter: 0.2
  send_buffer_messages: 10000
  max_batch_bytes: 4194304
dedup:
  seen_id_lru_size: 100000
audit:
  max_size_mb: 100
  max_files: 10
"""


def minimal(**sections: Any) -> dict[str, Any]:
    """A valid configuration mapping, with ``sections`` merged over it."""
    d: dict[str, Any] = {"name": "test", "storage": {"data_dir": "/tmp/keyop"}}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict):
            d[key] = {**d[key], **value}
        else:
            d[key] = value
    return d


def problems_of(d: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        Config.from_dict(d)
    return info.value.problems


def keys_of(problems: list[str]) -> list[str]:
    return [p.split(":", 1)[0] for p in problems]


def write(tmp_path: Path, text: str, name: str = "keyop.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- defaults


def test_section_defaults_match_spec() -> None:
    assert StorageConfig() == StorageConfig(
        data_dir="",
        sync_interval_ms=0,
        max_subscriber_lag_mb=512,
        segment_size_mb=None,
        compaction_threshold_mb=None,
        offset_flush_interval_ms=0,
    )
    assert StorageConfig().segment_mb() == 256
    assert SubscribersConfig().max_retries == 5
    hub = HubConfig()
    assert hub.enabled is False
    assert hub.listen_addr == ""
    assert hub.allowed_peers == []
    assert hub.fed_client_offset_ttl == td(hours=168) == DEFAULT_FED_CLIENT_OFFSET_TTL
    assert ClientConfig() == ClientConfig(enabled=False, hubs=[])
    assert TLSConfig() == TLSConfig(cert="", key="", ca="", min_version="1.3", expiry_warn_days=30)
    fed = FederationConfig()
    assert (fed.reconnect_base_ms, fed.reconnect_max_ms) == (500, 60000)
    assert fed.reconnect_jitter == 0.2
    assert fed.send_buffer_messages == 10000
    assert fed.max_batch_bytes == 4 * 1024 * 1024
    assert DedupConfig().seen_id_lru_size == 100000
    assert AuditConfig() == AuditConfig(max_size_mb=100, max_files=10)
    assert AllowedPeer("p") == AllowedPeer(name="p", subscribe=[], publish=[])
    assert HubEndpoint("h:1") == HubEndpoint(addr="h:1", subscribe=[], publish=[])


def test_default_lists_are_not_shared() -> None:
    a, b = HubConfig(), HubConfig()
    a.allowed_peers.append(AllowedPeer("x"))
    assert b.allowed_peers == []
    p, q = AllowedPeer("p"), AllowedPeer("q")
    p.subscribe.append("c")
    assert q.subscribe == []


def test_name_defaults_to_hostname() -> None:
    assert Config().name == socket.gethostname()
    cfg = Config.from_dict({"storage": {"data_dir": "/d"}})
    assert cfg.name == socket.gethostname()
    cfg = Config.from_dict({"name": None, "storage": {"data_dir": "/d"}})
    assert cfg.name == socket.gethostname()


def test_minimal_dict_gets_all_defaults() -> None:
    cfg = Config.from_dict({"name": "n", "storage": {"data_dir": "/d"}})
    assert cfg == Config(name="n", storage=StorageConfig(data_dir="/d"))
    assert cfg.federation == FederationConfig()
    assert cfg.hub == HubConfig()


def test_null_sections_and_values_take_defaults() -> None:
    cfg = Config.from_dict(
        {
            "name": "n",
            "storage": {"data_dir": "/d", "segment_size_mb": None},
            "hub": None,
            "federation": {"reconnect_jitter": None},
        }
    )
    assert cfg.storage.segment_mb() == 256
    assert cfg.hub == HubConfig()
    assert cfg.federation.reconnect_jitter == 0.2


# --------------------------------------------------------------------------- full example


def test_full_example_loads(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FULL_EXAMPLE))
    assert cfg.name == "billing-host"
    assert cfg.storage == StorageConfig(
        data_dir="/var/lib/keyop/billing",
        sync_interval_ms=0,
        max_subscriber_lag_mb=512,
        segment_size_mb=256,
        offset_flush_interval_ms=0,
    )
    assert cfg.subscribers.max_retries == 5
    assert cfg.hub.enabled is True
    assert cfg.hub.listen_addr == "0.0.0.0:7740"
    assert cfg.hub.fed_client_offset_ttl == td(hours=168)
    assert cfg.hub.allowed_peers == [
        AllowedPeer(name="sensor-1", subscribe=[], publish=["temps"]),
        AllowedPeer(name="dash-1", subscribe=["alerts", "metrics"], publish=[]),
    ]
    assert cfg.client.enabled is True
    assert cfg.client.hubs == [
        HubEndpoint(addr="hub2.example.net:7740", subscribe=["commands"], publish=["alerts"])
    ]
    assert cfg.tls == TLSConfig(
        cert="/etc/keyop/billing-host.crt",
        key="/etc/keyop/billing-host.key",
        ca="/etc/keyop/ca.crt",
        min_version="1.3",
        expiry_warn_days=30,
    )
    assert cfg.federation == FederationConfig(
        reconnect_base_ms=500,
        reconnect_max_ms=60000,
        reconnect_jitter=0.2,
        send_buffer_messages=10000,
        max_batch_bytes=4194304,
    )
    assert cfg.dedup.seen_id_lru_size == 100000
    assert cfg.audit == AuditConfig(max_size_mb=100, max_files=10)


def test_load_config_accepts_str_path(tmp_path: Path) -> None:
    path = write(tmp_path, "name: a\nstorage:\n  data_dir: /d\n")
    assert load_config(str(path)).name == "a"


# --------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("168h", td(hours=168)),
        ("30m", td(minutes=30)),
        ("1h30m", td(hours=1, minutes=30)),
        ("500ms", td(milliseconds=500)),
        ("1.5h", td(hours=1, minutes=30)),
        ("-1h", td(hours=-1)),
        ("+2s", td(seconds=2)),
        ("0", td(0)),
        ("-0", td(0)),
        ("0s", td(0)),
        ("10s", td(seconds=10)),
        ("1m0.5s", td(minutes=1, milliseconds=500)),
        (".5s", td(milliseconds=500)),
        ("250us", td(microseconds=250)),
        ("250\u00b5s", td(microseconds=250)),
        ("250\u03bcs", td(microseconds=250)),
        ("1500ns", td(microseconds=1)),
        ("2h45m30.5s", td(hours=2, minutes=45, seconds=30, milliseconds=500)),
        ("1h1h", td(hours=2)),
    ],
)
def test_parse_duration(text: str, expected: datetime.timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "invalid duration"),
        ("3600", "missing unit"),
        ("1.5", "missing unit"),
        ("1h30", "invalid duration"),
        ("1d", "invalid duration"),
        ("h", "invalid duration"),
        ("1 h", "invalid duration"),
        ("--1h", "invalid duration"),
        ("1H", "invalid duration"),
        ("abc", "invalid duration"),
        ("99999999h", "out of range"),
    ],
)
def test_parse_duration_errors(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_duration(text)


def test_parse_duration_rejects_non_string() -> None:
    with pytest.raises(TypeError):
        parse_duration(5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (td(hours=168), "168h0m0s"),
        (td(minutes=30), "30m0s"),
        (td(seconds=1, milliseconds=500), "1.5s"),
        (td(milliseconds=500), "500ms"),
        (td(microseconds=1), "1\u00b5s"),
        (td(microseconds=1500), "1.5ms"),
        (td(0), "0s"),
        (td(hours=-1), "-1h0m0s"),
        (td(hours=1, seconds=5), "1h0m5s"),
    ],
)
def test_format_duration(value: datetime.timedelta, expected: str) -> None:
    assert format_duration(value) == expected
    assert parse_duration(expected) == value


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("30m", td(minutes=30)),
        ("-1h", td(hours=-1)),
        (td(hours=2), td(hours=2)),
        (0, DEFAULT_FED_CLIENT_OFFSET_TTL),  # zero means default, as in the original
        ("0s", DEFAULT_FED_CLIENT_OFFSET_TTL),
        (None, DEFAULT_FED_CLIENT_OFFSET_TTL),
    ],
)
def test_ttl_values_in_from_dict(raw: Any, expected: datetime.timedelta) -> None:
    cfg = Config.from_dict(minimal(hub={"fed_client_offset_ttl": raw}))
    assert cfg.hub.fed_client_offset_ttl == expected


@pytest.mark.parametrize(("raw", "fragment"), [
    (3600, "bare number"),
    (1.5, "bare number"),
    ("3600", "missing unit"),
    ("1 week", "invalid duration"),
    (True, "duration"),
    ([1], "duration"),
])
def test_ttl_bad_values_reported(raw: Any, fragment: str) -> None:
    problems = problems_of(minimal(hub={"fed_client_offset_ttl": raw}))
    assert len(problems) == 1
    assert problems[0].startswith("hub.fed_client_offset_ttl: ")
    assert fragment in problems[0]


def test_ttl_from_yaml_unquoted(tmp_path: Path) -> None:
    path = write(
        tmp_path, "name: a\nstorage: {data_dir: /d}\nhub:\n  fed_client_offset_ttl: 1h30m\n"
    )
    assert load_config(path).hub.fed_client_offset_ttl == td(minutes=90)


def test_zero_ttl_built_in_code_is_reported() -> None:
    cfg = Config(name="n", storage=StorageConfig(data_dir="/d"),
                 hub=HubConfig(fed_client_offset_ttl=td(0)))
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert keys_of(info.value.problems) == ["hub.fed_client_offset_ttl"]


# --------------------------------------------------------------------------- max_retries


def test_max_retries_null_and_absent_mean_five() -> None:
    assert Config.from_dict(minimal(subscribers={"max_retries": None})).subscribers.max_retries == 5
    assert Config.from_dict(minimal(subscribers={})).subscribers.max_retries == 5
    assert Config.from_dict(minimal()).subscribers.max_retries == 5


def test_max_retries_zero_is_honoured() -> None:
    assert Config.from_dict(minimal(subscribers={"max_retries": 0})).subscribers.max_retries == 0


def test_max_retries_from_yaml_null(tmp_path: Path) -> None:
    path = write(tmp_path, "name: a\nstorage: {data_dir: /d}\nsubscribers:\n  max_retries:\n")
    assert load_config(path).subscribers.max_retries == 5


def test_max_retries_negative_reported() -> None:
    assert problems_of(minimal(subscribers={"max_retries": -1})) == [
        "subscribers.max_retries: must be >= 0, got -1"
    ]


# --------------------------------------------------------------------------- validation


def test_missing_data_dir() -> None:
    assert problems_of({"name": "n"}) == ["storage.data_dir: required"]
    assert problems_of({"name": "n", "storage": {"data_dir": ""}}) == ["storage.data_dir: required"]


def test_many_problems_reported_at_once() -> None:
    d = {
        "name": "n",
        "storage": {"sync_interval_ms": -5},
        "federation": {"reconnect_jitter": 1.5, "send_buffer_messages": 0},
        "dedup": {"seen_id_lru_size": 0},
        "audit": {"max_size_mb": -1, "max_files": 0},
        "tls": {"min_version": "1.1", "expiry_warn_days": -1},
    }
    problems = problems_of(d)
    assert len(problems) == 9
    assert sorted(keys_of(problems)) == sorted([
        "storage.data_dir",
        "storage.sync_interval_ms",
        "federation.reconnect_jitter",
        "federation.send_buffer_messages",
        "dedup.seen_id_lru_size",
        "audit.max_size_mb",
        "audit.max_files",
        "tls.min_version",
        "tls.expiry_warn_days",
    ])
    assert "federation.reconnect_jitter: must be between 0 and 1, got 1.5" in problems
    assert "storage.data_dir: required" in problems


def test_config_error_message_lists_all_problems() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"name": "", "audit": {"max_files": 0}})
    text = str(info.value)
    assert "name:" in text
    assert "storage.data_dir: required" in text
    assert "audit.max_files" in text
    assert len(info.value.problems) == 3


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("storage", "offset_flush_interval_ms", -1),
        ("federation", "reconnect_base_ms", 0),
        ("federation", "reconnect_base_ms", -10),
        ("federation", "send_buffer_messages", -1),
        ("federation", "max_batch_bytes", 0),
        ("federation", "reconnect_jitter", -0.1),
        ("dedup", "seen_id_lru_size", -1),
        ("audit", "max_size_mb", 0),
        ("tls", "expiry_warn_days", -1),
    ],
)
def test_out_of_range_values(section: str, key: str, value: Any) -> None:
    assert keys_of(problems_of(minimal(**{section: {key: value}}))) == [f"{section}.{key}"]


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("storage", "segment_size_mb", 0),
        ("storage", "segment_size_mb", -1),
        ("storage", "max_subscriber_lag_mb", -1),
        ("storage", "max_subscriber_lag_mb", 0),
        ("storage", "sync_interval_ms", 100),
        ("federation", "reconnect_jitter", 0),
        ("federation", "reconnect_jitter", 1),
        ("federation", "reconnect_max_ms", 500),
        ("tls", "expiry_warn_days", 0),
        ("tls", "min_version", "1.2"),
    ],
)
def test_accepted_edge_values(section: str, key: str, value: Any) -> None:
    cfg = Config.from_dict(minimal(**{section: {key: value}}))
    assert getattr(getattr(cfg, section), key) == value


def test_reconnect_max_below_base() -> None:
    problems = problems_of(
        minimal(federation={"reconnect_base_ms": 1000, "reconnect_max_ms": 999})
    )
    assert keys_of(problems) == ["federation.reconnect_max_ms"]
    assert "1000" in problems[0]


def test_int_accepted_for_float_jitter() -> None:
    cfg = Config.from_dict(minimal(federation={"reconnect_jitter": 1}))
    assert cfg.federation.reconnect_jitter == 1.0
    assert isinstance(cfg.federation.reconnect_jitter, float)


def test_empty_name_reported() -> None:
    assert keys_of(problems_of(minimal(name=""))) == ["name"]


def test_hub_enabled_requirements() -> None:
    problems = problems_of(minimal(hub={"enabled": True}))
    assert sorted(keys_of(problems)) == ["hub.listen_addr", "tls.ca", "tls.cert", "tls.key"]


def test_hub_enabled_complete_is_valid() -> None:
    cfg = Config.from_dict(
        minimal(
            hub={"enabled": True, "listen_addr": ":0"},
            tls={"cert": "c.pem", "key": "k.pem", "ca": "ca.pem"},
        )
    )
    assert cfg.hub.enabled is True


@pytest.mark.parametrize("addr", ["0.0.0.0:7740", ":7740", "localhost:0", "[::1]:65535", "h:1"])
def test_listen_addr_ok(addr: str) -> None:
    assert Config.from_dict(minimal(hub={"listen_addr": addr})).hub.listen_addr == addr


@pytest.mark.parametrize("addr", ["7740", "host", "host:", "host:65536", "host:http", "::1:80",
                                  "[::1]", "host:-1"])
def test_listen_addr_bad(addr: str) -> None:
    assert keys_of(problems_of(minimal(hub={"listen_addr": addr}))) == ["hub.listen_addr"]


def test_allowed_peer_names() -> None:
    problems = problems_of(
        minimal(
            hub={
                "allowed_peers": [
                    {"name": "a"},
                    {"publish": ["x"]},
                    {"name": "b"},
                    {"name": "a", "subscribe": ["y"]},
                    {"name": ""},
                ]
            }
        )
    )
    assert keys_of(problems) == [
        "hub.allowed_peers[1].name",
        "hub.allowed_peers[3].name",
        "hub.allowed_peers[4].name",
    ]
    assert "duplicate" in problems[1]
    assert "hub.allowed_peers[0]" in problems[1]


TLS_FILES = {"cert": "c.pem", "key": "k.pem", "ca": "ca.pem"}


def test_client_enabled_requires_hubs() -> None:
    for hubs in ({}, {"hubs": []}):
        problems = problems_of(minimal(client={"enabled": True, **hubs}, tls=TLS_FILES))
        assert keys_of(problems) == ["client.hubs"]


def test_client_hub_addresses() -> None:
    problems = problems_of(
        minimal(
            client={
                "enabled": True,
                "hubs": [{"addr": "hub:7740"}, {"subscribe": ["a"]}, {"addr": "nohost"}],
            },
            tls=TLS_FILES,
        )
    )
    assert keys_of(problems) == ["client.hubs[1].addr", "client.hubs[2].addr"]
    assert "required" in problems[0]


def test_enabled_client_without_tls_is_refused() -> None:
    """Weak spot 40 (silent plaintext): the original dialed ``ws://`` when no
    certificate was configured. An enabled client without the TLS files is a
    configuration error naming each missing key."""
    problems = problems_of(minimal(client={"enabled": True, "hubs": [{"addr": "hub:7740"}]}))
    assert keys_of(problems) == ["tls.cert", "tls.key", "tls.ca"], (
        f"an enabled client without tls.cert/key/ca must be refused: {problems}"
    )
    assert all("client.enabled" in p for p in problems), problems
    # Each file alone is not enough either.
    for missing in ("cert", "key", "ca"):
        tls = {k: v for k, v in TLS_FILES.items() if k != missing}
        problems = problems_of(
            minimal(client={"enabled": True, "hubs": [{"addr": "hub:7740"}]}, tls=tls)
        )
        assert keys_of(problems) == [f"tls.{missing}"], f"tls.{missing} is required: {problems}"
    # A disabled client (and no hub) needs no TLS.
    Config.from_dict(minimal(client={"enabled": False, "hubs": [{"addr": "hub:7740"}]}))


@pytest.mark.parametrize("scheme", ["ws://", "wss://", "http://"])
def test_hub_address_with_a_scheme_is_refused(scheme: str) -> None:
    """A hub address is ``host:port``; a ``ws://`` URL cannot ask for plaintext."""
    problems = problems_of(
        minimal(client={"enabled": True, "hubs": [{"addr": f"{scheme}hub:7740"}]}, tls=TLS_FILES)
    )
    assert keys_of(problems) == ["client.hubs[0].addr"], (
        f"a {scheme} hub address must be refused: {problems}"
    )


def test_client_disabled_tolerates_missing_addr() -> None:
    cfg = Config.from_dict(minimal(client={"enabled": False, "hubs": [{"publish": ["a"]}]}))
    assert cfg.client.hubs == [HubEndpoint(addr="", publish=["a"])]


def test_tls_cert_and_key_go_together() -> None:
    problems = problems_of(minimal(tls={"cert": "c.pem", "ca": "ca.pem"}))
    assert keys_of(problems) == ["tls.key"]
    problems = problems_of(minimal(tls={"key": "k.pem"}))
    assert keys_of(problems) == ["tls.cert"]
    problems = problems_of(minimal(tls={"cert": "c.pem", "key": "k.pem"}))
    assert keys_of(problems) == ["tls.ca"]


def test_tls_min_version() -> None:
    for bad in ("1.1", "1.0", "TLS1.3", "", "1.30"):
        problems = problems_of(minimal(tls={"min_version": bad}))
        assert keys_of(problems) == ["tls.min_version"], bad
        assert '"1.2" or "1.3"' in problems[0]


def test_tls_min_version_unquoted_yaml_number_accepted(tmp_path: Path) -> None:
    path = write(tmp_path, "name: a\nstorage: {data_dir: /d}\ntls:\n  min_version: 1.2\n")
    assert load_config(path).tls.min_version == "1.2"
    bad = write(tmp_path, "name: a\nstorage: {data_dir: /d}\ntls:\n  min_version: 1.1\n", "b.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert keys_of(info.value.problems) == ["tls.min_version"]


# --------------------------------------------------------------------------- unknown keys


def test_unknown_keys_reported_at_every_level() -> None:
    d = minimal(
        bogus=1,
        storage={"max_segment_bytes": 67108864},
        hub={"allowed_peers": [{"name": "a", "pubish": ["x"]}]},
        client={"hubs": [{"addr": "h:1", "extra": True}]},
        federation={"reconnect_base": 100},
    )
    problems = problems_of(d)
    assert sorted(keys_of(problems)) == sorted([
        "bogus",
        "storage.max_segment_bytes",
        "hub.allowed_peers[0].pubish",
        "client.hubs[0].extra",
        "federation.reconnect_base",
    ])
    assert all("unknown key" in p for p in problems)
    segment = next(p for p in problems if p.startswith("storage.max_segment_bytes"))
    assert "segment_size_mb" in segment
    typo = next(p for p in problems if p.startswith("hub.allowed_peers[0].pubish"))
    assert "publish" in typo


# --------------------------------------------------------------------------- wrong types


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("storage", "sync_interval_ms", "100"),
        ("storage", "sync_interval_ms", True),
        ("storage", "segment_size_mb", 1.5),
        ("storage", "data_dir", 5),
        ("subscribers", "max_retries", "5"),
        ("subscribers", "max_retries", False),
        ("hub", "enabled", "yes please"),
        ("hub", "enabled", 1),
        ("hub", "listen_addr", 7740),
        ("tls", "cert", ["a"]),
        ("federation", "reconnect_jitter", "0.2"),
        ("federation", "reconnect_jitter", True),
        ("dedup", "seen_id_lru_size", {"a": 1}),
        ("audit", "max_files", "ten"),
    ],
)
def test_wrong_scalar_types_reported(section: str, key: str, value: Any) -> None:
    problems = problems_of(minimal(**{section: {key: value}}))
    assert keys_of(problems) == [f"{section}.{key}"]
    assert "must be" in problems[0]


def test_wrong_type_does_not_cascade() -> None:
    # a mistyped data_dir is reported once, not also as "required"
    assert keys_of(problems_of(minimal(storage={"data_dir": 0}))) == ["storage.data_dir"]
    # a mistyped reconnect_base_ms does not trigger the max >= base check
    problems = problems_of(minimal(federation={"reconnect_base_ms": "x", "reconnect_max_ms": 1}))
    assert keys_of(problems) == ["federation.reconnect_base_ms"]


def test_section_must_be_mapping() -> None:
    problems = problems_of({"name": "n", "storage": "/var/lib/keyop", "audit": [1]})
    assert keys_of(problems) == ["storage", "audit"]
    assert "mapping" in problems[0]


def test_string_lists() -> None:
    problems = problems_of(
        minimal(
            hub={"allowed_peers": [{"name": "a", "subscribe": "alerts", "publish": ["ok", 3]}]}
        )
    )
    assert keys_of(problems) == [
        "hub.allowed_peers[0].subscribe",
        "hub.allowed_peers[0].publish[1]",
    ]


def test_list_entries_must_be_mappings() -> None:
    problems = problems_of(
        minimal(
            hub={"allowed_peers": ["sensor-1", {"name": "ok"}]},
            client={"hubs": "hub:7740"},
        )
    )
    assert keys_of(problems) == ["hub.allowed_peers[0]", "client.hubs"]


def test_top_level_must_be_mapping() -> None:
    with pytest.raises(ConfigError):
        Config.from_dict(["a"])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- validate() in code


def test_validate_code_built_config() -> None:
    Config(name="n", storage=StorageConfig(data_dir="/d")).validate()
    cfg = Config(
        name="n",
        storage=StorageConfig(data_dir=""),
        federation=FederationConfig(reconnect_jitter=2.0, max_batch_bytes=0),
        hub=HubConfig(allowed_peers=[AllowedPeer("a"), AllowedPeer("a")]),
    )
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert keys_of(info.value.problems) == [
        "storage.data_dir",
        "hub.allowed_peers[1].name",
        "federation.reconnect_jitter",
        "federation.max_batch_bytes",
    ]


def test_validate_code_built_wrong_types() -> None:
    cfg = Config(name="n", storage=None, dedup=DedupConfig(seen_id_lru_size="big"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert keys_of(info.value.problems) == ["storage", "dedup.seen_id_lru_size"]


# --------------------------------------------------------------------------- file errors


def test_empty_file(tmp_path: Path) -> None:
    path = write(tmp_path, "")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "empty" in str(info.value)


def test_comment_only_file_is_empty(tmp_path: Path) -> None:
    path = write(tmp_path, "# nothing here\n")
    with pytest.raises(ConfigError, match="empty"):
        load_config(path)


def test_malformed_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "storage:\n  data_dir: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "YAML" in str(info.value)
    assert len(info.value.problems) == 1


@pytest.mark.parametrize(
    "text, key, line",
    [
        ("name: n1\nname: n2\nstorage: {data_dir: d}\n", "name", 2),
        ("name: n\nstorage:\n  data_dir: a\n  data_dir: b\n", "data_dir", 4),
        ("name: n\nstorage: {data_dir: d}\nhub: {}\nhub: {enabled: true}\n", "hub", 4),
    ],
)
def test_a_key_given_twice_is_refused(tmp_path: Path, text: str, key: str, line: int) -> None:
    # The second silently replaced the first; Go's yaml.v3 (1.4) refuses it.
    with pytest.raises(ConfigError, match=f"key '{key}' is given twice at line {line}"):
        load_config(write(tmp_path, text))


def test_a_merged_key_may_be_overridden(tmp_path: Path) -> None:
    # YAML's merge keys are defaults the mapping may override.
    text = "name: n\nstorage:\n  <<: {data_dir: d, sync_interval_ms: 5}\n  sync_interval_ms: 7\n"
    assert load_config(write(tmp_path, text)).storage.sync_interval_ms == 7


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_directory_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_not_mapping(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "mapping" in str(info.value)


def test_load_config_reports_validation_problems(tmp_path: Path) -> None:
    path = write(tmp_path, "name: a\nstorage:\n  max_segment_bytes: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert sorted(keys_of(info.value.problems)) == [
        "storage.data_dir", "storage.max_segment_bytes"
    ]


def test_config_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        Config.from_dict({})


# --------------------------------------------------------------------------- round trip


def test_round_trip_full_example(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FULL_EXAMPLE))
    d = cfg.to_dict()
    assert d["hub"]["fed_client_offset_ttl"] in ("168h", "168h0m0s")
    assert d["hub"]["allowed_peers"][0] == {
        "name": "sensor-1", "subscribe": [], "publish": ["temps"], "max_channels": 1024
    }
    assert d["storage"]["data_dir"] == "/var/lib/keyop/billing"
    assert Config.from_dict(d) == cfg


def test_round_trip_non_default_values() -> None:
    cfg = Config(
        name="x",
        storage=StorageConfig(data_dir="/d", sync_interval_ms=50, segment_size_mb=-1),
        subscribers=SubscribersConfig(max_retries=0),
        hub=HubConfig(fed_client_offset_ttl=td(hours=-1, minutes=-30)),
        tls=TLSConfig(min_version="1.2", expiry_warn_days=0),
        federation=FederationConfig(reconnect_jitter=0.0),
    )
    cfg.validate()
    d = cfg.to_dict()
    assert d["hub"]["fed_client_offset_ttl"] == "-1h30m0s"
    again = Config.from_dict(d)
    assert again == cfg
    assert again.subscribers.max_retries == 0
    assert again.federation.reconnect_jitter == 0.0


def test_to_dict_yaml_shape_has_every_key() -> None:
    d = Config(name="n").to_dict()
    assert set(d) == {
        "name", "storage", "subscribers", "hub", "client", "tls", "federation", "dedup", "audit",
        "metrics", "retention", "log", "gateway",
    }
    assert set(d["storage"]) == {
        "data_dir", "sync_interval_ms", "max_subscriber_lag_mb",
        "segment_size_mb", "compaction_threshold_mb", "offset_flush_interval_ms",
    }
    assert set(d["retention"]) == {"max_age", "max_bytes", "channels"}
    assert d["hub"]["fed_client_offset_ttl"] == "168h0m0s"


def test_round_trip_through_yaml_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FULL_EXAMPLE))
    # JSON is a subset of YAML, so the dumped dict is a valid configuration file
    path = write(tmp_path, json.dumps(cfg.to_dict(), indent=2), "out.yaml")
    assert load_config(path) == cfg


def test_from_dict_does_not_alias_input_lists() -> None:
    publish = ["a"]
    d = minimal(client={"hubs": [{"addr": "h:1", "publish": publish}]})
    cfg = Config.from_dict(d)
    publish.append("b")
    assert cfg.client.hubs[0].publish == ["a"]


def test_metrics_listen_addr_is_checked() -> None:
    assert Config.from_dict(
        {"storage": {"data_dir": "/d"}, "metrics": {"listen_addr": "127.0.0.1:0"}}
    ).metrics.listen_addr == "127.0.0.1:0"
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"storage": {"data_dir": "/d"}, "metrics": {"listen_addr": "nope"}})
    assert [p.split(":")[0] for p in info.value.problems] == ["metrics.listen_addr"]


def test_errors_of_a_file_name_it(tmp_path: Path) -> None:
    bad = write(tmp_path, "name: a\nstorage: {data_dir: /d}\nsubscribers: {max_retries: -1}\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert info.value.path == str(bad)
    assert info.value.problems == ["subscribers.max_retries: must be >= 0, got -1"]
    assert str(info.value) == (
        f"invalid configuration in {bad}: subscribers.max_retries: must be >= 0, got -1"
    )
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match=f"in {missing}: cannot read configuration file"):
        load_config(missing)
    with pytest.raises(ConfigError) as info:
        Config.from_dict(
            {"name": "a", "storage": {"data_dir": "/d"}, "subscribers": {"max_retries": -1}}
        )
    assert info.value.path is None and "invalid configuration: " in str(info.value)


def test_an_unknown_key_with_no_close_match_lists_the_keys_of_its_section() -> None:
    problems = problems_of(minimal(storage={"data_dir": "/d", "colour": 1}))
    assert problems == [
        "storage.colour: unknown key (the keys in storage are: data_dir, sync_interval_ms, "
        "max_subscriber_lag_mb, segment_size_mb, compaction_threshold_mb, "
        "offset_flush_interval_ms)"
    ]
