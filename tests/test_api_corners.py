"""Small corners of the public API (client-API issue, item 8): a messenger
from a plain dict, ``Config.from_file``, what the package exports, every
method refusing after ``close()``, and payload type names checked by the
engine's rule."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
import keyop_messenger as km
from fed_helpers import PKI, client_config
from keyop_messenger import (
    ClosedError,
    Config,
    ConfigError,
    EphemeralMessenger,
    InvalidNameError,
    Messenger,
    PayloadTypeError,
    Subscription,
)
from keyop_messenger import errors as errors_module

pki = fed_helpers.pki

ROOT = Path(__file__).resolve().parent.parent


def config_dict(tmp_path: Path) -> dict[str, Any]:
    return {"name": "corner", "storage": {"data_dir": str(tmp_path / "data")}}


# -- Messenger(dict), Config.from_file ----------------------------------------


def test_messenger_accepts_a_dict(tmp_path: Path) -> None:
    with Messenger(config_dict(tmp_path)) as m:
        assert m.config == Config.from_dict(config_dict(tmp_path))
        msg_id = m.publish("temps", "t", {"c": 1})
        assert [e.message.id for e in m.read_channel("temps")] == [msg_id]


def test_messenger_dict_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        Messenger({**config_dict(tmp_path), "storage": {"sync_interval_ms": -1}})
    assert "storage.sync_interval_ms" in str(err.value)


def test_ephemeral_messenger_accepts_a_dict(pki: PKI, tmp_path: Path) -> None:
    d = client_config(pki, tmp_path, "node1", 1).to_dict()
    e = EphemeralMessenger(d)
    try:
        assert e.name == "node1"
    finally:
        e.close()


def test_config_from_file(tmp_path: Path) -> None:
    path = tmp_path / "keyop.yaml"
    path.write_text(f"name: corner\nstorage:\n  data_dir: {tmp_path / 'data'}\n")
    assert Config.from_file(path) == Config.from_dict(config_dict(tmp_path))
    assert Config.from_file(str(path)) == km.load_config(path)
    with pytest.raises(ConfigError, match="cannot read configuration file"):
        Config.from_file(tmp_path / "missing.yaml")
    with Messenger(path) as m:
        assert m.name == "corner"


# -- __all__ -------------------------------------------------------------------


def documented_names() -> set[str]:
    """``km.X`` and ``from keyop_messenger import X`` names in README and docs."""
    names: set[str] = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        names.update(re.findall(r"\bkm\.([A-Za-z_]\w*)", text))
        imports = r"from keyop_messenger import (?:\(([^)]*)\)|([^\n#]+))"
        for paren, line in re.findall(imports, text):
            for item in (paren or line).split(","):
                if item.split():
                    names.add(item.split()[0])
    return names - {"spark", "cli", "aio", "metrics", "bench"}  # submodules


def test_all_exports_what_the_docs_use() -> None:
    names = documented_names()
    assert {"Messenger", "load_config", "context", "read_channel", "Message"} <= names
    missing = sorted(names - set(km.__all__))
    assert not missing, f"README/docs use names missing from keyop_messenger.__all__: {missing}"


def test_all_exports_every_error_and_resolves() -> None:
    errors = {
        name
        for name, obj in vars(errors_module).items()
        if isinstance(obj, type) and issubclass(obj, km.KeyopError)
    }
    assert not errors - set(km.__all__), errors - set(km.__all__)
    # What a reader of read_channel's and subscribe's signatures needs too.
    assert {"PayloadRegistry", "Handler", "Subscription", "LogEntry"} <= set(km.__all__)
    namespace: dict[str, Any] = {}
    exec("from keyop_messenger import *", namespace)
    assert set(km.__all__) <= set(namespace)
    assert len(km.__all__) == len(set(km.__all__))


# -- after close -----------------------------------------------------------------

#: An argument for each required parameter a public method may take.
ARGS: dict[str, Any] = {
    "channel": "temps",
    "subscriber_id": "sub",
    "handler": lambda message: None,
    "payload_type": "t",
    "payload": {"c": 1},
    "items": [("t", {"c": 1})],
    "name": "x.Type",
    "cls": dict,
    "timeout": 0.1,
    "peers": [],
    "position": "earliest",
    "tls": None,
    "allowed_peers": [],
    "tokens": [],
}


def public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """Public callables of ``cls`` (inherited and native ones included),
    properties left out."""
    out = {}
    for name in dir(cls):
        if name.startswith("_") or name == "close":
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, property) or not callable(getattr(cls, name)):
            continue
        out[name] = getattr(cls, name)
    return out


def call_all_after_close(obj: Any, cls: type) -> list[str]:
    """Calls every public method of the closed ``obj``; returns those that did
    not raise ClosedError at the call."""
    wrong = []
    for name in public_methods(cls):
        method = getattr(obj, name)
        try:
            sig = inspect.signature(method)
        except (TypeError, ValueError):  # a native method without a signature
            sig = None
        args = []
        for p in sig.parameters.values() if sig else []:
            if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.name not in ARGS:
                pytest.fail(f"{cls.__name__}.{name}: add an argument for {p.name!r} to ARGS")
            args.append(ARGS[p.name])
        if sig is None and name == "publish":
            args = [ARGS["channel"], ARGS["payload_type"], ARGS["payload"]]
        try:
            method(*args)
        except ClosedError as exc:
            assert "is closed" in str(exc), (name, exc)
        except Exception as exc:  # reported below
            wrong.append(f"{name}: {type(exc).__name__}: {exc}")
        else:
            wrong.append(f"{name}: no error")
    return wrong


def test_every_messenger_method_raises_closed_error_after_close(tmp_path: Path) -> None:
    m = Messenger(config_dict(tmp_path))
    m.publish("temps", "t", {"c": 1})
    m.close()
    methods = set(public_methods(Messenger))
    assert {"publish", "publish_batch", "subscribe", "unsubscribe", "read_channel", "stats",
            "compact", "federation_status", "register_payload_type", "stream_end"} <= methods
    assert call_all_after_close(m, Messenger) == []
    m.close()  # still idempotent


def test_every_ephemeral_method_raises_closed_error_after_close(
    pki: PKI, tmp_path: Path
) -> None:
    e = EphemeralMessenger(client_config(pki, tmp_path, "node1", 1))
    e.close()
    methods = set(public_methods(EphemeralMessenger))
    assert {"connect", "publish", "publish_batch", "subscribe", "status",
            "register_payload_type"} <= methods
    assert call_all_after_close(e, EphemeralMessenger) == []


@pytest.mark.parametrize("closer", ["subscription", "messenger"])
def test_every_subscription_method_raises_closed_error_after_close(
    tmp_path: Path, closer: str
) -> None:
    m = Messenger(config_dict(tmp_path))
    try:
        sub = m.subscribe("temps", "sub", lambda message: None)
        (sub if closer == "subscription" else m).close()
        assert call_all_after_close(sub, Subscription) == []
        assert (sub.channel, sub.subscriber_id) == ("temps", "sub")
    finally:
        m.close()


def test_closed_guard_covers_methods_added_later() -> None:
    """The guard is a class decorator over every public method, so one added
    without thinking of close() is covered too."""
    from keyop_messenger._closing import refuse_when_closed

    @refuse_when_closed(lambda o: o.done, lambda o: "thing")
    class Thing:
        done = False

        def new_method(self) -> int:
            return 1

        def gen(self) -> Any:
            yield 1

        def close(self) -> None:
            self.done = True

    t = Thing()
    assert t.new_method() == 1
    t.close()
    with pytest.raises(ClosedError, match=r"thing is closed: new_method\(\) cannot be called"):
        t.new_method()
    with pytest.raises(ClosedError):
        t.gen()  # at the call, not at the first next()


# -- payload type names ---------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["a\nb", "tab\there", "nul\x00", "del\x7f", "c1\x85", "x" * 256]
)
def test_register_payload_type_refuses_what_the_engine_refuses(
    tmp_path: Path, name: str
) -> None:
    with Messenger(config_dict(tmp_path)) as m:
        with pytest.raises(InvalidNameError, match="payload_type") as reg:
            m.register_payload_type(name, dict)
        assert m._registry.registered(name) is None
        # The same rule as a publish with that type: one definition.
        with pytest.raises(InvalidNameError) as pub:
            m.publish("temps", name, {})
        assert str(reg.value) == str(pub.value)


@pytest.mark.parametrize("name", ["x" * 255, "com.example.Reading", "héllo wörld", "a/b:c"])
def test_register_payload_type_accepts_valid_names(tmp_path: Path, name: str) -> None:
    with Messenger(config_dict(tmp_path)) as m:
        m.register_payload_type(name, dict)
        m.publish("temps", name, {"k": 1})
        assert [e.message.payload_type for e in m.read_channel("temps")] == [name]


def test_register_payload_type_empty_name_is_still_a_payload_type_error(tmp_path: Path) -> None:
    with Messenger(config_dict(tmp_path)) as m, pytest.raises(PayloadTypeError):
        m.register_payload_type("", dict)


def test_async_messenger_accepts_a_dict(tmp_path: Path) -> None:
    import asyncio

    from keyop_messenger.aio import AsyncMessenger

    async def main() -> list[str]:
        async with AsyncMessenger(config_dict(tmp_path)) as m:
            msg_id = await m.publish("temps", "t", {"c": 1})
            return [msg_id, *(e.message.id for e in m.messenger.read_channel("temps"))]

    first, *stored = asyncio.run(main())
    assert stored == [first]


# -- refused arguments -----------------------------------------------------------


def test_with_on_a_closed_messenger_raises_closed_error(tmp_path: Path) -> None:
    m = Messenger(config_dict(tmp_path))
    m.close()
    with pytest.raises(ClosedError), m:
        pass


def test_subscribe_refuses_a_handler_that_cannot_be_called(tmp_path: Path) -> None:
    with Messenger(config_dict(tmp_path)) as m:
        for handler in (None, 5):
            with pytest.raises(TypeError, match="handler must be callable"):
                m.subscribe("c", "s", handler)  # type: ignore[arg-type]
        assert not (tmp_path / "data" / "subscribers" / "c" / "s.offset").exists()


@pytest.mark.parametrize(
    "options",
    [
        {"max_retries": 10**12},
        {"max_retries": -1},
        {"backoff": (0.0, float("inf"))},
        {"backoff": (1e300, 1e300)},
        {"backoff": (float("nan"), 1.0)},
        {"backoff": (1.0, 0.5)},
    ],
    ids=["retries-huge", "retries-negative", "backoff-inf", "backoff-huge", "backoff-nan",
         "backoff-reversed"],
)  # fmt: skip
def test_out_of_range_subscriber_options_are_config_errors(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    with Messenger(config_dict(tmp_path)) as m:
        with pytest.raises(ConfigError, match="max_retries must be between 0 and"):
            m.subscribe("c", "s", lambda msg: None, **options)


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("storage", "sync_interval_ms", 10**30, "must be between"),
        ("storage", "segment_size_mb", 2**21, "must be <= 1048576"),
        ("subscribers", "max_retries", 10**12, "must be <= 4294967295"),
        ("audit", "max_files", 2**32, "must be <= 4294967295"),
    ],
)
def test_out_of_range_configuration_integers_are_config_errors(
    tmp_path: Path, section: str, key: str, value: int, message: str
) -> None:
    doc = config_dict(tmp_path)
    doc.setdefault(section, {})[key] = value
    with pytest.raises(ConfigError, match=f"{section}.{key}: {message}"):
        Messenger(doc)
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("timeout", [-1.0, float("nan")])
def test_flush_refuses_a_bad_timeout(tmp_path: Path, timeout: float) -> None:
    with Messenger(config_dict(tmp_path)) as m:
        m.publish("c", "t", 1)
        with pytest.raises(ValueError, match="timeout must be a finite number"):
            m.flush(timeout)



def test_a_timeout_longer_than_any_clock_is_a_long_wait(tmp_path: Path) -> None:
    # 1e300 s is finite and >= 0: a wait no clock holds, the same as a long one
    # (it raised a Rust panic, which `except Exception` misses, and left the
    # directory locked after close).
    m = Messenger(config_dict(tmp_path))
    m.publish("c", "t", 1)
    m.publish("c", "t", 2, wait=False).wait(1e300)
    m.flush(1e300)
    m.close(1e300)
    with Messenger(config_dict(tmp_path)) as again:  # the directory was released
        assert [e.message.payload for e in again.read_channel("c")] == [1, 2]
