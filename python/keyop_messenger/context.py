"""Publishing context: service name and correlation id for publishes in a block."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["context", "current_context", "resolve"]

_CONTEXT: contextvars.ContextVar[tuple[str | None, str | None]] = contextvars.ContextVar(
    "keyop_messenger_context", default=(None, None)
)


@contextlib.contextmanager
def context(
    *, service_name: str | None = None, correlation_id: str | None = None
) -> Iterator[None]:
    """Sets ``service_name`` and/or ``correlation_id`` for every publish in the block.

    Blocks nest: a field not given keeps the outer block's value. Explicit
    arguments to ``publish()`` win over the context. Works per thread and per
    asyncio task (``contextvars``).
    """
    outer_service, outer_corr = _CONTEXT.get()
    token = _CONTEXT.set(
        (
            service_name if service_name is not None else outer_service,
            correlation_id if correlation_id is not None else outer_corr,
        )
    )
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_context() -> tuple[str | None, str | None]:
    """The ``(service_name, correlation_id)`` in effect."""
    return _CONTEXT.get()


def resolve(
    service_name: str | None, correlation_id: str | None
) -> tuple[str | None, str | None]:
    """Explicit values, else the ones of the enclosing :func:`context` block."""
    if service_name is None or correlation_id is None:
        ctx_service, ctx_corr = _CONTEXT.get()
        service_name = ctx_service if service_name is None else service_name
        correlation_id = ctx_corr if correlation_id is None else correlation_id
    return service_name, correlation_id
