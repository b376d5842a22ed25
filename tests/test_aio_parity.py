"""Every public sync method of the messengers and of Subscription has an async
twin on the keyop_messenger.aio classes (found by introspection, so a method
added to the sync API without its twin fails here)."""

from __future__ import annotations

import inspect

import pytest

import keyop_messenger as km

#: Names that stay plain (sync) methods on the async classes, with the reason.
SYNC_ONLY = {
    "register_payload_type": "only records the class (no I/O); may be called before open()",
    "status": "EphemeralMessenger.status reads counters in memory (no I/O, never blocks)",
}
#: Names whose async twin is an async iterator (``async for``), not a coroutine.
ASYNC_ITERATORS = {
    "read_channel": "iterates entries; each chunk is read on a worker thread",
}

PAIRS = [
    (km.Messenger, km.AsyncMessenger),
    (km.EphemeralMessenger, km.AsyncEphemeralMessenger),
    (km.Subscription, km.AsyncSubscription),
]


def public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


@pytest.mark.parametrize(("sync_cls", "async_cls"), PAIRS, ids=lambda c: c.__name__)
def test_every_sync_method_has_an_async_twin(sync_cls: type, async_cls: type) -> None:
    problems = []
    for name in sorted(public(sync_cls)):
        sync_attr = inspect.getattr_static(sync_cls, name)
        if not hasattr(async_cls, name):
            problems.append(f"{async_cls.__name__}.{name} is missing")
            continue
        twin = inspect.getattr_static(async_cls, name)
        if isinstance(sync_attr, property):
            if not isinstance(twin, property):
                problems.append(f"{async_cls.__name__}.{name} should be a property")
            continue
        if name in SYNC_ONLY:
            continue
        fn = getattr(async_cls, name)
        if name in ASYNC_ITERATORS:
            # An AsyncGenerator (an AsyncIterator with aclose(), so that
            # contextlib.aclosing() accepts it).
            if "AsyncGenerator" not in str(inspect.signature(fn).return_annotation):
                problems.append(f"{async_cls.__name__}.{name} should return an AsyncGenerator")
        elif not inspect.iscoroutinefunction(fn):
            problems.append(f"{async_cls.__name__}.{name} is not a coroutine function")
    assert not problems, "; ".join(problems)


def test_async_classes_are_exported_at_the_top_level() -> None:
    for name in ("AsyncMessenger", "AsyncEphemeralMessenger", "AsyncSubscription", "MessageStream"):
        assert name in km.__all__
        assert getattr(km, name) is getattr(km.aio, name)
